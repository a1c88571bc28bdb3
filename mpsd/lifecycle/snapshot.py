"""The supervisor's state as one immutable snapshot, for metrics, probes and tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..daemon.multiuser import Waiting


@dataclass(frozen=True)
class Status:
    """A snapshot for metrics and tests."""

    state: str = "starting"  # starting | running | backoff | stopping | stopped
    pid: int | None = None
    restarts: int = 0  # daemons started after the first
    failures_in_row: int = 0
    health_latency: float | None = None  # seconds of the last health round-trip
    health_checks: int = 0  # periodic checks passed since mpsd started
    servers: tuple[int, ...] = ()
    server_states: dict[int, str] = field(default_factory=dict)
    last_error: str = ""
    config_generation: int = 1
    fault_terminations: dict[str, int] = field(default_factory=dict)  # clients ended by faultPolicy, by method
    impostors: int = 0  # control sockets found served by another process than the daemon
    defaults_restored: int = 0  # health checks that found the daemon's defaults changed and put them back
    verdict_age: float = 0.0  # seconds since the last conclusive health check, as of the last one
    multi_user: bool | None = None  # the daemon serves every UID from one server (None: not started yet)
    waiting: tuple[Waiting, ...] = ()  # clients waiting for another UID's server, at the last health check
    defaults_contested: float = 0.0  # seconds the defaults have been found changed at every health check in a row
