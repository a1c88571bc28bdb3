"""The fake libnvidia-ml.so.1 itself, driven through ctypes as C callers (the shim) use it."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.nvml_build import nvml_config_text

SUCCESS, UNINITIALIZED, INVALID_ARGUMENT, NOT_SUPPORTED = 0, 1, 2, 3
INSUFFICIENT_SIZE, DRIVER_NOT_LOADED, GPU_IS_LOST, VERSION_MISMATCH, UNKNOWN = 7, 9, 15, 25, 999
GIB = 1 << 30

TWO_GPUS = nvml_config_text(
    gpus=[
        ("GPU-00000000-0000-0000-0000-000000000000", 80 * GIB, 3 * GIB, (8, 0), False, "NVIDIA A100 80GB PCIe"),
        ("GPU-11111111-1111-1111-1111-111111111111", 16 * GIB, 0, (7, 0), False, "Tesla V100"),
    ],
    mps_clients=[(0, 4242, GIB), (0, 4243, 2 * GIB)],
    compute_procs=[(0, 17, 3 * GIB)],
    driver="550.163.01",
)


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class MemoryV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


MEMORY_V2 = ctypes.sizeof(MemoryV2) | (2 << 24)


class ProcessInfo(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


@pytest.fixture
def lib(fake_nvml_lib: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(fake_nvml_lib))


@pytest.fixture
def inited(lib: ctypes.CDLL, nvml_config) -> Iterator[ctypes.CDLL]:
    nvml_config(TWO_GPUS)
    assert lib.nvmlInit_v2() == SUCCESS
    yield lib
    assert lib.nvmlShutdown() == SUCCESS


def handle(lib: ctypes.CDLL, index: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)) == SUCCESS
    return h


def test_queries_before_init_are_uninitialized(lib: ctypes.CDLL) -> None:
    count = ctypes.c_uint(77)
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == UNINITIALIZED
    assert count.value == 77
    assert lib.nvmlShutdown() == UNINITIALIZED


def test_missing_config_is_driver_not_loaded(lib: ctypes.CDLL, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("FAKE_NVML_CONFIG", raising=False)
    assert lib.nvmlInit_v2() == DRIVER_NOT_LOADED
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(tmp_path / "absent.conf"))
    assert lib.nvmlInitWithFlags(0) == DRIVER_NOT_LOADED
    assert lib.nvmlShutdown() == UNINITIALIZED


@pytest.mark.parametrize(
    "line, problem",
    [
        ("gpu 1 GPU-x 10 0 8 0 0 name", "gpu index must be the next integer"),
        ("gpu 0 GPU-x 10 11 8 0 0 name", "used <= total"),
        ("gpu 0 GPU-x 10 0 8 0 2 name", "mig must be 0 or 1"),
        ("gpu 0 GPU-x 10 0 8 0 0", "gpu needs"),
        ("gpu 0 GPU-x -10 0 8 0 0 name", "byte counts"),
        ("proc 3 1 1", "gpu_index must name a gpu"),
        ("fail nvmlInit_v2 zero", "nvml_error_code"),
        ("frobnicate 1", "unknown directive"),
    ],
)
def test_malformed_config_fails_init_with_a_line(lib, nvml_config, capfd, line: str, problem: str) -> None:
    path = nvml_config(line + "\n")
    assert lib.nvmlInit_v2() == UNKNOWN
    err = capfd.readouterr().err
    assert f"fake_nvml: {path}:1: " in err and problem in err
    assert lib.nvmlShutdown() == UNINITIALIZED


def test_devices_strings_and_memory(inited: ctypes.CDLL) -> None:
    lib = inited
    count = ctypes.c_uint()
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == SUCCESS and count.value == 2
    h0 = handle(lib, 0)
    buf = ctypes.create_string_buffer(96)
    assert lib.nvmlDeviceGetName(h0, buf, 96) == SUCCESS
    assert buf.value == b"NVIDIA A100 80GB PCIe"
    assert lib.nvmlDeviceGetUUID(h0, buf, 96) == SUCCESS
    assert buf.value == b"GPU-00000000-0000-0000-0000-000000000000"
    assert lib.nvmlDeviceGetUUID(h0, buf, 10) == INSUFFICIENT_SIZE
    mem = Memory()
    assert lib.nvmlDeviceGetMemoryInfo(h0, ctypes.byref(mem)) == SUCCESS
    assert (mem.total, mem.used, mem.free) == (80 * GIB, 3 * GIB, 77 * GIB)
    index = ctypes.c_uint(9)
    assert lib.nvmlDeviceGetIndex(handle(lib, 1), ctypes.byref(index)) == SUCCESS and index.value == 1
    by_uuid = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByUUID(b"GPU-11111111-1111-1111-1111-111111111111", ctypes.byref(by_uuid)) == SUCCESS
    assert by_uuid.value == handle(lib, 1).value
    assert lib.nvmlDeviceGetHandleByUUID(b"GPU-nope", ctypes.byref(by_uuid)) == 6


def test_memory_v2_checks_the_version_field(inited: ctypes.CDLL) -> None:
    mem = MemoryV2(version=MEMORY_V2)
    assert inited.nvmlDeviceGetMemoryInfo_v2(handle(inited, 1), ctypes.byref(mem)) == SUCCESS
    assert (mem.total, mem.reserved, mem.used, mem.free) == (16 * GIB, 0, 0, 16 * GIB)
    stale = MemoryV2(version=1)
    assert inited.nvmlDeviceGetMemoryInfo_v2(handle(inited, 1), ctypes.byref(stale)) == VERSION_MISMATCH


def test_bad_handles_and_indices_are_invalid_arguments(inited: ctypes.CDLL) -> None:
    h = ctypes.c_void_p()
    assert inited.nvmlDeviceGetHandleByIndex_v2(2, ctypes.byref(h)) == INVALID_ARGUMENT
    bogus = ctypes.c_void_p(ctypes.addressof(Memory()))
    assert inited.nvmlDeviceGetMemoryInfo(bogus, ctypes.byref(Memory())) == INVALID_ARGUMENT


def test_process_queries_follow_the_sizing_protocol(inited: ctypes.CDLL) -> None:
    h0 = handle(inited, 0)
    count = ctypes.c_uint(0)
    assert inited.nvmlDeviceGetMPSComputeRunningProcesses_v3(h0, ctypes.byref(count), None) == INSUFFICIENT_SIZE
    assert count.value == 2
    infos = (ProcessInfo * 5)()
    count.value = 5
    assert inited.nvmlDeviceGetMPSComputeRunningProcesses_v3(h0, ctypes.byref(count), infos) == SUCCESS
    assert [(infos[i].pid, infos[i].usedGpuMemory) for i in range(count.value)] == [(4242, GIB), (4243, 2 * GIB)]
    assert infos[0].gpuInstanceId == 0xFFFFFFFF
    count.value = 5
    assert inited.nvmlDeviceGetComputeRunningProcesses_v3(h0, ctypes.byref(count), infos) == SUCCESS
    assert (count.value, infos[0].pid) == (1, 17)
    count.value = 0
    assert inited.nvmlDeviceGetMPSComputeRunningProcesses_v2(handle(inited, 1), ctypes.byref(count), None) == SUCCESS
    assert count.value == 0


def test_fail_directive_injects_an_error(lib: ctypes.CDLL, nvml_config) -> None:
    nvml_config(TWO_GPUS + "fail nvmlDeviceGetMemoryInfo 15\nnomig 1\n")
    assert lib.nvmlInit_v2() == SUCCESS
    try:
        assert lib.nvmlDeviceGetMemoryInfo(handle(lib, 0), ctypes.byref(Memory())) == GPU_IS_LOST
        cur, pend = ctypes.c_uint(), ctypes.c_uint()
        assert lib.nvmlDeviceGetMigMode(handle(lib, 1), ctypes.byref(cur), ctypes.byref(pend)) == NOT_SUPPORTED
        assert lib.nvmlDeviceGetMigMode(handle(lib, 0), ctypes.byref(cur), ctypes.byref(pend)) == SUCCESS
    finally:
        assert lib.nvmlShutdown() == SUCCESS


def test_config_is_reread_when_the_refcount_returns_to_zero(lib: ctypes.CDLL, nvml_config) -> None:
    nvml_config(TWO_GPUS)
    count = ctypes.c_uint()
    assert lib.nvmlInit_v2() == SUCCESS and lib.nvmlInit_v2() == SUCCESS
    nvml_config(nvml_config_text(gpus=[("GPU-z", GIB, 0, (9, 0), True, "H100")]))
    assert lib.nvmlShutdown() == SUCCESS  # still referenced: old state kept
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == SUCCESS and count.value == 2
    assert lib.nvmlShutdown() == SUCCESS
    assert lib.nvmlInit_v2() == SUCCESS
    assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == SUCCESS and count.value == 1
    assert lib.nvmlShutdown() == SUCCESS


def test_driver_version(inited: ctypes.CDLL) -> None:
    buf = ctypes.create_string_buffer(80)
    assert inited.nvmlSystemGetDriverVersion(buf, 80) == SUCCESS and buf.value == b"550.163.01"
    assert inited.nvmlSystemGetDriverVersion(buf, 4) == INSUFFICIENT_SIZE
