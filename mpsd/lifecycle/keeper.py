"""The running daemon's defaults kept as configured: set at start and after a reload, read
and put back at every health check (mpsd.daemon.drift), the fight reported (mpsd.daemon.contest).

Nothing here ever kills the daemon. A default it reads back different, right after mpsd set
it or at a later round, is reported and set again at the next round: a restart would end every
tenant's MPS server, and a writer that loops would win the race at the next start too.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from ..daemon import drift
from ..daemon.contest import Contest, WriterWatch
from ..daemon.control import Control, limit_early_servers
from ..errors import ControlBusy, ControlError

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

REFUSED = "the daemon reads them back so right after mpsd set them"


class Keeper:
    def __init__(self, config: "Config") -> None:
        self.applied = config  # the config whose defaults the running daemon has (or is to get)
        self.stale = False  # not set yet (the daemon was busy): set at the next health check
        self.restored = 0  # health checks that found defaults changed and put them back
        self.contest = Contest()
        self.writers: WriterWatch | None = None

    def new_daemon(self, pid: int, pipe_dir: str) -> WriterWatch:
        """A daemon was started: its output goes to the returned watch's line()."""
        self.contest.reset()
        self.writers = WriterWatch(pid, pipe_dir, os.getpid())
        return self.writers

    def start(self, control: Control, config: "Config", devices: set[int]) -> str:
        """The config's defaults on a new daemon, and on servers that started before them: ""
        when set; else why not (a busy daemon: set at the next health check). Raises any other
        ControlError (the daemon is not answering as it should at start)."""
        self.applied = config
        try:
            left = drift.settle(control, config, devices)
            limit_early_servers(control, config)
        except ControlBusy as exc:
            self.stale = True
            message = f"defaults not applied yet, trying again at the next health check: {exc}"
            log.error("%s", message)
            return message
        self.stale = False
        return self._report(left, "", REFUSED, config.verdict_timeout, "refused") if left else ""

    def reload(self, control: Control, config: "Config", devices: set[int]) -> str:
        """Bring the daemon's defaults to a reloaded ``config``: "" when done, else why not
        (tried again at the next health check while ``stale``)."""
        self.stale = True
        try:
            left = drift.settle(control, config, devices, previous=self.applied)
        except ControlError as exc:
            message = f"new defaults not applied yet, trying again at the next health check: {exc}"
            log.error("%s", message)
            return message
        self.applied, self.stale = config, False
        log.info("new defaults applied: they reach servers started from now on")
        return self._report(left, "", REFUSED, config.verdict_timeout, "refused") if left else ""

    def adopt(self, control: Control, got: drift.Defaults, devices: set[int]) -> str:
        """An adopted daemon's defaults made the config's, setting only those that differ from
        ``got`` (another config's, or a daemon its holder restarted: not tampering): "" when done
        or nothing differed, else why not (``stale``: tried again at the next health check)."""
        changed = drift.differences(drift.expected(self.applied, devices), got)
        if not changed:
            return ""
        try:
            left = drift.settle(control, self.applied, devices, got=got)
        except ControlError as exc:
            self.stale = isinstance(exc, ControlBusy)
            return f"adopted daemon's defaults not set yet ({'; '.join(changed)}): {exc}"
        log.info("adopted daemon's defaults set to the config's (it had %s)", "; ".join(changed))
        return self._report(left, "", REFUSED, 0.0, "refused") if left else ""

    def restore(self, control: Control, got: drift.Defaults, devices: set[int], bound: float) -> str:
        """Put back defaults changed through ``control`` (``got``: as a health check read them):
        "" when none were changed, else the report (also when they were put back)."""
        changed = drift.differences(drift.expected(self.applied, devices), got)
        if not changed:
            self.contest.held(time.monotonic(), bound)
            return ""
        writer = self.writer()
        try:
            left = drift.settle(control, self.applied, devices)
        except ControlError as exc:  # busy, or hung: the health check's own business next round
            return self._report(changed, writer, f"not restored yet: {exc}", bound)
        if left:
            return self._report(changed, writer, f"set again, the daemon reads back {'; '.join(left)}", bound)
        self.restored += 1
        return self._report(changed, writer, "restored to the config's", bound)

    def writer(self) -> str:
        """Who changed the defaults, as far as the kernel can tell: the last set_default_*
        sender seen on the daemon's log, else whoever holds its control session now."""
        if self.writers is None:
            return ""
        if last := self.writers.take():
            return last
        holders = self.writers.holders()
        return f"{holders} (holding the control session)" if holders else ""

    def _report(self, changed: list[str], writer: str, outcome: str, bound: float, found: str = "changed") -> str:
        """One log line for a round that found defaults changed (the first of a run, then once
        a minute); the message for last_error."""
        by = f" by {writer}" if writer else ""
        message = f"daemon defaults {found}{by} ({'; '.join(changed)}): {outcome}"
        if self.contest.changed("; ".join(changed), writer, time.monotonic(), bound):
            log.error("%s (%d time(s) in this run)", message, self.contest.rounds)
        return message
