"""What the supervisor does differently for an MPS v3 daemon (mpsd/lifecycle/supervisor.py holds one
:class:`V3Supervision` and calls it where it would speak v2's interactive shell).

- start: mpsd writes the TOML (mpsd/sharing/toml3.py) into stateDir and starts
  ``nvidia-cuda-mps-control -f -p 3 -a <file>``, plus ``-m`` as root with multiUser auto/on
  (mpsd/daemon/multiuser.py's resolve_v3: the v3 page's option; v2's probe and
  ``-multiuser-server`` are never used under v3); as another user each server serves mpsd's
  UID (the file's ``uid``); CUDA_MPS_PROTOCOL_VERSION=3 as well (the variable wins over -p);
- listening: ``server list`` answers, in whatever form: an answer mpsd cannot read is said as
  such, with its line, in /readyz and the log, never taken for a daemon that does not listen;
- configured: the live slices' namespaces read back as wanted (a slice granted while the daemon
  started is created now); a server of the file the daemon does not list is reported and its
  GPU marked unhealthy (Dynamo's guide: a server whose device is missing exits and "disappears
  from server list", and its clients run without MPS);
- each health round: the pipe dir's sockets, ``control`` and every live namespace's, served by
  the daemon mpsd started (mpsd/daemon/peer.py), else the daemon is restarted to take them back;
  ``server list``; the namespaces read back and put back (``V3Backend.reconcile``); a server in
  FAULT marks the GPUs it serves unhealthy (its allowed-devices, else its name ``g<index>``);
  ``faultPolicy: terminate`` ends its clients with ``client terminate <pid>`` (Interface page).
  A status word mpsd does not know is reported, not acted on;
- reload: the defaults (activeThreadPercentage, pinnedMemLimit, clientPriority) go to every
  server's default namespace with ``server set`` (Interface page: "applied to the server's
  default namespace");
- stop: ``-q``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from ..daemon import dirs, multiuser, peer
from ..daemon.control import CommandRejected, UnexpectedOutput
from ..daemon.control3 import Control3, Server3
from ..daemon.answers3 import uuids
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


class V3Supervision:
    def __init__(self, backend: V3Backend, config: "Config") -> None:
        self.backend = backend
        self.config = config
        self.toml_path = os.path.join(config.state_dir, TOML_FILE)
        self._terminated: set[str] = set()  # servers in FAULT whose clients were ended (once per fault)
        self._said: set[str] = set()  # unknown status words and unreadable answers, logged once each

    def control(self, timeout: float | None = None) -> Control3:
        c = self.config
        return Control3(c.control_binary, c.pipe_dir, c.log_dir, c.health_timeout if timeout is None else timeout)

    # -- start --------------------------------------------------------------------------------

    def uid_policy(self, mode: str, euid: int | None = None) -> multiuser.UidPolicy:
        """multiUser under v3 (mpsd.daemon.multiuser.resolve_v3): the daemon's options, and the
        file's ``uid`` where the daemon is not multi-user. SetupError for ``on`` without root."""
        policy = multiuser.resolve_v3(mode, os.geteuid() if euid is None else euid)
        self.backend.uid = None if policy.multi_user else (os.geteuid() if euid is None else euid)
        return policy

    def daemon_options(self) -> dict:
        """DaemonProcess's extra arguments and environment; the TOML written first (atomically).
        ``-m`` comes with the supervisor's options (uid_policy)."""
        text = self.backend.toml()
        write_atomic(self.toml_path, text.encode(), 0o644)
        log.info("MPS v3 configuration written path=%s servers=%d namespaces=%d", self.toml_path,
                 text.count("\n[servers.") - text.count(".namespaces."), text.count(".namespaces."))
        return {"args": ["-p", "3", "-a", self.toml_path], "env": {"CUDA_MPS_PROTOCOL_VERSION": "3"}}

    def ping(self) -> None:
        """The daemon answers ``server list``: in a form mpsd reads or not (then configure and the
        health rounds say so); DaemonNotRunning and the like while it does not."""
        try:
            self.control().server_list()
        except (UnexpectedOutput, CommandRejected) as exc:
            log.info("MPS v3 daemon answers, in a form mpsd cannot use: %s", exc)

    def configure(self, config: "Config") -> str:
        """After a start: the namespaces of slices granted meanwhile. What is not as wanted, one
        line ("" when all is): reported in /readyz, never a reason to restart the daemon."""
        self.config = config
        control = self.control()
        try:
            servers = control.server_list()
            result = self.backend.reconcile(control, servers)
        except (UnexpectedOutput, CommandRejected) as exc:
            return self._unreadable(exc)
        for note in result.changes:
            log.info("namespace brought in line at start: %s", note)
        problems = result.unreadable + result.problems
        if problems:  # tried again each health round
            log.error("MPS v3 namespaces not as wanted at start: %s", "; ".join(problems))
        return "; ".join(result.unreadable)

    def _unreadable(self, exc: ControlError) -> str:
        text = f"MPS v3 daemon answers, but mpsd cannot read it: {exc}"
        if text not in self._said:
            self._said.add(text)
            log.error("%s", text)
        return text

    def apply_defaults(self, config: "Config") -> None:
        """A reload's new defaults: every server's default namespace (``server set``)."""
        self.config = config
        self.backend.defaults = default_limits(config)
        control = self.control()
        for server in control.server_list():
            control.server_set(server.name, self.backend.defaults)

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
        hung after HUNG_AFTER silent rounds) as for v2. An answer mpsd cannot read, or a verb
        refused, is reported (/readyz, the log), never a reason to restart the daemon."""
        began = time.monotonic()
        unreachable = dirs.client_socket_problem(Path(self.config.pipe_dir))
        if unreachable:
            return sup._retire(daemon, f"daemon pid={daemon.pid} failed its health check: {unreachable}")
        control = self.control()
        unreadable = ""
        try:
            sup._refuse_impostor(daemon, ("control",))
            servers = control.server_list()
            result = self.backend.reconcile(control, servers)
            sup._refuse_impostor(daemon, ("control",))
            self._refuse_namespace_impostor(sup, daemon)
            fault_notes = self._faults(control, servers)
        except ControlTimeout as exc:
            return sup._no_answer(daemon, exc)
        except ControlBusy as exc:
            return sup._inconclusive(daemon, exc, peer.session_holders(daemon.pid, self.config.pipe_dir))
        except (UnexpectedOutput, CommandRejected) as exc:  # it answered: no verdict against it
            servers, fault_notes, unreadable = [], [], self._unreadable(exc)
            result = None
        except ControlError as exc:
            return sup._retire(daemon, f"daemon pid={daemon.pid} failed its health check: {exc}")
        sup._silent_checks, sup._verdict_at = (daemon.pid, 0), time.monotonic()
        changes = result.changes if result else []
        if changes:
            log.error("MPS v3 namespaces changed behind mpsd, put back: %s", "; ".join(changes))
        if result and result.unreadable:
            unreadable = self._unreadable(UnexpectedOutput("; ".join(result.unreadable)))
        problems = (result.problems if result else []) + fault_notes
        if result and result.problems:
            log.error("MPS v3 namespaces not as wanted: %s", "; ".join(result.problems))
        unhealthy = self._unhealthy_gpus(servers) if result else sup.board.current().faulted_gpus  # unknown: kept
        error = "; ".join(filter(None, [unreadable, *problems]))
        sup.board.update(faulted_gpus=unhealthy, last_error=error, unverified=unreadable)
        status = sup.status()
        sup._publish(
            verdict_age=0.0, state="running", failures_in_row=0, health_latency=time.monotonic() - began,
            health_checks=status.health_checks + 1, servers=tuple(s.pid for s in servers if s.pid is not None),
            server_states={s.pid: s.status for s in servers if s.pid is not None}, last_error=error,
            defaults_restored=status.defaults_restored + (1 if changes else 0),
        )
        sup._next_at = time.monotonic() + self.config.health_interval

    def _gpus_of(self, server: Server3) -> set[int]:
        """The GPU indices a server serves: its allowed devices by UUID, else its name ``g<index>``."""
        by_uuid = {g.uuid: g.index for g in self.backend.gpus()}
        found = {by_uuid[u] for u in uuids(server.allowed_devices) if u in by_uuid}
        if not found and server.name[1:].isdigit() and server.name.startswith("g"):
            found = {int(server.name[1:])}
        return found

    def _unhealthy_gpus(self, servers: list[Server3]) -> frozenset[int]:
        listed = {s.name for s in servers}
        gone = {g.index for g in self.backend.gpus() if f"g{g.index}" not in listed}
        return frozenset(gone.union(*(self._gpus_of(s) for s in servers if s.fault)))

    def _faults(self, control: Control3, servers: list[Server3]) -> list[str]:
        """Notes for /readyz: servers in FAULT (their clients ended under faultPolicy terminate,
        once per fault), servers of managed GPUs the daemon does not list, unknown status words."""
        notes = []
        listed = {s.name for s in servers}
        missing = sorted(f"g{g.index}" for g in self.backend.gpus() if f"g{g.index}" not in listed)
        if missing:
            notes.append(f"MPS server(s) {','.join(missing)} of mpsd's file not listed by the daemon: their GPUs are "
                         "marked unhealthy (a client there would run without MPS limits)")
        for s in servers:
            if not s.known:
                note = f"MPS server {s.name} reports status {s.status!r}, a word mpsd does not know (reported only)"
                notes.append(note)
                if note not in self._said:
                    self._said.add(note)
                    log.warning("%s", note)
        faulted = [s for s in servers if s.fault]
        self._terminated &= {s.name for s in faulted}
        if not faulted:
            return notes
        fault = f"MPS server(s) {','.join(s.name for s in faulted)} in FAULT: clients of those servers must exit"
        log.error("%s gpus=%s", fault, sorted(set().union(*(self._gpus_of(s) for s in faulted))))
        if self.config.fault_policy == "terminate":
            fault += self._terminate(control, [s for s in faulted if s.name not in self._terminated])
        return [fault, *notes]

    def _terminate(self, control: Control3, faulted: list[Server3]) -> str:
        """faultPolicy terminate: ``client terminate <pid>`` for each client of the faulted servers."""
        if not faulted:
            return "; their clients were terminated"
        names = {s.name for s in faulted}
        ended, refused = [], []
        for client in control.client_list():
            if client.server in names:
                try:
                    control.client_terminate(client.pid)
                    ended.append(client.pid)
                except CommandRejected as exc:
                    refused.append(f"pid {client.pid}: {exc}")
        self._terminated |= names
        log.error("faultPolicy terminate: clients of %s terminated pids=%s refused=%s", sorted(names), ended, refused)
        return f"; {len(ended)} client(s) terminated (client terminate)" + (f", refused: {'; '.join(refused)}"
                                                                            if refused else "")


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
