"""What a SIGHUP reload changes at once: the keys applied to the running daemon and
supervisor (LIVE_KEYS), the merge of a new config into the running one, and SIGHUPs that
come before the supervisor runs."""

from __future__ import annotations

import signal
from dataclasses import replace

from . import BY_KEY, Config, changed_keys

# SIGHUPs that came between hold_reloads() and install_signal_handlers(): NVML's init alone can
# take seconds on a node, and SIGHUP's default action would have killed mpsd (a `systemctl reload`
# right after a start). Appending to a list is safe in a Python signal handler.
_early_reloads: list[int] = []


def hold_reloads() -> None:
    """From now on a SIGHUP is remembered, not fatal; install_signal_handlers() acts on it.
    Call it first thing in ``mpsd run`` (main thread only)."""
    signal.signal(signal.SIGHUP, lambda signum, _frame: _early_reloads.append(signum))


LIVE_KEYS = frozenset(
    {
        "activeThreadPercentage",
        "pinnedMemLimit",
        "clientPriority",
        "healthInterval",
        "healthTimeout",
        "verdictTimeout",
        "restartBackoffInitial",
        "restartBackoffMax",
        "shutdownTimeout",
        "logLevel",
        "faultPolicy",
    }
)
DEFAULT_KEYS = frozenset({"activeThreadPercentage", "pinnedMemLimit", "clientPriority"})  # the daemon's defaults


def merge_live(current: Config, new: Config) -> tuple[Config, set[str], list[str]]:
    """``current`` with the live keys that changed in ``new``; the keys applied, and the
    changed keys that wait for a restart."""
    changed = changed_keys(current, new)
    live = {k for k in changed if k in LIVE_KEYS}
    merged = current
    for key in live:
        merged = replace(merged, **{BY_KEY[key].attr: new.get(key)})
    return merged, live, [k for k in changed if k not in LIVE_KEYS]
