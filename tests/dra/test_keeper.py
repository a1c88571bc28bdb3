"""SliceKeeper (mpsd/dra/keeper.py) against the stand-in API server and its watches: a slice
deleted behind mpsd's back comes back within seconds, unhealthy GPUs are tainted after
dra.taintAfter and untainted on recovery, and failures back off with jitter."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from mpsd.dra.keeper import BACKOFF_MAX, SliceKeeper, backoff
from mpsd.dra.kubeapi import KubeAPI
from mpsd.dra.publisher import SlicePublisher
from mpsd.dra.taints import Tainter
from mpsd.lifecycle.health import HealthBoard
from mpsd.inventory.nvml import Gpu
from mpsd.registry import Metrics
from tests.dra.apiserver import StandInAPIServer

GIB = 1 << 30
DRIVER, NODE = "gpu.mpsd.io", "node-a"
GPUS = [Gpu(i, f"GPU-{i}", "NVIDIA L4", 24 * GIB, 0, (8, 9), False) for i in range(2)]


@pytest.fixture
def api(kubeconfig: Path) -> Iterator[KubeAPI]:
    with KubeAPI.from_environment(timeout=5) as client:
        yield client


@pytest.fixture
def keep(api: KubeAPI, kubeconfig: Path) -> Iterator[Callable[..., SliceKeeper]]:
    """Start a keeper in a thread (its own client for the watch, as run_dra has); stopped at the end."""
    stop = threading.Event()
    threads: list[threading.Thread] = []
    watchers: list[KubeAPI] = []

    def start(watch: bool = True, **kw: Any) -> SliceKeeper:
        kw.setdefault("interval", 30.0)  # only a watch or the board wakes it within a test
        publisher = SlicePublisher(api, DRIVER, NODE, "capacity", 4, resync_interval=300, metrics=kw.get("metrics"))
        if watch:
            watchers.append(KubeAPI.from_environment(timeout=5))
            kw["watch"] = lambda: watchers[-1].watch_resource_slices(DRIVER, NODE, server_timeout=5)
        keeper = SliceKeeper(publisher, GPUS, **kw)
        thread = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
        thread.start()
        threads.append(thread)
        return keeper

    yield start
    stop.set()
    for w in watchers:
        w.close()
    for t in threads:
        t.join(20)
        assert not t.is_alive()


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def devices(server: StandInAPIServer) -> list[str]:
    return sorted(d["name"] for s in server.pool_slices(DRIVER, NODE) for d in s["spec"]["devices"])


def test_a_slice_deleted_behind_mpsds_back_comes_back_within_seconds(apiserver: StandInAPIServer, keep) -> None:
    """Before the watch, a deleted slice came back at the next resync (60 s)."""
    keep()
    assert wait_for(lambda: devices(apiserver) == ["gpu-0", "gpu-1"])
    assert wait_for(lambda: any(m == "WATCH" for m, _ in apiserver.requests))
    writes = len(apiserver.writes())
    time.sleep(1.0)
    assert len(apiserver.writes()) == writes  # its own writes' echoes start nothing
    victim = apiserver.pool_slices(DRIVER, NODE)[0]["metadata"]["name"]
    with apiserver.lock:
        gone = apiserver.slices.pop(victim)
        apiserver._version += 1
        gone["metadata"]["resourceVersion"] = str(apiserver._version)
        apiserver._event("DELETED", gone)  # as the kubelet's wipe or an operator's delete shows it
    t0 = time.monotonic()

    def whole() -> bool:  # both GPUs back, in one complete pool of the next generation
        generations = {s["spec"]["pool"]["generation"] for s in apiserver.pool_slices(DRIVER, NODE)}
        return devices(apiserver) == ["gpu-0", "gpu-1"] and generations == {2}

    assert wait_for(whole, timeout=10)
    assert time.monotonic() - t0 < 10


def test_an_unhealthy_gpu_is_tainted_after_taint_after_and_untainted_on_recovery(apiserver: StandInAPIServer,
                                                                                 keep) -> None:
    board, metrics = HealthBoard(), Metrics()
    board.update(daemon_up=True, configured=True)
    keep(board=board, tainter=Tainter(DRIVER, "NoSchedule", after=1.0), metrics=metrics)
    assert wait_for(lambda: devices(apiserver) == ["gpu-0", "gpu-1"])

    def taints() -> dict[str, list]:
        return {d["name"]: d.get("taints", []) for s in apiserver.pool_slices(DRIVER, NODE) for d in s["spec"]["devices"]}

    t0 = time.monotonic()
    board.update(faulted_gpus={1})
    assert wait_for(lambda: taints().get("gpu-1"))
    assert time.monotonic() - t0 >= 1.0  # not before dra.taintAfter
    (taint,) = taints()["gpu-1"]
    assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.mpsd.io/unhealthy", "MPSServerFault", "NoSchedule")
    assert taints()["gpu-0"] == []

    def gauge() -> dict:
        return {tuple(sorted(s.labels.items())): s.value for f in metrics.registry.collect() for s in f.samples
                if s.name == "mpsd_dra_device_tainted"}

    assert wait_for(lambda: gauge() == {(("effect", "NoSchedule"), ("gpu", "1"), ("reason", "MPSServerFault")): 1.0})
    board.update(faulted_gpus=set())
    assert wait_for(lambda: taints()["gpu-1"] == [])
    assert wait_for(lambda: gauge() == {})


def test_a_blip_shorter_than_taint_after_taints_nothing(apiserver: StandInAPIServer, keep) -> None:
    board = HealthBoard()
    board.update(daemon_up=True, configured=True)
    keep(board=board, tainter=Tainter(DRIVER, "NoExecute", after=5.0))
    assert wait_for(lambda: devices(apiserver) == ["gpu-0", "gpu-1"])
    writes = len(apiserver.writes())
    board.update(daemon_up=False, configured=False)
    time.sleep(0.5)
    board.update(daemon_up=True, configured=True)
    time.sleep(6.0)  # past the first blip's taintAfter
    assert len(apiserver.writes()) == writes


@pytest.mark.parametrize("failures, low, high", [(1, 0.5, 1.0), (2, 1.0, 2.0), (3, 2.0, 4.0), (6, 16.0, 32.0),
                                                  (7, 30.0, 60.0), (50, 30.0, 60.0)])
def test_backoff_doubles_to_a_minute_with_its_upper_half_random(failures: int, low: float, high: float) -> None:
    assert backoff(failures, rand=lambda: 0.0) == low
    assert backoff(failures, rand=lambda: 1.0) == high
    assert high <= BACKOFF_MAX


def test_an_api_server_that_is_down_sees_requests_further_and_further_apart(apiserver: StandInAPIServer,
                                                                            keep) -> None:
    """Before: a failed publish was retried every 5 s, for ever, from every node at the same moment."""
    delays: list[int] = []

    def delay(failures: int) -> float:
        delays.append(failures)
        return backoff(failures, initial=0.05, cap=0.4)

    apiserver.refuse = True  # connections accepted and closed without an answer: every try counts a hit
    keep(delay=delay, watch=False, interval=0.05)
    time.sleep(3.0)
    hits = apiserver.hits
    assert delays[:4] == [1, 2, 3, 4]  # the publish's back-off grows with each failure in a row
    assert 3 <= hits <= 3.0 / 0.2 + 4  # once grown: at least 0.2 s between tries
    apiserver.refuse = False
    assert wait_for(lambda: devices(apiserver) == ["gpu-0", "gpu-1"], timeout=10)


def test_an_unexpected_error_is_retried_not_fatal(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    publisher = SlicePublisher(api, DRIVER, NODE, "capacity", 4)
    calls = []

    class Flaky:
        own_versions: set[str] = set()

        def publish(self, *args: Any) -> bool:
            calls.append(1)
            if len(calls) <= 2:
                raise KeyError("pool")  # e.g. a slice list of an unexpected shape
            return publisher.publish(*args)

    stop = threading.Event()
    keeper = SliceKeeper(Flaky(), GPUS, interval=0.05, delay=lambda n: 0.05)  # type: ignore[arg-type]
    thread = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: devices(apiserver) == ["gpu-0", "gpu-1"])
        assert len(calls) >= 3
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


class EchoingAPI:
    """A slice API whose writes answer only after the watch has handed the keeper their echo
    (bounded): as the real API server did (the watch's ADDED came before the POST's 201 was
    read, mpsd's log on the node of scripts/cluster.sh)."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.cond = threading.Condition()
        self.handled = 0  # events the keeper's watch loop is done with
        self.watching = False
        self.version = 0

    def list_resource_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        with self.cond:
            return [dict(s) for s in self.slices.values()]

    def _store(self, kind: str, obj: dict[str, Any], name: str) -> dict[str, Any]:
        with self.cond:
            self.version += 1
            stored = {**obj, "metadata": {**obj["metadata"], "name": name, "resourceVersion": str(self.version)}}
            self.slices[name] = stored
            self.events.append((kind, stored))
            self.cond.notify_all()
            # the old keeper decided on the echo at once; the fixed one waits for this write to end
            self.cond.wait_for(lambda: not self.watching or self.handled >= len(self.events), timeout=1.5)
        return stored

    def create_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._store("ADDED", obj, f"slice-{self.version + 1}")

    def update_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._store("MODIFIED", obj, obj["metadata"]["name"])

    def delete_resource_slice(self, name: str) -> None:
        with self.cond:
            self.events.append(("DELETED", self.slices.pop(name)))
            self.cond.notify_all()

    def watch(self, stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        with self.cond:
            self.watching, seen = True, 0
            batch = [("ADDED", s) for s in self.slices.values()]  # a watch without resourceVersion
        for event in batch:
            yield event
        seen = len(self.events)
        while not stop.is_set():
            with self.cond:
                self.cond.wait_for(lambda: len(self.events) > seen or stop.is_set(), timeout=0.1)  # noqa: B023
                batch = self.events[seen:]
            for event in batch:
                seen += 1
                yield event
                with self.cond:  # the keeper asked for the next event: it is done with this one
                    self.handled = seen
                    self.cond.notify_all()


def test_its_own_new_slice_is_not_taken_for_someone_elses(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the echo of mpsd's own create came before the create's answer was read, and the
    keeper logged "resourceslice ... added by someone else" and checked the pool again; so did a
    watch opened at the start for the slices there. Now only someone else's deletion is news."""
    api = EchoingAPI()
    publisher = SlicePublisher(api, DRIVER, NODE, "capacity", 4)
    stop = threading.Event()
    keeper = SliceKeeper(publisher, GPUS, interval=30.0, watch=lambda: api.watch(stop))
    thread = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
    with caplog.at_level("INFO", logger="mpsd.dra.keeper"):
        thread.start()
        try:
            assert wait_for(lambda: len(api.slices) == len(GPUS) and api.watching)  # a slice per GPU
            assert wait_for(lambda: publisher.own_versions)
            api.delete_resource_slice(sorted(api.slices)[0])  # someone else: written again, an echo each
            assert wait_for(lambda: len(api.slices) == len(GPUS) and api.handled == len(api.events))
        finally:
            stop.set()
            thread.join(20)
    assert not thread.is_alive()
    foreign = [r.getMessage() for r in caplog.records if "by someone else" in r.getMessage()]
    assert len(foreign) == 1 and "deleted" in foreign[0], caplog.text
