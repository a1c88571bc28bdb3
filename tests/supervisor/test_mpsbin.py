"""Finding the machine's Debian archive for the private sources list (tests/mpsbin.py)."""

from __future__ import annotations

import pytest

from tests.mpsbin import FetchError, _run, parse_debian_source

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


def test_the_fixture_gives_the_real_binary(mps_control):
    assert mps_control.name == "nvidia-cuda-mps-control" and mps_control.stat().st_mode & 0o111


def test_a_stuck_or_missing_apt_is_a_fetch_error(tmp_path):
    # The fixture turns FetchError into a test failure with apt's output; anything else
    # would surface as an unexplained error in every test that needs the binary.
    with pytest.raises(FetchError, match="no result in 0.2s"):
        _run(["sleep", "5"], cwd=tmp_path, timeout=0.2)
    with pytest.raises(FetchError, match="cannot run"):
        _run([str(tmp_path / "no-apt-get")], cwd=tmp_path)
