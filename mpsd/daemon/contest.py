"""Defaults changed behind mpsd, round after round, and who changed them.

Any UID may send ``set_default_*`` through the 535 daemons' ``control`` socket. mpsd never
restarts the daemon for it (that would end every tenant's MPS server, which is what such a
writer would want): it sets the defaults again at every health round that finds them changed
(mpsd.daemon.drift), and reports the fight here:

- :class:`WriterWatch` reads the daemon's own log as it is printed (in ``-f`` mode the daemon
  prints ``Cmd:COMMAND`` for every command of every front-end). On a ``set_default_*`` line it
  asks the kernel who holds the daemon's control session right then (peer.session_holders,
  SO_PEERCRED of the daemon's accepted sockets), leaving out mpsd's own front-ends (children
  of mpsd). A one-shot writer may have closed its session before the line is read: then no
  one is named. A writer that loops is named.
- :class:`Contest` keeps how long the defaults have been found changed again and again; past
  ``verdictTimeout`` /readyz says so, and ``mpsd_defaults_contested_seconds`` grows meanwhile.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass

from . import peer

log = logging.getLogger(__name__)

LOOKUP_EVERY = 0.1  # seconds between two session lookups: a looping writer cannot make mpsd spin
LOG_EVERY = 60.0  # seconds between two log lines while the same run of changed rounds goes on
_SET_DEFAULT = re.compile(r"\bCmd:(set_default_[a-z_]+(?: [^\s]{1,64}){0,2})")


def written_default(line: str) -> str:
    """The set_default_* command a daemon log line records ("" for any other line)."""
    m = _SET_DEFAULT.search(line)
    return m.group(1) if m else ""


def writer_text(who: str, command: str) -> str:
    return f"{who} sending {command!r}"


class WriterWatch:
    """Who sent the last set_default_* command to the daemon ``daemon_pid`` serving ``pipe_dir``."""

    def __init__(self, daemon_pid: int, pipe_dir: str, own_pid: int, proc: str = "/proc") -> None:
        self.daemon_pid, self.pipe_dir, self.own_pid, self.proc = daemon_pid, pipe_dir, own_pid, proc
        self._last = ""  # writer_text of the last writer named, "" when none since take()
        self._lookup_at = 0.0
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        """Fed every line the daemon prints (its output pump's thread)."""
        command = written_default(text)
        if not command or time.monotonic() < self._lookup_at:
            return
        self._lookup_at = time.monotonic() + LOOKUP_EVERY
        who = self.holders()
        if who:
            with self._lock:
                self._last = writer_text(who, command)

    def holders(self) -> str:
        """The processes holding the daemon's control session now, but mpsd's own front-ends."""
        pids = peer.session_holders(self.daemon_pid, self.pipe_dir, self.proc)
        theirs = [pid for pid in pids if peer.parent_pid(pid, self.proc) != self.own_pid]
        return ", ".join(peer.describe(pid, self.proc) for pid in theirs)

    def take(self) -> str:
        """The last writer named since the previous take() ("" when none)."""
        with self._lock:
            last, self._last = self._last, ""
        return last


@dataclass
class Contest:
    """A run of health rounds that found the defaults changed: it goes on while each such
    round comes within ``bound`` (verdictTimeout) of the previous one, and ends once the
    defaults have been found as configured for ``bound``. A writer that loops, or comes back
    every few rounds, makes one run; a single change makes a run of one round."""

    since: float | None = None  # the first round of the current run
    last: float = 0.0  # the last round that found a change
    what: str = ""  # the changes, as the last round found them
    writer: str = ""  # who made them, as far as known
    rounds: int = 0
    logged_at: float = 0.0

    def changed(self, what: str, writer: str, now: float, bound: float) -> bool:
        """Record a round that found ``what`` changed; True when it is worth a log line (the
        first of a run, then every LOG_EVERY seconds)."""
        if self.since is None or now - self.last > bound:
            self.since, self.rounds, self.writer = now, 0, ""
        self.rounds += 1
        self.last, self.what, self.writer = now, what, writer or self.writer
        if self.rounds == 1 or now - self.logged_at >= LOG_EVERY:
            self.logged_at = now
            return True
        return False

    def held(self, now: float, bound: float) -> None:
        """A round found the defaults as configured: the run ends after ``bound`` of these."""
        if self.since is not None and now - self.last >= bound:
            self.reset()

    def reset(self) -> None:
        self.since, self.what, self.writer, self.rounds = None, "", "", 0

    def age(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since

    def reason(self, now: float, bound: float) -> str:
        """/readyz's reason once the run has lasted ``bound`` seconds ("" before, or after it)."""
        age = self.age(now)
        if self.since is None or age < bound:
            return ""
        by = f"; last written by {self.writer}" if self.writer else "; the writer could not be named"
        return (
            f"daemon defaults changed again and again for {age:.0f}s (verdictTimeout {bound:g}s), "
            f"restored each time ({self.rounds} health checks): {self.what}{by}"
        )
