"""nvmlDeviceGetMemoryInfo(_v2) report the cap of the NVML device that maps to the capped
CUDA device (by index for ordinal limits, by UUID for UUID limits), with the container's
usage, through linked symbols, dlopen + dlsym, and the real pynvml."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.shim.conftest import G, M, ShimEnv


@pytest.mark.parametrize("mode", ["link", "dlsym"])
@pytest.mark.parametrize("query", ["nvmem", "nvmem2"])
def test_nvml_reports_cap_and_usage_by_index(shim: ShimEnv, mode: str, query: str) -> None:
    r = shim.run(mode, [query, 0, "init", "ctx", 0, "alloc", 256 * M, query, 0, query, 1], limit="0=1G")
    before, after, other = r.of(query)
    assert (before["rc"], before["total"], before["used"], before["free"]) == (0, G, 0, G)
    assert (after["total"], after["used"], after["free"]) == (G, 256 * M, 768 * M)
    assert (other["total"], other["used"], other["free"]) == (8 * G, 0, 8 * G)  # uncapped: the fake's values


@pytest.mark.parametrize("mode", ["link", "dlsym"])
def test_nvml_maps_a_uuid_limit_to_the_device_with_that_uuid(shim: ShimEnv, mode: str) -> None:
    r = shim.run(
        mode,
        ["init", "ctx", 1, "alloc", 512 * M, "nvmem", 0, "nvmem", 1],
        limit="GPU-face0000-0000-0000-0000-000000000001=2G",
    )
    dev0, dev1 = r.of("nvmem")
    assert dev0["total"] == 16 * G
    assert (dev1["total"], dev1["used"], dev1["free"]) == (2 * G, 512 * M, 1536 * M)


def test_nvml_without_cuda_in_the_process_reports_the_cap(shim: ShimEnv) -> None:
    r = shim.run("dlsym", ["nvmem", 0, "nvmem2", 0], limit="0=3G")
    assert [(line["total"], line["free"]) for line in r.lines] == [(3 * G, 3 * G)] * 2


def test_nvml_untouched_when_disabled(shim: ShimEnv) -> None:
    r = shim.run("dlsym", ["nvmem", 0], limit="0=1G", extra={"MPSSHIM_DISABLE": "1"})
    assert r.of("nvmem")[0]["total"] == 16 * G


def test_pynvml_sees_the_cap(shim: ShimEnv) -> None:
    code = (
        "import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); "
        "m = pynvml.nvmlDeviceGetMemoryInfo(h); m2 = pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2); "
        "print(m.total, m.free, m2.total, m2.free)"
    )
    env = shim.env("0=1G")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(G)] * 4
