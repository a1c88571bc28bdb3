"""Keeps the node's ResourceSlices current while mpsd runs: SlicePublisher (mpsd/dra/publisher.py)
driven by what changes them.

- a watch of the node's slices (KubeAPI.watch_resource_slices): a slice deleted or changed by
  someone else (the kubelet wipes a driver's slices, an operator deletes one) is written again
  within a round, not at the next resync; events of mpsd's own writes are skipped;
- the health board (mpsd/lifecycle/health.py): a GPU unhealthy for ``dra.taintAfter`` is tainted, and the
  taint removed when it recovers (mpsd/dra/taints.py);
- the GPUs, listed again every ``interval`` through ``gpu_lister`` (NVML): a GPU that appears,
  goes or changes is published (an empty listing, NVML failing for a moment, keeps the last one).

Failures back off exponentially with jitter (``backoff``: 1 s doubling to 60 s, the upper half
of each step random), the publish and the watch each on its own count, so an API server that is
down sees at most a request every 30 s or so from each node once the back-off has grown, and
nodes that lost it together do not come back in step. A failure is logged once until it changes.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import MpsdError
from ..lifecycle.health import HealthBoard
from .publisher import SlicePublisher
from .slices import GpuLike
from .taints import Tainter

log = logging.getLogger(__name__)

INTERVAL = 5.0
BACKOFF_INITIAL = 1.0
BACKOFF_MAX = 60.0

Watch = Callable[[], Iterator[tuple[str, dict[str, Any]]]]


def backoff(failures: int, initial: float = BACKOFF_INITIAL, cap: float = BACKOFF_MAX,
            rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait after ``failures`` failures in a row (>= 1): ``initial`` doubled per
    failure up to ``cap``, of which the upper half is random ("equal jitter")."""
    step = min(cap, initial * 2 ** min(max(failures, 1) - 1, 32))
    return step / 2 + rand() * step / 2


class SliceKeeper:
    def __init__(self, publisher: SlicePublisher, gpus: Sequence[GpuLike], *, driver_version: str = "",
                 board: HealthBoard | None = None, tainter: Tainter | None = None,
                 gpu_lister: Callable[[], Sequence[GpuLike]] | None = None,
                 on_gpus: Callable[[list[GpuLike]], None] | None = None, watch: Watch | None = None,
                 interval: float = INTERVAL, delay: Callable[[int], float] = backoff,
                 clock: Callable[[], float] = time.monotonic, metrics: Any = None) -> None:
        self.publisher, self.gpus, self.driver_version = publisher, list(gpus), driver_version
        self.board, self.tainter, self.gpu_lister, self.on_gpus = board, tainter, gpu_lister, on_gpus
        self.watch, self.interval, self.delay, self._clock, self.metrics = watch, interval, delay, clock, metrics
        self.wake = threading.Event()
        self.failures = 0  # publishes failed in a row
        self.tainted: dict[int, list[dict[str, Any]]] = {}  # as last published

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop`` is set."""
        def wake_at_stop() -> None:
            stop.wait()
            self.wake.set()

        threads: list[tuple[str, Callable[[], None]]] = [("mpsd-dra-stop", wake_at_stop)]
        watch, board = self.watch, self.board
        if board is not None:
            threads.append(("mpsd-dra-health", lambda: self._board_loop(stop, board)))
        for name, target in threads:
            threading.Thread(target=target, name=name, daemon=True).start()
        last = ""
        while not stop.is_set():
            self.wake.clear()
            self._list_gpus()
            failure = self._try_publish()
            if watch is not None:  # after the first publish: the watch's first ADDED events are then known slices
                threading.Thread(target=self._watch_loop, args=(stop, watch), name="mpsd-dra-slice-watch",
                                 daemon=True).start()
                watch = None
            if failure:
                self.failures += 1
                wait = self.delay(self.failures)
                if failure != last:
                    log.error("resourceslices not published (retrying with back-off, next in %.1fs): %s", wait, failure)
                last = failure
                if stop.wait(wait):  # a failure waits its back-off whatever wakes the loop
                    return
                continue
            self.failures, last = 0, ""
            self.wake.wait(self._next_wait())

    def _try_publish(self) -> str:
        """publish_once; what failed, in one line, or "" when it did not."""
        try:
            self.publish_once()
        except Exception as exc:  # noqa: BLE001 (an answer of a shape nobody expected too: retried, not fatal)
            text = str(exc) if isinstance(exc, (MpsdError, ValueError)) else f"{type(exc).__name__}: {exc}"
            return text or type(exc).__name__
        return ""

    def publish_once(self) -> bool:
        taints = self._taints()
        wrote = self.publisher.publish(self.gpus, self.driver_version, taints)
        if taints != self.tainted:
            self._log_taints(taints)
        self.tainted = taints
        return wrote

    def _taints(self) -> dict[int, list[dict[str, Any]]]:
        if self.board is None or self.tainter is None:
            return {}
        return self.tainter.taints(self.board.current(), [g.index for g in self.gpus])

    def _log_taints(self, taints: dict[int, list[dict[str, Any]]]) -> None:
        for index in sorted(set(taints) | set(self.tainted)):
            now = taints.get(index)
            if now:
                log.warning("GPU %d tainted %s=%s:%s in the node's ResourceSlices", index, now[0]["key"],
                            now[0]["value"], now[0]["effect"])
            else:
                log.info("GPU %d healthy again: taint removed from the node's ResourceSlices", index)
        if self.metrics is not None:
            self.metrics.set_device_taints({i: (t[0]["value"], t[0]["effect"]) for i, t in taints.items()})

    def _next_wait(self) -> float:
        due = self.tainter.next_due() if self.tainter is not None else None
        wait = self.interval if due is None else min(self.interval, max(0.0, due - self._clock()))
        return wait

    def _list_gpus(self) -> None:
        if self.gpu_lister is None:
            return
        try:
            listed = list(self.gpu_lister())
        except MpsdError as exc:
            log.warning("GPUs not listed, publishing the last list: %s", exc)
            return
        if listed and listed != self.gpus:
            log.info("GPUs changed, publishing them gpus=%s", ",".join(str(g.index) for g in listed))
            self.gpus = listed
            if self.on_gpus is not None:
                self.on_gpus(listed)

    def _board_loop(self, stop: threading.Event, board: HealthBoard) -> None:
        generation = board.current().generation
        while not stop.is_set():
            state = board.wait_change(generation, timeout=1.0)
            if state.generation != generation:
                generation = state.generation
                self.wake.set()

    def _watch_loop(self, stop: threading.Event, watch: Callable[[], Iterator[tuple[str, dict[str, Any]]]]) -> None:
        failures, last = 0, ""
        while not stop.is_set():
            try:
                for kind, obj in watch():
                    failures, last = 0, ""
                    if stop.is_set():
                        return
                    if self._foreign(kind, obj):
                        log.info("resourceslice %s %s by someone else: checking the node's pool",
                                 (obj.get("metadata") or {}).get("name"), kind.lower())
                        self.publisher.invalidate()
                        self.wake.set()
                stop.wait(self.delay(1))  # the watch ended without an error: open the next one, not in a spin
            except Exception as exc:  # noqa: BLE001 (the watch is an optimization: it backs off, never dies)
                if stop.is_set():
                    return
                failures += 1
                wait = self.delay(failures)
                if str(exc) != last:
                    log.warning("watch of the node's resourceslices failed (retrying with back-off, next in %.1fs): %s",
                                wait, exc)
                last = str(exc)
                self.publisher.invalidate()  # what happened meanwhile is seen at the next round
                stop.wait(wait)

    def _foreign(self, kind: str, obj: dict[str, Any]) -> bool:
        """An event that is not the echo of one of mpsd's own writes."""
        return kind in ("DELETED", "ERROR") or not self.publisher.is_own(obj)
