"""NVML is read off the supervisor loop: a blocking NVML call never holds up a status update."""

from __future__ import annotations

import threading
import time

import pytest

from mpsd.errors import InventoryError
from mpsd.lifecycle.health import HealthBoard
from mpsd.inventory.nvml import Client, Gpu
from mpsd.registry import Metrics
from mpsd.node import InventoryPump, _observer, managed_gpus
from mpsd.lifecycle.supervisor import Status

GPU = Gpu(0, "GPU-a", "Fake", 40 << 30, 1 << 30, (9, 0), False)


class SlowNvml:
    """An inventory whose calls wait for ``release`` (a GPU in trouble), or fail."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.fail = False
        self.calls = 0

    def gpus(self) -> list[Gpu]:
        self.calls += 1
        self.release.wait(30)
        if self.fail:
            raise InventoryError("NVML nvmlDeviceGetCount failed: GPU is lost")
        return [GPU]

    def mps_clients(self) -> list[Client]:
        return [Client(0, 4242, 2 << 30)]


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_status_updates_do_not_wait_for_a_blocked_nvml():
    nvml, metrics, board = SlowNvml(), Metrics(), HealthBoard()
    pump = InventoryPump(nvml, metrics, board)
    observe = _observer(metrics, pump)
    try:
        board.update(daemon_up=True, configured=True)
        began = time.monotonic()
        for restarts in range(5):
            observe(Status(state="running", restarts=restarts))
        assert time.monotonic() - began < 5.0  # NVML is still blocked (until released below)
        assert b"mpsd_daemon_restarts_total 4.0" in metrics.scrape()
        assert b"mpsd_gpu_memory_total_bytes{" not in metrics.scrape()
        nvml.release.set()
        wait_until(lambda: b'mpsd_device_healthy{gpu="0"} 1.0' in metrics.scrape(), "GPU series")
        assert b'mpsd_client_memory_bytes{gpu="0",pid="4242"}' in metrics.scrape()
        assert nvml.calls <= 3  # requests made while blocked coalesce
        board.update(daemon_up=False, configured=False)
        observe(Status(state="backoff"))
        wait_until(lambda: b'mpsd_device_healthy{gpu="0"} 0.0' in metrics.scrape(), "unhealthy while down")
    finally:
        nvml.release.set()
        pump.close()


def test_gpu_indices_survive_a_failing_listing():
    nvml = SlowNvml()
    nvml.release.set()
    pump = InventoryPump(nvml, None, HealthBoard())
    try:
        pump.refresh()
        assert pump.gpu_indices() == [0]
        nvml.fail = True
        pump.refresh()
        assert pump.gpu_indices() == [0]
    finally:
        pump.close()


def test_without_nvml_there_are_no_gpus():
    pump = InventoryPump(None, Metrics(), HealthBoard())
    pump.refresh()
    assert pump.gpu_indices() == []
    pump.close()


def gpu(index: int, uuid: str) -> Gpu:
    return Gpu(index, uuid, "Fake", 40 << 30, 0, (9, 0), False)


FOUR = [gpu(0, "GPU-a"), gpu(1, "GPU-b"), gpu(2, "GPU-c"), gpu(3, "GPU-d")]


@pytest.mark.parametrize(
    "visible,indices",
    [
        (None, [0, 1, 2, 3]),
        ("", [0, 1, 2, 3]),
        ("1", [1]),
        ("3,1", [1, 3]),
        ("GPU-c,0", [0, 2]),
        ("7", []),  # a GPU NVML does not list is managed by nobody
        ("MIG-GPU-a/1/0", [0, 1, 2, 3]),  # MIG devices cannot be matched to NVML's GPU list
    ],
)
def test_managed_gpus_follow_visible_devices(visible, indices):
    assert [g.index for g in managed_gpus(FOUR, visible)] == indices


class FourGpus:
    def gpus(self) -> list[Gpu]:
        return FOUR

    def mps_clients(self) -> list[Client]:
        return []


def test_only_managed_gpus_are_faulted_and_offered_but_all_are_measured():
    metrics, board = Metrics(), HealthBoard()
    pump = InventoryPump(FourGpus(), metrics, board, visible_devices="1,GPU-d")
    try:
        board.update(daemon_up=True, configured=True)
        pump.refresh()
        assert pump.gpu_indices() == [1, 3]
        text = metrics.scrape().decode()
        assert 'mpsd_device_healthy{gpu="1"} 1.0' in text and 'mpsd_device_healthy{gpu="0"}' not in text
        assert 'mpsd_gpu_memory_total_bytes{gpu="0",uuid="GPU-a"}' in text
    finally:
        pump.close()
