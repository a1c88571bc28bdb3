"""The daemon's defaults, watched: any UID may set them through the 0666 ``control`` socket
(the real 535 daemon refuses only ``quit`` and ``start_server`` for other UIDs), so every
health check reads them back and puts back what the config says.

What is compared: the default active thread percentage, the default pinned memory limit of
every device the config names or mpsd manages (by the daemon's ordinals, 0..n-1; none
expected where the config sets none),
and the default client priority (the driver's 0 where the config sets none). Limits keyed by
UUID cannot be read back on 535 and are not compared.

Every read, and every set with its read-back, is ONE front-end session (Control.batch): the
daemon serves one front-end at a time, so a pod writing in a loop cannot come between a value
mpsd sets and the value it reads back. It can change a default again after the session:
the supervisor then reports it and sets it again at the next round, and never restarts the
daemon for it (a restart ends every tenant's MPS server: what such a writer would want).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .control import Control, mem_limit_as_displayed, parse_mem_limit, parse_percentage, parse_priority
from ..units import format_size_mps_control

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Defaults:
    active_thread_percentage: float
    pinned_mem_limit: dict[int, int | None]  # bytes as the daemon prints them back, by device index
    client_priority: int


def expected(config: "Config", devices: set[int]) -> Defaults:
    """What the daemon reads back when it has ``config``'s defaults."""
    return _expected(config, sorted(watched(config, devices)))


def _expected(config: "Config", ordinals: list[int]) -> Defaults:
    limits = config.pinned_mem_limit
    return Defaults(
        config.active_thread_percentage,
        {d: mem_limit_as_displayed(limits[d]) if d in limits else None for d in ordinals},
        config.client_priority or 0,
    )


def watched(config: "Config", devices: set[int]) -> set[int]:
    """Device ordinals whose default limit is compared: the config's, and ``devices`` (the
    daemon's ordinals) unless the config keys a limit by UUID, which 535 does not read back
    under an ordinal: an ordinal's limit could then be that one."""
    configured = {d for d in config.pinned_mem_limit if isinstance(d, int)}
    by_uuid = any(isinstance(d, str) for d in config.pinned_mem_limit)
    return configured if by_uuid else configured | set(devices)


def read_commands(ordinals: list[int]) -> list[str]:
    return [
        "get_default_active_thread_percentage",
        *(f"get_default_device_pinned_mem_limit {d}" for d in ordinals),
        "get_default_client_priority",
    ]


def parse_read(answers: list[str], ordinals: list[int]) -> Defaults:
    """The answers to read_commands(ordinals), in order."""
    return Defaults(
        parse_percentage(answers[0]),
        {d: parse_mem_limit(answer) for d, answer in zip(ordinals, answers[1:-1], strict=True)},
        parse_priority(answers[-1]),
    )


def set_commands(config: "Config", devices: set[int], previous: "Config | None" = None) -> list[str]:
    """Commands that give the daemon ``config``'s defaults: each watched device's limit (0
    unsets one the config does not name), and any limit ``previous`` (the config the daemon had
    before a reload) set that ``config`` drops; the client priority back to the driver's 0 where
    the config sets none."""
    limits: dict[int | str, int] = dict.fromkeys(previous.pinned_mem_limit if previous else {}, 0)
    limits.update(dict.fromkeys(watched(config, devices), 0))
    limits.update(config.pinned_mem_limit)
    return [
        f"set_default_active_thread_percentage {config.active_thread_percentage:g}",
        *(
            f"set_default_device_pinned_mem_limit {d} {format_size_mps_control(n) if n else '0'}"
            for d, n in sorted(limits.items(), key=lambda item: str(item[0]))
        ),
        f"set_default_client_priority {config.client_priority or 0}",
    ]


def read(control: Control, config: "Config", devices: set[int]) -> Defaults:
    """The watched defaults, read in one front-end session."""
    ordinals = sorted(watched(config, devices))
    return parse_read(control.batch(read_commands(ordinals)), ordinals)


def differences(want: Defaults, got: Defaults) -> list[str]:
    """``key got X, config Y`` for each default that is not as configured."""
    out = []
    if not math.isclose(got.active_thread_percentage, want.active_thread_percentage, abs_tol=0.05):
        got_atp, want_atp = got.active_thread_percentage, want.active_thread_percentage
        out.append(f"activeThreadPercentage {got_atp:g} (config {want_atp:g})")
    for device, nbytes in want.pinned_mem_limit.items():
        if got.pinned_mem_limit.get(device) != nbytes:
            out.append(f"pinnedMemLimit device {device} {got.pinned_mem_limit.get(device)} (config {nbytes})")
    if got.client_priority != want.client_priority:
        out.append(f"clientPriority {got.client_priority} (config {want.client_priority})")
    return out


def only_differing(sets: list[str], config: "Config", devices: set[int], got: Defaults) -> list[str]:
    """The commands of ``sets`` (set_commands') that change something the daemon reads back as
    ``got``: what an adopted daemon is sent (nothing it already has)."""
    want = expected(config, devices)
    keep = []
    for command in sets:
        words = command.split()
        if words[0] == "set_default_active_thread_percentage":
            if math.isclose(got.active_thread_percentage, want.active_thread_percentage, abs_tol=0.05):
                continue
        elif words[0] == "set_default_client_priority":
            if got.client_priority == want.client_priority:
                continue
        elif words[1].isdigit() and int(words[1]) in want.pinned_mem_limit:  # a limit by UUID: always sent
            if got.pinned_mem_limit.get(int(words[1])) == want.pinned_mem_limit[int(words[1])]:
                continue
        keep.append(command)
    return keep


def settle(control: Control, config: "Config", devices: set[int], previous: "Config | None" = None,
           got: Defaults | None = None) -> list[str]:
    """Set ``config``'s defaults and read them back, all in one front-end session: no other
    front-end (a pod's writer) can come between a value set and its read-back. What reads back
    different then is what the daemon itself refused: returned (``differences``), [] when none.
    ``previous``: see set_commands; ``got``: the defaults as read, only those that differ are
    set (only_differing). Raises ControlError (ControlBusy: held by another front-end)."""
    sets = set_commands(config, devices, previous)
    if got is not None:
        sets = only_differing(sets, config, devices, got)
    dropped = {d for d in (previous.pinned_mem_limit if previous else {}) if isinstance(d, int)}
    ordinals = sorted(watched(config, devices) | (dropped - config.pinned_mem_limit.keys()))
    answers = control.batch(sets + read_commands(ordinals))
    for device in config.pinned_mem_limit:
        if isinstance(device, str):
            log.info("pinned limit by UUID set, not read back (this daemon cannot) device=%s", device)
    return differences(_expected(config, ordinals), parse_read(answers[len(sets) :], ordinals))
