"""The supervisor's side of ``daemonLifecycle: independent`` (mpsd/lifecycle/independent.py): what
it does with the outcome of looking for a daemon to adopt — one adopted, one awaited (the
holder's), or one refused (mpsd.daemon.genuine says why). The supervisor holds one
:class:`Adoption` and calls it; what it changes of the supervisor is named in :class:`Supervised`."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from ..config import Config
from ..daemon import multiuser
from .health import HealthBoard
from . import independent
from .keeper import Keeper
from .snapshot import Status

log = logging.getLogger("mpsd.lifecycle.supervisor")  # its lines are the supervisor's


class Supervised(Protocol):
    """What adoption uses of mpsd.lifecycle.supervisor.Supervisor."""

    config: Config
    board: HealthBoard
    _uid_policy: multiuser.UidPolicy | None
    _adopting: bool
    _defaults: Keeper
    _verdict_at: float
    _next_at: float | None

    def _publish(self, **changes: Any) -> None: ...
    def _health_check(self) -> None: ...
    def _failed(self, message: str, quiet: bool = False) -> None: ...
    def status(self) -> Status: ...


class Adoption:
    def __init__(self, sup: Supervised) -> None:
        self.sup = sup
        self.said = ""  # the last refusal or wait logged: said once, not at every retry

    def adopt(self, daemon: independent.AdoptedDaemon) -> None:
        """A running daemon, proven genuine, supervised from now on: nothing is sent to it but
        the health check, which reads its defaults back and sets those that differ (no quit, no
        restart, no server touched). /readyz turns ready once that check passes."""
        sup = self.sup
        log.info("adopted the running control daemon pid=%d pipe_dir=%s", daemon.pid, sup.config.pipe_dir)
        shared = multiuser.daemon_is_multi_user(daemon.pid)  # how it was started, not what mpsd would start
        if shared is not None:
            sup._uid_policy = multiuser.UidPolicy(shared, (), "the adopted daemon's command line")
            sup._publish(multi_user=shared)
        sup._defaults.applied, sup._defaults.stale, sup._verdict_at = sup.config, False, time.monotonic()
        sup._defaults.new_daemon(daemon.pid, sup.config.pipe_dir)  # writers named by who holds its session
        sup._publish(state="running", pid=daemon.pid)
        sup._adopting = True
        sup._health_check()

    def wait(self, message: str) -> None:
        """No daemon, and not mpsd's to start yet (the holder's is awaited): looked for again soon."""
        sup = self.sup
        self.say(logging.WARNING, message)
        sup.board.update(daemon_up=False, configured=False, last_error=message, unverified="")
        sup._publish(state="backoff", pid=None, last_error=message, servers=(), server_states={})
        sup._next_at = time.monotonic() + min(sup.config.restart_backoff_initial, 1.0)

    def refused(self, exc: independent.Refused) -> None:
        """The daemon on the pipe dir is not adopted: one line (not repeated while it stays the
        same), /readyz 503 with it, tried again with backoff. An impostor is counted; a genuine
        daemon whose sockets it serves is killed, to bind them again (its holder restarts it)."""
        message = self.report(exc)
        if exc.owner is not None and independent.kill_verified(exc.owner, self.sup.config):
            log.error("killed the daemon pid=%d so that it binds its sockets again", exc.owner)
        self.sup._failed(message, quiet=True)

    def report(self, exc: independent.Refused) -> str:
        message = f"control daemon not adopted: {exc}"
        if exc.impostor:
            message = f"control socket impostor at adoption: {exc}"
            self.sup._publish(impostors=self.sup.status().impostors + 1)
        self.say(logging.ERROR, message)
        return message

    def say(self, level: int, message: str) -> None:
        if message != self.said:
            log.log(level, "%s", message)
        self.said = message
