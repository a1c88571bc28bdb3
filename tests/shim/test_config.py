"""Configuration of the shim from the environment: malformed limits, MPSSHIM_DISABLE,
MPSSHIM_LOG, and an unusable accounting region."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shim.conftest import G, M, ShimEnv

LIMIT_VAR = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

MALFORMED = [
    "0=4X",  # unknown unit
    "0=",  # no size
    "=4G",  # no device
    "0=4G,",  # trailing comma
    "0=4G,0=2G",  # duplicate device
    "0=99999999999999999999",  # above 2^64-1
    "0=16777216T",  # 2^64 bytes: overflow through the unit
    "zero=1G",  # not an ordinal or UUID
    "0=1G;1=2G",  # wrong separator
    " 0=1G",  # whitespace
    "0=1.5G",  # fractions
    "64=1G",  # ordinal out of range
    "0=-1G",  # negative
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_limit_fails_cuda_init_and_every_allocation_with_one_line(shim: ShimEnv, text: str) -> None:
    r = shim.run(
        "gpa2",
        ["init", "ctx", 0, "alloc", M, "ctx", 1, "alloc", M, "calls", "cuMemAlloc_v2", "calls", "cuInit"],
        limit=text,
    )
    assert r.rcs("init") == [1]  # CUDA_ERROR_INVALID_VALUE; the real cuInit never ran
    assert r.rcs("ctx") == [3, 3]  # so the driver stays uninitialised
    assert r.rcs("alloc") == [2, 2]
    assert [line["n"] for line in r.of("calls")] == [0, 0]
    assert len(r.stderr_lines) == 1, r.stderr
    assert LIMIT_VAR in r.stderr_lines[0]
    assert f'"{text}"' in r.stderr_lines[0]


@pytest.mark.parametrize("mode", ["link", "dlsym", "gpa", "gpa2"])
def test_disable_passes_everything_through(shim: ShimEnv, mode: str) -> None:
    r = shim.run(
        mode,
        ["init", "ctx", 0, "alloc", 2 * G, "used", 0, "info", "total", 0, "where", "cuMemAlloc"],
        limit="0=1G",
        extra={"MPSSHIM_DISABLE": "1"},
    )
    assert r.rcs("alloc") == [0]
    assert r.of("used")[0]["bytes"] == 2 * G
    assert r.of("info")[0]["total"] == 16 * G
    assert r.of("total")[0]["total"] == 16 * G
    if mode != "link":  # no redirection at all: the driver's own function
        assert r.of("where")[0]["file"] == "libcuda.so.1"
    assert r.stderr_lines == []


def test_disable_also_ignores_a_malformed_limit(shim: ShimEnv) -> None:
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", G], limit="0=junk", extra={"MPSSHIM_DISABLE": "true"})
    assert r.rcs("init") == [0]
    assert r.rcs("alloc") == [0]


def test_an_unknown_disable_value_keeps_the_caps_and_says_so(shim: ShimEnv) -> None:
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", 2 * G], limit="0=1G", extra={"MPSSHIM_DISABLE": "please"})
    assert r.rcs("alloc") == [2]
    assert any("MPSSHIM_DISABLE" in line and '"please"' in line for line in r.stderr_lines)


@pytest.mark.parametrize(("level", "lines"), [("0", 0), ("error", 0), ("1", 1), ("warn", 1), (None, 1)])
def test_log_level_decides_whether_a_refusal_is_reported(shim: ShimEnv, level: str | None, lines: int) -> None:
    extra = {"MPSSHIM_LOG": level} if level is not None else {}
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", 2 * G], limit="0=1G", extra=extra)
    assert r.rcs("alloc") == [2]
    assert len(r.stderr_lines) == lines


@pytest.mark.parametrize("level", ["2", "info", "3", "DEBUG"])
def test_info_and_debug_report_the_configuration(shim: ShimEnv, level: str) -> None:
    r = shim.run("gpa2", ["init"], limit="0=1G", extra={"MPSSHIM_LOG": level})
    assert any("1 memory cap(s)" in line and "test.region" in line for line in r.stderr_lines), r.stderr


def test_a_bad_log_level_is_named(shim: ShimEnv) -> None:
    r = shim.run("gpa2", ["init"], limit="0=1G", extra={"MPSSHIM_LOG": "loud"})
    assert any('MPSSHIM_LOG="loud"' in line for line in r.stderr_lines)


def test_refusals_are_rate_limited(shim: ShimEnv) -> None:
    r = shim.run("gpa2", ["init", "ctx", 0, *(["alloc", 2 * G] * 50)], limit="0=1G")
    assert r.rcs("alloc") == [2] * 50
    assert len(r.stderr_lines) == 1


def _unusable(tmp: Path, how: str) -> str:
    if how == "missing-dir":
        return str(tmp / "no" / "such" / "dir" / "r.region")
    if how == "garbage":
        path = tmp / "garbage.region"
        path.write_bytes(b"not a region " * 1000)
        return str(path)
    path = tmp / "a-directory.region"
    path.mkdir()
    return str(path)


@pytest.mark.parametrize("how", ["missing-dir", "garbage", "directory"])
def test_an_unusable_region_refuses_capped_devices_only(shim: ShimEnv, tmp_path: Path, how: str) -> None:
    region = _unusable(tmp_path, how)
    r = shim.run(
        "gpa2",
        ["init", "ctx", 0, "alloc", M, "info", "calls", "cuMemAlloc_v2", "ctx", 1, "alloc", G],
        limit="0=1G",
        extra={"MPSSHIM_REGION": region},
    )
    assert r.rcs("alloc") == [2, 0]  # capped device 0 refused, uncapped device 1 served
    assert r.of("calls")[0]["n"] == 0
    assert r.of("info")[0]["free"] == 0
    assert len(r.stderr_lines) == 1, r.stderr
    assert region in r.stderr_lines[0] and "MPSSHIM_REGION" in r.stderr_lines[0]


def test_no_limit_means_no_region_and_no_output(shim: ShimEnv, tmp_path: Path) -> None:
    region = tmp_path / "unused.region"
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", 4 * G, "info"], limit="", extra={"MPSSHIM_REGION": str(region)})
    assert r.rcs("alloc") == [0]
    assert r.of("info")[0]["total"] == 16 * G
    assert not region.exists()
    assert r.stderr_lines == []


def test_a_container_with_two_mpsd_devices_fails_cuda_init_with_one_line(shim: ShimEnv) -> None:
    """Two mpsd DRA devices in one container (mpsd/dra/cdi.py device_marker): the runtime kept one
    device's limit and region, so no cap holds for the other: CUDA is refused as for a malformed limit."""
    two = {"MPSD_DEVICE_0A1B2C3D4E5F6A7B": "uid-c_a", "MPSD_DEVICE_1A1B2C3D4E5F6A7B": "uid-c_b"}
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", M, "calls", "cuInit"], limit="0=4G", extra=two)
    assert r.rcs("init") == [1] and r.rcs("alloc") == [2]
    assert [line["n"] for line in r.of("calls")] == [0]  # the real cuInit never ran
    assert len(r.stderr_lines) == 1, r.stderr
    assert "this container has 2 mpsd devices (uid-c_a, uid-c_b)" in r.stderr_lines[0]

    # one device, beside variables that merely start alike (mpsd's own MPSD_DEVICE_PLUGIN setting)
    one = shim.run("gpa2", ["init", "ctx", 0, "alloc", M], limit="0=4G",
                   extra={"MPSD_DEVICE_0A1B2C3D4E5F6A7B": "uid-c_a", "MPSD_DEVICE_PLUGIN": "true",
                          "MPSD_DEVICE_0A1B2C3D4E5F6A7": "15 digits", "MPSD_DEVICE_0a1b2c3d4e5f6a7b": "lower"})
    assert one.rcs("init") == [0] and one.rcs("alloc") == [0] and one.stderr_lines == []
