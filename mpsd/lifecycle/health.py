"""The node's health as the supervisor sees it, shared with the device plugin and probes.

The supervisor writes; the device plugin's ListAndWatch and the HTTP probes read. Every
change bumps ``generation`` and wakes waiters, so readers never poll faster than changes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HealthState:
    daemon_up: bool = False
    configured: bool = False  # defaults applied and read back since the last (re)start
    faulted_gpus: frozenset[int] = field(default_factory=frozenset)  # GPU indices with a server in FAULT
    last_error: str = ""
    unverified: str = ""  # why there has been no health verdict for verdictTimeout ("" when there was one)
    mig_healthy: frozenset[str] = field(default_factory=frozenset)  # MIG instances whose own daemon serves
    mig_layout: int = 0  # bumped when MIG instances appear or vanish (mpsd/mig/fleet.py)
    generation: int = 0

    def gpu_healthy(self, index: int) -> bool:
        return self.daemon_up and self.configured and index not in self.faulted_gpus

    def device_healthy(self, device) -> bool:
        """A whole GPU by the node daemon; a MIG instance (``device.mig``) by its own daemon."""
        if getattr(device, "mig", False):
            return device.uuid in self.mig_healthy
        return self.gpu_healthy(device.index)


class HealthBoard:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._state = HealthState()

    def current(self) -> HealthState:
        with self._cond:
            return self._state

    def update(self, **changes) -> HealthState:
        """Replace the given fields; wakes waiters only if something changed."""
        with self._cond:
            old = self._state
            names = ("daemon_up", "configured", "faulted_gpus", "last_error", "unverified", "mig_healthy", "mig_layout")
            fields = {k: getattr(old, k) for k in names}
            fields.update(changes)
            fields["faulted_gpus"] = frozenset(fields["faulted_gpus"])
            fields["mig_healthy"] = frozenset(fields["mig_healthy"])
            if all(fields[k] == getattr(old, k) for k in fields):
                return old
            self._state = HealthState(**fields, generation=old.generation + 1)
            self._cond.notify_all()
            return self._state

    def wait_change(self, generation: int, timeout: float | None = None) -> HealthState:
        """Block until the generation differs from ``generation`` or ``timeout`` passes."""
        with self._cond:
            self._cond.wait_for(lambda: self._state.generation != generation, timeout)
            return self._state
