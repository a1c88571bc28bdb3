"""The shim's Python package: finding the library, the cffi mirror of ms_snapshot, reading a
region (written by the real core in csrc/region_*.c from helper processes), and the CLI."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shim
from mpsd.errors import ConfigError, SetupError
from shim._cli import format_table, human
from shim._usage import CDEF, MAX_DEVICES, DeviceUsage, ProcessUsage, RawProcess, devices_from_snapshot

REPO = Path(__file__).resolve().parents[2]
G = 1 << 30
M = 1 << 20


# ---- library_path ----------------------------------------------------------------------
def test_library_path_prefers_the_environment(tmp_path):
    lib = tmp_path / "custom.so"
    lib.write_bytes(b"")
    assert shim.library_path({"MPSSHIM_LIBRARY": str(lib)}, package_dir=tmp_path / "nowhere") == lib


def test_library_path_env_naming_nothing_is_an_error_naming_the_value(tmp_path):
    with pytest.raises(shim.ShimNotFound, match=r"MPSSHIM_LIBRARY='/no/such\.so' does not name a file"):
        shim.library_path({"MPSSHIM_LIBRARY": "/no/such.so"})


def test_library_path_falls_back_to_the_package_dir(tmp_path):
    (tmp_path / "libmpsshim.so").write_bytes(b"")
    assert shim.library_path({}, package_dir=tmp_path) == tmp_path / "libmpsshim.so"


def test_missing_library_says_how_to_build_it(tmp_path):
    with pytest.raises(shim.ShimNotFound, match=r"not found at .*; build it with `pip install -e \.` or `make -C csrc OUT="):
        shim.library_path({}, package_dir=tmp_path)
    assert issubclass(shim.ShimNotFound, SetupError)


# ---- the cffi mirror of ms_snapshot ---------------------------------------------------------
def test_cdef_layout_matches_the_c_compiler(tmp_path):
    import cffi

    exe = tmp_path / "layout"
    subprocess.run(
        ["cc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", str(REPO / "csrc")]
        + [str(REPO / "tests/e2e/snapshot_layout.c"), "-o", str(exe)],
        check=True,
    )
    c = dict(line.rsplit(" ", 1) for line in subprocess.run([exe], check=True, capture_output=True, text=True).stdout.splitlines())
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ours = {
        "sizeof(ms_snapshot)": ffi.sizeof("ms_snapshot"),
        "sizeof(ms_proc_usage)": ffi.sizeof("ms_proc_usage"),
        **{f"offsetof(ms_snapshot, {f})": ffi.offsetof("ms_snapshot", f) for f in ("version", "nprocs", "cap", "used", "procs")},
        **{f"offsetof(ms_proc_usage, {f})": ffi.offsetof("ms_proc_usage", f) for f in ("pid", "alive", "used")},
        "MS_MAX_DEVICES": MAX_DEVICES,
        "MS_SNAPSHOT_MAX_PROCS": len(ffi.new("ms_snapshot *").procs),
    }
    assert {k: int(v) for k, v in c.items()} == ours


# ---- pure conversion and formatting ---------------------------------------------------------
def test_devices_from_snapshot_lists_devices_with_a_cap_usage_or_holders():
    caps = [4 * G, 0, 0, 0]
    used = [G, 0, 0, 2 * M]
    procs = [RawProcess(10, True, [G, 0, 0, 0]), RawProcess(11, False, [0, 0, 0, 2 * M]), RawProcess(12, True, [0] * 4)]
    assert devices_from_snapshot(caps, used, procs) == [
        DeviceUsage(0, 4 * G, G, [ProcessUsage(10, True, G)]),
        DeviceUsage(3, 0, 2 * M, [ProcessUsage(11, False, 2 * M)]),
    ]


@given(
    st.lists(
        st.tuples(st.integers(1, 1 << 22), st.booleans(), st.lists(st.integers(0, 1 << 40), min_size=4, max_size=4)),
        max_size=8,
    ),
    st.lists(st.integers(0, 1 << 40), min_size=4, max_size=4),
)
def test_devices_from_snapshot_keeps_every_holding_and_drops_only_empty_devices(raw, caps):
    procs = [RawProcess(pid, alive, used) for pid, alive, used in raw]
    used = [sum(p.used[d] for p in procs) for d in range(4)]
    devices = devices_from_snapshot(caps, used, procs)
    shown = {d.device for d in devices}
    for dev in range(4):
        assert (dev in shown) == bool(caps[dev] or used[dev])
    for d in devices:
        assert sum(p.used for p in d.processes) == d.used
        assert all(p.used > 0 for p in d.processes)


@pytest.mark.parametrize(
    ("nbytes", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 * M // 2, "1.5 MiB"), (4 * G, "4.0 GiB"), (5 << 40, "5.0 TiB")]
)
def test_human_sizes(nbytes, text):
    assert human(nbytes) == text


def test_format_table_shows_caps_free_and_holders():
    table = format_table([DeviceUsage(0, 4 * G, G, [ProcessUsage(10, True, G)]), DeviceUsage(2, 0, M, [])])
    lines = table.splitlines()
    assert lines[0].split() == ["DEVICE", "CAP", "USED", "FREE", "PROCESSES"]
    assert lines[1].split() == ["0", "4.0", "GiB", "1.0", "GiB", "3.0", "GiB", "1", "(1", "alive)"]
    assert lines[2].split() == ["pid", "10", "alive", "1.0", "GiB"]
    assert lines[3].split() == ["2", "none", "1.0", "MiB", "-", "0", "(0", "alive)"]
    assert format_table([]) == "no device has a cap or usage in this region\n"


def test_framework_env():
    assert shim.framework_env() == {"TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert shim.framework_env(["PyTorch", "cupy"]) == {}
    assert shim.framework_env(["jax"], processes_share_cap=False) == {}
    with pytest.raises(ConfigError, match=r"unknown framework 'mxnet': expected one of tensorflow, jax, pytorch, cupy"):
        shim.framework_env(["mxnet"])
