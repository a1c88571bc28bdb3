"""Device taints from the supervisor's health board (mpsd/lifecycle/health.py). Pure apart from the clock.

A GPU the board calls unhealthy for longer than ``dra.taintAfter`` gets one taint on each of its
devices (spec.devices[].taints of resource.k8s.io/v1, GA in 1.37):

- key ``<driverName>/unhealthy`` (a label name in the driver's own domain), value the reason
  (a label value): ``MPSDaemonDown`` (no running, answering control daemon: down, hung or being
  restarted), ``MPSNotConfigured`` (the daemon runs but its defaults are not applied yet),
  ``MPSServerFault`` (the GPU's MPS server is in FAULT);
- effect ``dra.taintEffect``: ``NoSchedule`` (the default: no new claim is allocated the
  device, pods running keep it), ``NoExecute`` (the operator opts in: pods using the device are
  evicted unless they tolerate it; a client fault of one pod then evicts its co-tenants, which
  MPS's FAULT ends anyway), or ``none`` (no taints);
- ``timeAdded``: when mpsd decided on the taint (the publisher keeps the time the server holds).

Removed as soon as the GPU is healthy again. A stale verdict (the board's ``unverified``: a held
control session blinds the health check) taints nothing: any pod can hold the session, and a
taint, NoExecute above all, must not be a pod's to cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

from ..lifecycle.health import HealthState

EFFECTS = ("NoSchedule", "NoExecute", "none")
DEFAULT_TAINT_AFTER = 30.0

Obj = dict[str, Any]


def reason(state: HealthState, index: int) -> str:
    """Why GPU ``index`` is unhealthy on the board, "" when it is healthy."""
    if not state.daemon_up:
        return "MPSDaemonDown"
    if not state.configured:
        return "MPSNotConfigured"
    if index in state.faulted_gpus:
        return "MPSServerFault"
    return ""


def taint_key(driver: str) -> str:
    return f"{driver}/unhealthy"


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(int(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Tainter:
    """Remembers since when each GPU is unhealthy (for how long, by ``clock``) and turns the board
    into taints: ``taints(state, gpus)`` -> {GPU index: [taint]} for the GPUs due one;
    ``next_due(now)`` is when the next one falls due (None: none pending)."""

    def __init__(self, driver: str, effect: str = "NoSchedule", after: float = DEFAULT_TAINT_AFTER,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if effect not in EFFECTS:
            raise ValueError(f"bad dra.taintEffect {effect!r}: expected one of {', '.join(EFFECTS)}")
        self.driver, self.effect, self.after = driver, effect, after
        self._clock, self._wall = clock, wall
        self._since: dict[int, tuple[str, float, float]] = {}  # index -> (reason, since (clock), since (wall))

    def taints(self, state: HealthState, gpus: Iterable[int]) -> dict[int, list[Obj]]:
        now, out = self._clock(), {}
        for index in gpus:
            why = reason(state, index)
            if not why:
                self._since.pop(index, None)
                continue
            known = self._since.get(index)
            if known is None or known[0] != why:  # a new reason is a new taint (its own time)
                known = self._since[index] = (why, now, self._wall())
            if self.effect != "none" and now - known[1] >= self.after:
                out[index] = [{"key": taint_key(self.driver), "value": why, "effect": self.effect,
                               "timeAdded": rfc3339(known[2] + self.after)}]
        return out

    def next_due(self) -> float | None:
        """Clock time at which the next pending taint falls due; None when none is pending."""
        if self.effect == "none":
            return None
        now = self._clock()
        pending = [since + self.after for _, since, _ in self._since.values() if since + self.after > now]
        return min(pending) if pending else None

    def unhealthy_since(self) -> dict[int, tuple[str, float]]:
        """{GPU index: (reason, clock time since)} of the GPUs unhealthy now (for metrics and status)."""
        return {i: (why, since) for i, (why, since, _) in self._since.items()}
