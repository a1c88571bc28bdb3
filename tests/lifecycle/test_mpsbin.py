"""Finding the machine's Debian archive for the private sources list (tests/mpsbin.py)."""

from __future__ import annotations

import pytest

from tests.mpsbin import VERSIONS, FetchError, _run, embedded_version, parse_debian_source, selected_versions

DEB822 = """Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
"""


@pytest.mark.parametrize(
    "text,found",
    [
        (DEB822, ("http://deb.debian.org/debian", "bookworm")),
        ("deb http://ftp.de.debian.org/debian bookworm main\n", ("http://ftp.de.debian.org/debian", "bookworm")),
        ("deb [arch=amd64] http://mirror/debian trixie main contrib\n", ("http://mirror/debian", "trixie")),
        ("deb http://security.debian.org/debian-security bookworm-security main\n", None),
        ("deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n", None),
        ("", None),
    ],
)
def test_parse_debian_source(text, found):
    assert parse_debian_source(text) == found


@pytest.mark.every_mps_version
def test_the_fixture_gives_the_real_binary(mps_control, mps_version):
    assert mps_control.name == "nvidia-cuda-mps-control" and mps_control.stat().st_mode & 0o111
    assert embedded_version(mps_control).startswith(mps_version.split(".")[0] + ".")


@pytest.mark.parametrize(
    "value,expected",
    [
        ("", ["535.261"]),
        ("all", list(VERSIONS)),
        ("555.58", ["555.58"]),
        (" 550.163, 535.216,550.163 ", ["550.163", "535.216"]),
    ],
)
def test_selected_versions(value, expected):
    assert selected_versions(value) == expected


@pytest.mark.parametrize("value", ["535", "all,555.58", ",", "560.35"])
def test_a_bad_version_selection_is_one_line_naming_the_ids(value):
    with pytest.raises(ValueError, match=r"^MPSD_TEST_MPS_VERSIONS=.*: expected 'all' or ids from 535.261, 535.216"):
        selected_versions(value)


def test_the_embedded_version_is_the_drivers(tmp_path):
    binary = tmp_path / "b"
    binary.write_bytes(b"\x7fELF\x00junk\x00%s/control\x00555.58.02\x00CUDA MPS\x00")
    assert embedded_version(binary) == "555.58.02"
    binary.write_bytes(b"\x00no version 12.3\x00")
    assert embedded_version(binary) is None


def test_a_stuck_or_missing_apt_is_a_fetch_error(tmp_path):
    # The fixture turns FetchError into a test failure with apt's output; anything else
    # would surface as an unexplained error in every test that needs the binary.
    with pytest.raises(FetchError, match="no result in 0.2s"):
        _run(["sleep", "5"], cwd=tmp_path, timeout=0.2)
    with pytest.raises(FetchError, match="cannot run"):
        _run([str(tmp_path / "no-apt-get")], cwd=tmp_path)
