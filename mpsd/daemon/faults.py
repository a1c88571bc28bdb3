"""MPS servers in FAULT: how the health check sees them, and what ``mpsd run`` does to their
clients (``faultPolicy``).

Servers are asked ``get_server_status`` (driver 550 and later). A daemon that does not know
the command, or answers in a form the parser does not know, has FAULT detection off (said
once); it is not restarted for that: it answered.

MPS shares a fault among all clients of a server: each gets a sticky error, and the server
refuses new clients until every one of them has exited. ``report`` leaves them to exit (or to
their orchestrator); ``terminate`` ends them so the server can recover:

1. at the first health check that sees the server in FAULT, ``terminate_client SERVER CLIENT``
   for every client the daemon lists for it (NVIDIA's supported way: the client's GPU work is
   ended, it gets CUDA_ERROR_MPS_CLIENT_TERMINATED);
2. at the first health check ``grace`` seconds later, every client still listed is SIGKILLed,
   through a pidfd opened before the list is read again, so a PID reused meanwhile is never hit,
   and only once ``is_client`` shows it is an MPS client of that server (mpsd.daemon.peer: the kernel
   names it connected to the daemon or the server; its environment, which it can rewrite, is
   not asked): a list is the daemon's word, and the pipe dir's sockets can be replaced by a pod's.

A daemon without ``terminate_client`` (it answers "Unknown command") turns the policy into
``report``, said once in one line. Every step is logged; the counts per method are kept for
the metrics. The supervisor calls :meth:`FaultHandler.handle` at each health check.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from .control import CommandRejected, Control, UnexpectedOutput, UnknownCommand
from ..errors import ControlBusy, ControlError, ControlTimeout

log = logging.getLogger(__name__)

REPORT, TERMINATE = "report", "terminate"
POLICIES = (REPORT, TERMINATE)
UNSUPPORTED = "faultPolicy terminate: this daemon has no terminate_client ({reason}); falls back to report"


@dataclass
class _Ending:
    """One faulted server being emptied: when terminate_client was sent, whom mpsd killed."""

    since: float
    killed: set[int] = field(default_factory=set)


class FaultHandler:
    def __init__(
        self,
        grace: float,
        protected: tuple[int, ...] = (),
        is_client: Callable[[int, int], str] = lambda pid, server: "",
    ) -> None:
        self.grace = grace  # seconds between terminate_client and SIGKILL
        self.is_client = is_client  # (pid, server): "" if shown to be an MPS client of it, else why not
        self.protected = {0, 1, os.getpid(), *protected}  # never signalled
        self.counts: dict[str, int] = {}
        self.unsupported = ""  # the one-line reason once terminate_client proved missing
        self.supports_status: bool | None = None  # get_server_status, None until asked
        self._servers: dict[int, _Ending] = {}

    def reset(self) -> None:
        """A new daemon: new servers, and maybe another binary."""
        self._servers.clear()
        self.unsupported = ""
        self.supports_status = None

    def server_states(self, control: Control, servers: list[int]) -> dict[int, str]:
        """{server: INITIALIZING | ACTIVE | FAULT}; empty while detection is off."""
        states: dict[int, str] = {}
        if self.supports_status is False:
            return states
        for pid in servers:
            try:
                states[pid] = control.get_server_status(pid)
                self.supports_status = True
            except UnknownCommand:
                log.info("get_server_status not supported by this daemon (before driver 550): FAULT detection off")
                self.supports_status = False
                break
            except CommandRejected:
                continue  # the server exited between the two commands
            except UnexpectedOutput as exc:
                # The daemon answered: it is healthy. Killing it (and every client) over an
                # answer this parser does not know would repeat at every health check.
                log.error("cannot read the server status of this daemon, FAULT detection off: %s", exc)
                self.supports_status = False
                break
        return states

    def handle(self, policy: str, control: Control, faulted: list[int]) -> str:
        """Act on the servers now in FAULT; what was done, for last_error ("" for report)."""
        for server in set(self._servers) - set(faulted):  # ACTIVE again, or gone
            log.info("fault policy: server %d left FAULT", server)
            del self._servers[server]
        if policy != TERMINATE or not faulted:
            return ""
        if self.unsupported:
            return self.unsupported
        notes = [self._handle_server(control, server) for server in faulted]
        return self.unsupported or "; ".join(filter(None, notes))

    def _handle_server(self, control: Control, server: int) -> str:
        try:
            clients = [pid for pid in control.get_client_list(server) if pid not in self.protected]
        except CommandRejected:
            return ""  # the server exited since the status was read
        except ControlError as exc:
            log.warning("fault policy: cannot list the clients of server=%d error=%s", server, exc)
            return f"faultPolicy terminate: cannot list the clients of server {server}: {exc}"
        ending = self._servers.get(server)
        if ending is None:
            ending = self._servers[server] = _Ending(time.monotonic())
            ended = self._terminate(control, server, clients)
            if ended is None:  # the daemon did not take the commands: all again at the next check
                del self._servers[server]
                return f"faultPolicy terminate: terminate_client to the clients of server {server} not sent yet"
            if self.unsupported:
                return ""
            return f"faultPolicy terminate: terminate_client ended {ended}/{len(clients)} client(s) of server {server}"
        left = [pid for pid in clients if pid not in ending.killed]
        waited = time.monotonic() - ending.since
        if left and waited >= self.grace:
            ending.killed.update(pid for pid in left if self._kill(control, server, pid))
            left = [pid for pid in left if pid not in ending.killed]
        killed = f"{len(ending.killed)} client(s) SIGKILLed, " if ending.killed else ""
        if left:
            return f"faultPolicy terminate: {killed}{len(left)} client(s) of server {server} left after {waited:.1f}s"
        return f"faultPolicy terminate: {killed}no client of server {server} left, waiting for it to leave FAULT"

    def _terminate(self, control: Control, server: int, clients: list[int]) -> int | None:
        """terminate_client for each client: how many it ended; None if the daemon was hung or
        held by another front-end (nothing is counted as sent then)."""
        ended = 0
        for pid in clients:
            try:
                result = control.terminate_client(server, pid)
            except UnknownCommand as exc:
                self.unsupported = UNSUPPORTED.format(reason=str(exc).split(": ")[-1])
                log.error("%s", self.unsupported)
                return ended
            except (ControlTimeout, ControlBusy) as exc:
                log.warning("fault policy: terminate_client not taken server=%d client=%d error=%s", server, pid, exc)
                return None if ended == 0 else ended
            except ControlError as exc:  # rejected: the client left meanwhile
                log.warning("fault policy: terminate_client failed server=%d client=%d error=%s", server, pid, exc)
                continue
            if result != 0:
                log.warning("fault policy: terminate_client server=%d client=%d returned %d", server, pid, result)
                continue
            ended += 1
            self.counts["terminate_client"] = self.counts.get("terminate_client", 0) + 1
            log.warning("fault policy: client ended server=%d client=%d method=terminate_client", server, pid)
        return ended

    def _kill(self, control: Control, server: int, pid: int) -> bool:
        """SIGKILL ``pid`` if it is still a client of ``server`` once a pidfd holds it."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False  # exited already
        except OSError as exc:
            log.error("fault policy: cannot open client=%d error=%s", pid, exc.strerror)
            return False
        try:
            if pid not in control.get_client_list(server):
                return False
            problem = self.is_client(pid, server)
            if problem:
                log.error("fault policy: client=%d of server=%d not killed: no MPS client: %s", pid, server, problem)
                return False
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return False
        except (ControlError, OSError) as exc:
            log.error("fault policy: cannot kill server=%d client=%d error=%s", server, pid, exc)
            return False
        finally:
            os.close(pidfd)
        self.counts["sigkill"] = self.counts.get("sigkill", 0) + 1
        log.warning("fault policy: client killed server=%d client=%d method=sigkill", server, pid)
        return True
