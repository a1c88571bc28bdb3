"""The fake NVML's MIG devices through the real pynvml: each answer is the one nvml.h documents
(tests/fakes/fake_nvml_mig.c cites them), so what mpsd's discovery reads here is what it reads
from a real driver."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from mpsd.inventory.nvml import use_library
from tests.fakes.nvml_build import mig_line, nvml_config_text

GIB, MIB = 1 << 30, 1 << 20
H100 = "NVIDIA H100 80GB HBM3"
P0 = "GPU-00000000-0000-0000-0000-000000000000"
P1 = "GPU-11111111-1111-1111-1111-111111111111"
P2 = "GPU-22222222-2222-2222-2222-222222222222"
M1 = "MIG-aaaaaaaa-0000-0000-0000-000000000001"
M2 = "MIG-aaaaaaaa-0000-0000-0000-000000000002"
M3 = "MIG-aaaaaaaa-0000-0000-0000-000000000003"


def layout(*migs: str) -> str:
    """GPU 0 in MIG mode with ``migs``; GPUs 1 and 2 with MIG disabled; GPU 3 without MIG (pre-Ampere)."""
    gpus = nvml_config_text(
        gpus=[
            (P0, 80 * GIB, 0, (9, 0), True, H100),
            (P1, 80 * GIB, 0, (9, 0), False, H100),
            (P2, 80 * GIB, 0, (9, 0), False, H100),
            ("GPU-33333333-3333-3333-3333-333333333333", 16 * GIB, 0, (7, 0), False, "Tesla V100"),
        ],
    )
    return gpus + "nomig 3\nminor 0 4\n" + "".join(migs)


ONE_G = mig_line(0, 0, M1, 9, 0, 1, 1, 16, 10 * GIB, GIB, "1g.10gb")
THREE_G = mig_line(0, 2, M2, 2, 0, 3, 3, 60, 40 * GIB, 0, "3g.40gb")


@pytest.fixture
def nvml(fake_nvml_lib: Path, nvml_config):
    def start(text: str) -> Path:
        path = nvml_config(text)
        use_library(str(fake_nvml_lib))
        pynvml.nvmlInit()
        return path

    yield start
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


def is_mig(handle) -> int:
    """nvmlDeviceIsMigDeviceHandle; pynvml 13 hands back the ctypes value itself."""
    value = pynvml.nvmlDeviceIsMigDeviceHandle(handle)
    return int(getattr(value, "value", value))


def rewrite(path: Path, text: str) -> None:
    """A new layout with a new mtime (the fake compares size, inode and mtime)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_mig_devices_are_found_under_their_parent_with_the_instance_view(nvml):
    nvml(layout(ONE_G, THREE_G))
    assert pynvml.nvmlDeviceGetCount() == 4  # MIG devices are not counted as GPUs
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    found = []
    for slot in range(7):
        try:
            found.append((slot, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)))
        except pynvml.NVMLError_NotFound:
            continue
    assert [slot for slot, _ in found] == [0, 1]  # indices count the instances there are (lines 0 and 2)
    mig = found[0][1]
    assert is_mig(mig) == 1 and is_mig(gpu) == 0
    assert pynvml.nvmlDeviceGetUUID(mig) == M1
    assert pynvml.nvmlDeviceGetName(mig) == f"{H100} MIG 1g.10gb"
    assert (pynvml.nvmlDeviceGetGpuInstanceId(mig), pynvml.nvmlDeviceGetComputeInstanceId(mig)) == (9, 0)
    assert pynvml.nvmlDeviceGetIndex(mig) == 0 and pynvml.nvmlDeviceGetIndex(found[1][1]) == 1
    memory = pynvml.nvmlDeviceGetMemoryInfo(mig)
    assert (memory.total, memory.used) == (10 * GIB, GIB)
    attrs = pynvml.nvmlDeviceGetAttributes(mig)
    assert (attrs.multiprocessorCount, attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount,
            attrs.memorySizeMB) == (16, 1, 1, 10 * 1024)
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert pynvml.nvmlDeviceGetUUID(parent) == P0
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(M2)) == M2
    assert pynvml.nvmlDeviceGetMinorNumber(gpu) == 4


def test_queries_only_a_mig_handle_answers_are_refused_on_a_gpu_handle_and_the_reverse(nvml):
    nvml(layout(ONE_G))
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    for query in (pynvml.nvmlDeviceGetGpuInstanceId, pynvml.nvmlDeviceGetComputeInstanceId,
                  pynvml.nvmlDeviceGetAttributes):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            query(gpu)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMinorNumber(mig)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(gpu)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMaxMigDeviceCount(mig)


def test_mig_disabled_enabled_without_instances_and_unsupported(nvml):
    nvml(layout())
    enabled, whole, nomig = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 2, 3))
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(enabled) == 7
    for slot in range(7):
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(enabled, slot)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(enabled, 7)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(whole) == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(whole, 0)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(nomig) == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(nomig, 0)


def test_a_layout_change_is_seen_without_init_again_and_a_vanished_handle_is_invalid(nvml):
    path = nvml(layout(ONE_G, THREE_G))
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    old = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
    assert pynvml.nvmlDeviceGetUUID(old) == M2
    rewrite(path, layout(ONE_G, mig_line(0, 1, M3, 1, 0, 2, 2, 32, 20 * GIB, 0, "2g.20gb")))
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetUUID(old)
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)) == M3


def test_a_malformed_layout_while_initialised_keeps_the_last_good_one(nvml, capfd):
    path = nvml(layout(ONE_G))
    rewrite(path, layout(ONE_G, "mig 0 1 GPU-not-a-mig 1 0 2 2 32 1 0 2g.20gb\n"))
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)) == M1
    assert "a MIG device UUID starts with MIG- (MIG layout kept)" in capfd.readouterr().err


@pytest.mark.parametrize(
    "line, problem",
    [
        (mig_line(1, 0, M1, 1, 0, 1, 1, 16, GIB, 0, "1g.10gb"), "mig needs a gpu whose MIG mode is 1"),
        (mig_line(0, 7, M1, 1, 0, 1, 1, 16, GIB, 0, "1g.10gb"), "mig_index must be 0..6"),
        (mig_line(0, 0, M1, 1, 0, 1, 2, 16, GIB, 0, "1g.10gb"), "1 <= ci_slices <= gi_slices <= 7"),
        (ONE_G + mig_line(0, 1, M2, 9, 0, 1, 1, 16, GIB, 0, "1g.10gb"), "gi/ci pair already used"),
        ("mig 0 0 " + M1 + " 1 0\n", "mig needs: gpu_index"),
    ],
)
def test_a_malformed_mig_line_fails_init_naming_it(fake_nvml_lib: Path, nvml_config, capfd, line, problem):
    nvml_config(layout(line))
    use_library(str(fake_nvml_lib))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    assert problem in capfd.readouterr().err
