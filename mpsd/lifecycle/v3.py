"""What the supervisor does differently for an MPS v3 daemon (mpsd/lifecycle/supervisor.py holds one
:class:`V3Supervision` and calls it where it would speak v2's interactive shell).

- start: mpsd writes the TOML (mpsd/sharing/toml3.py) into stateDir and starts
  ``nvidia-cuda-mps-control -f -p 3 -a <file>`` (``-m`` when mpsd runs as root: one server
  per GPU serves every UID); CUDA_MPS_PROTOCOL_VERSION=3 as well (the variable wins over -p);
- listening: ``server list`` answers;
- configured: every server of the file is listed, and the live slices' namespaces read back as
  wanted (a slice granted while the daemon started is created now);
- each health round: the pipe dir's sockets, ``control`` and every live namespace's, served by
  the daemon mpsd started (mpsd/daemon/peer.py), else the daemon is restarted to take them back;
  ``server list``; the namespaces read back and put back (``V3Backend.reconcile``); a server in
  FAULT marks its GPU unhealthy (v3 names the GPU of each server: only that GPU's slices go
  Unhealthy). ``faultPolicy: terminate`` falls back to report: NVIDIA's v3 pages name no verb
  that ends a client;
- reload: the defaults (activeThreadPercentage, pinnedMemLimit, clientPriority) go to every
  server's default namespace with ``namespace set``;
- stop: ``-q``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from ..daemon import dirs, peer
from ..daemon.control3 import Control3
from ..errors import ControlBusy, ControlError, ControlImpostor, ControlTimeout
from ..alloc.state import write_atomic
from ..sharing.toml3 import default_limits
from ..sharing.v3 import V3Backend

from ..config import Config
from ..daemon.process import DaemonProcess
from .health import HealthBoard
from .independent import AdoptedDaemon
from .snapshot import Status

log = logging.getLogger(__name__)


class Supervised(Protocol):
    """What a v3 health round uses of mpsd.lifecycle.supervisor.Supervisor: its verdicts (retire,
    inconclusive, no answer), shared with v2's round, and its published state."""

    board: HealthBoard
    _silent_checks: tuple[int, int]
    _verdict_at: float
    _next_at: float | None

    def status(self) -> Status: ...
    def _publish(self, **changes: Any) -> None: ...
    def _retire(self, daemon: DaemonProcess | AdoptedDaemon, message: str) -> None: ...
    def _no_answer(self, daemon: DaemonProcess | AdoptedDaemon, exc: ControlTimeout) -> None: ...
    def _inconclusive(self, daemon: DaemonProcess | AdoptedDaemon, exc: ControlError, holders: list[int]) -> None: ...
    def _refuse_impostor(self, daemon: DaemonProcess | AdoptedDaemon, names: tuple[str, ...] = ...) -> None: ...

TOML_FILE = "mps-v3.toml"
NO_TERMINATE = "faultPolicy terminate: NVIDIA's MPS v3 pages name no verb that ends a client; falls back to report"


class V3Supervision:
    def __init__(self, backend: V3Backend, config: "Config") -> None:
        self.backend = backend
        self.config = config
        self.multiuser = os.geteuid() == 0
        self.toml_path = os.path.join(config.state_dir, TOML_FILE)
        self._fault_said = False

    def control(self, timeout: float | None = None) -> Control3:
        c = self.config
        return Control3(c.control_binary, c.pipe_dir, c.log_dir, c.health_timeout if timeout is None else timeout)

    # -- start --------------------------------------------------------------------------------

    def daemon_options(self) -> dict:
        """DaemonProcess's extra arguments and environment; the TOML written first (atomically)."""
        text = self.backend.toml()
        write_atomic(self.toml_path, text.encode(), 0o644)
        log.info("MPS v3 configuration written path=%s servers=%d namespaces=%d", self.toml_path,
                 text.count("\n[servers.") - text.count(".namespaces."), text.count(".namespaces."))
        args = ["-p", "3", "-a", self.toml_path] + (["-m"] if self.multiuser else [])
        return {"args": args, "env": {"CUDA_MPS_PROTOCOL_VERSION": "3"}}

    def ping(self) -> None:
        self.control().server_list()

    def configure(self, config: "Config") -> None:
        """After a start: the namespaces of slices granted meanwhile, and the file's servers there."""
        self.config = config
        control = self.control()
        servers = control.server_list()
        missing = sorted(set(self.backend.wanted()) - {s.name for s in servers})
        if missing:
            raise ControlError(f"MPS v3 daemon lists no server {', '.join(missing)} of mpsd's file {self.toml_path}")
        changes, problems = self.backend.reconcile(control, servers)
        for note in changes:
            log.info("namespace brought in line at start: %s", note)
        if problems:  # tried again each health round; a refused verb is no reason to restart the daemon
            log.error("MPS v3 namespaces not as wanted at start: %s", "; ".join(problems))

    def apply_defaults(self, config: "Config") -> None:
        """A reload's new defaults: every server's default namespace."""
        self.config = config
        self.backend.defaults = default_limits(config)
        control = self.control()
        for server in control.server_list():
            control.namespace_set(server.name, "default", self.backend.defaults)

    def start_background(self) -> None:
        """The memory round's thread (NVML may block: never in the supervisor loop)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._memory_loop, name="mpsd-memory-limits", daemon=True)
        self._thread.start()

    def stop_background(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self._stop.set()
            self._thread.join(10)

    def _memory_loop(self) -> None:
        while not self._stop.wait(self.config.health_interval):
            try:
                self.backend.memory_round()
            except Exception:  # the round must outlive any one failure
                log.exception("memory limits round failed")

    def quit(self, timeout_s: int, wait: float) -> None:
        """quit_daemon's ``quit(timeout_s=, wait=)``: v3's ``-q`` (it takes no client timeout)."""
        self.control(timeout=wait).quit(wait=wait)

    # -- a health round -----------------------------------------------------------------------

    def _refuse_namespace_impostor(self, sup: Supervised, daemon: "DaemonProcess | AdoptedDaemon") -> None:
        """ControlImpostor (counted) if a live namespace's socket is served by a process that is
        neither the daemon nor one it started (a server may serve its namespaces' sockets)."""
        for name in self.backend.namespace_sockets():
            path = os.path.join(self.config.pipe_dir, name)
            pid = peer.listener_pid(path)
            if pid is None or pid == daemon.pid or descends_from(pid, daemon.pid):
                continue
            sup._publish(impostors=sup.status().impostors + 1)
            raise ControlImpostor(f"control socket impostor: {path} is served by {peer.describe(pid)}, not by the "
                                  f"daemon pid {daemon.pid} or its servers; the daemon is restarted to take it back")

    def health_check(self, sup: Supervised, daemon: "DaemonProcess | AdoptedDaemon") -> None:
        """One round for a v3 daemon, with the supervisor's verdicts (retire, inconclusive,
        hung after HUNG_AFTER silent rounds) as for v2."""
        began = time.monotonic()
        unreachable = dirs.client_socket_problem(Path(self.config.pipe_dir))
        if unreachable:
            return sup._retire(daemon, f"daemon pid={daemon.pid} failed its health check: {unreachable}")
        control = self.control()
        try:
            sup._refuse_impostor(daemon, ("control",))
            servers = control.server_list()
            notes, problems = self.backend.reconcile(control, servers)
            sup._refuse_impostor(daemon, ("control",))
            self._refuse_namespace_impostor(sup, daemon)
        except ControlTimeout as exc:
            return sup._no_answer(daemon, exc)
        except ControlBusy as exc:
            return sup._inconclusive(daemon, exc, peer.session_holders(daemon.pid, self.config.pipe_dir))
        except ControlError as exc:
            return sup._retire(daemon, f"daemon pid={daemon.pid} failed its health check: {exc}")
        sup._silent_checks, sup._verdict_at = (daemon.pid, 0), time.monotonic()
        if notes:
            log.error("MPS v3 namespaces changed behind mpsd, put back: %s", "; ".join(notes))
        faulted = [s for s in servers if s.status == "FAULT"]
        gpus = frozenset(int(s.name[1:]) for s in faulted if s.name[1:].isdigit())
        error = "; ".join(problems)
        if problems:
            log.error("MPS v3 namespaces not as wanted: %s", error)
        if faulted:
            fault = f"MPS server(s) {','.join(s.name for s in faulted)} in FAULT: clients of those servers must exit"
            log.error("%s gpus=%s", fault, sorted(gpus))
            if self.config.fault_policy == "terminate":
                fault = f"{fault}; {NO_TERMINATE}"
            error = "; ".join(filter(None, [fault, error]))
            if self.config.fault_policy == "terminate":
                if not self._fault_said:
                    log.warning("%s", NO_TERMINATE)
                    self._fault_said = True
        sup.board.update(faulted_gpus=gpus, last_error=error, unverified="")
        status = sup.status()
        sup._publish(
            verdict_age=0.0, state="running", failures_in_row=0, health_latency=time.monotonic() - began,
            health_checks=status.health_checks + 1, servers=tuple(s.pid for s in servers if s.pid is not None),
            server_states={s.pid: s.status for s in servers if s.pid is not None}, last_error=error,
            defaults_restored=status.defaults_restored + (1 if notes else 0),
        )
        sup._next_at = time.monotonic() + self.config.health_interval


def descends_from(pid: int, ancestor: int, proc: str = "/proc", depth: int = 4) -> bool:
    """Whether ``ancestor`` is ``pid``'s parent, or its parent's ... (at most ``depth`` steps)."""
    for _ in range(depth):
        try:
            with open(f"{proc}/{pid}/stat", "rb") as f:
                stat = f.read(4096)
            pid = int(stat[stat.rindex(b")") + 2:].split()[1])  # after "(comm) state": the ppid
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


def supervision_for(backend: object, config: Config) -> V3Supervision | None:
    """What the supervisor does differently for ``backend`` (mpsd.sharing.build.build's): a
    V3Supervision for an MPS v3 backend, None for v2."""
    return V3Supervision(backend, config) if isinstance(backend, V3Backend) else None
