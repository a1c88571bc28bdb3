"""The daemon's defaults, watched: any UID may set them through the 0666 ``control`` socket
(the real 535 daemon refuses only ``quit`` and ``start_server`` for other UIDs), so every
health check reads them back and puts back what the config says.

What is compared: the default active thread percentage, the default pinned memory limit of
every device the config names or mpsd manages (by the daemon's ordinals, 0..n-1; none
expected where the config sets none),
and the default client priority (the driver's 0 where the config sets none). Limits keyed by
UUID cannot be read back on 535 and are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .control import ConfigureError, Control, mem_limit_as_displayed
from .units import format_size_mps_control

if TYPE_CHECKING:
    from .config import Config


@dataclass(frozen=True)
class Defaults:
    active_thread_percentage: float
    pinned_mem_limit: dict[int, int | None]  # bytes as the daemon prints them back, by device index
    client_priority: int


def expected(config: "Config", devices: set[int]) -> Defaults:
    """What the daemon reads back when it has ``config``'s defaults."""
    limits = config.pinned_mem_limit
    return Defaults(
        config.active_thread_percentage,
        {d: mem_limit_as_displayed(limits[d]) if d in limits else None for d in sorted(watched(config, devices))},
        config.client_priority or 0,
    )


def watched(config: "Config", devices: set[int]) -> set[int]:
    """Device ordinals whose default limit is compared: the config's, and ``devices`` (the
    daemon's ordinals) unless the config keys a limit by UUID, which 535 does not read back
    under an ordinal: an ordinal's limit could then be that one."""
    configured = {d for d in config.pinned_mem_limit if isinstance(d, int)}
    by_uuid = any(isinstance(d, str) for d in config.pinned_mem_limit)
    return configured if by_uuid else configured | set(devices)


def read(control: Control, config: "Config", devices: set[int]) -> Defaults:
    return Defaults(
        control.get_default_active_thread_percentage(),
        {d: control.get_default_device_pinned_mem_limit(d) for d in sorted(watched(config, devices))},
        control.get_default_client_priority(),
    )


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


def restore(control: Control, config: "Config", devices: set[int], got: Defaults | None = None) -> None:
    """Set every watched default to the config's (those that differ from ``got``, when given)
    and read them back; ConfigureError if one does not come back as set."""
    want = expected(config, devices)
    if got is None or not math.isclose(got.active_thread_percentage, want.active_thread_percentage, abs_tol=0.05):
        control.set_default_active_thread_percentage(config.active_thread_percentage)
    for device in sorted(watched(config, devices)):
        if got is not None and got.pinned_mem_limit.get(device) == want.pinned_mem_limit[device]:
            continue
        nbytes = config.pinned_mem_limit.get(device)
        control.set_default_device_pinned_mem_limit(device, "0" if nbytes is None else format_size_mps_control(nbytes))
    if got is None or got.client_priority != want.client_priority:
        control.set_default_client_priority(config.client_priority or 0)
    left = differences(want, read(control, config, devices))
    if left:
        raise ConfigureError(f"defaults restored but the daemon reads back {'; '.join(left)}")
