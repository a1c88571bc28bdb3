"""The supervisor's side of ``daemonLifecycle: independent`` (mpsd/independent.py): what it does
with the outcome of looking for a daemon to adopt — one adopted, one awaited (the holder's),
or one refused (mpsd.genuine says why). Mixed into mpsd.supervisor.Supervisor, whose state
(board, status, timers) these methods change like its own."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from . import independent, multiuser

if TYPE_CHECKING:
    from .config import Config
    from .health import HealthBoard
    from .keeper import Keeper
    from .supervisor import Status

log = logging.getLogger("mpsd.supervisor")


class AdoptionMixin:
    # what it uses of mpsd.supervisor.Supervisor
    config: Config
    board: HealthBoard
    _said: str
    _uid_policy: multiuser.UidPolicy | None
    _adopting: bool
    _defaults: Keeper
    _verdict_at: float
    _next_at: float | None

    if TYPE_CHECKING:
        def _publish(self, **changes: Any) -> None: ...
        def _health_check(self) -> None: ...
        def _failed(self, message: str, quiet: bool = False) -> None: ...
        def status(self) -> Status: ...

    def _adopt(self, daemon: independent.AdoptedDaemon) -> None:
        """A running daemon, proven genuine, supervised from now on: nothing is sent to it but
        the health check, which reads its defaults back and sets those that differ (no quit, no
        restart, no server touched). /readyz turns ready once that check passes."""
        log.info("adopted the running control daemon pid=%d pipe_dir=%s", daemon.pid, self.config.pipe_dir)
        shared = multiuser.daemon_is_multi_user(daemon.pid)  # how it was started, not what mpsd would start
        if shared is not None:
            self._uid_policy = multiuser.UidPolicy(shared, (), "the adopted daemon's command line")
            self._publish(multi_user=shared)
        self._defaults.applied, self._defaults.stale, self._verdict_at = self.config, False, time.monotonic()
        self._defaults.new_daemon(daemon.pid, self.config.pipe_dir)  # writers named by who holds its session
        self._publish(state="running", pid=daemon.pid)
        self._adopting = True
        self._health_check()

    def _wait(self, message: str) -> None:
        """No daemon, and not mpsd's to start yet (the holder's is awaited): looked for again soon."""
        self._say(logging.WARNING, message)
        self.board.update(daemon_up=False, configured=False, last_error=message, unverified="")
        self._publish(state="backoff", pid=None, last_error=message, servers=(), server_states={})
        self._next_at = time.monotonic() + min(self.config.restart_backoff_initial, 1.0)

    def _refused(self, exc: independent.Refused) -> None:
        """The daemon on the pipe dir is not adopted: one line (not repeated while it stays the
        same), /readyz 503 with it, tried again with backoff. An impostor is counted; a genuine
        daemon whose sockets it serves is killed, to bind them again (its holder restarts it)."""
        message = self._report(exc)
        if exc.owner is not None and independent.kill_verified(exc.owner, self.config):
            log.error("killed the daemon pid=%d so that it binds its sockets again", exc.owner)
        self._failed(message, quiet=True)

    def _report(self, exc: independent.Refused) -> str:
        message = f"control daemon not adopted: {exc}"
        if exc.impostor:
            message = f"control socket impostor at adoption: {exc}"
            self._publish(impostors=self.status().impostors + 1)
        self._say(logging.ERROR, message)
        return message

    def _say(self, level: int, message: str) -> None:
        if message != self._said:
            log.log(level, "%s", message)
        self._said = message
