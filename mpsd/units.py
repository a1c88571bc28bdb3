"""Pure functions for sizes and MPS limit strings.

Grammar shared with the C parser in csrc/limits.c (tests compare the two):

    size   := DIGITS [UNIT]          UNIT := (K|M|G|T) [B], case-insensitive, powers of 1024
    key    := DIGITS | UUID          UUID := GPU-... or MIG-... ([A-Za-z0-9-/_])
    limits := key "=" size ("," key "=" size)*

No whitespace inside, no duplicate keys, no value above 2**64 - 1, ordinals below 64 (ASCII
digits only), at most 64 entries, UUIDs of at most 95 characters.
An empty string means "no limits".
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_BYTES = (1 << 64) - 1
MAX_ORDINAL = 63
MAX_ENTRIES = 64  # the C parser's table size (csrc/limits.h MS_MAX_DEVICES)
MAX_UUID_LEN = 95  # csrc/limits.h MS_UUID_MAX less the NUL
_SIZE = re.compile(r"([0-9]+)(?:([KMGTkmgt])[Bb]?)?")
_UUID = re.compile(r"(?:GPU|MIG)-[A-Za-z0-9/_-]+")
SIZE_FORM = "a byte count with an optional K, M, G or T suffix (e.g. 512M, 4G)"
LIMITS_FORM = "DEVICE=SIZE[,DEVICE=SIZE...] with DEVICE an ordinal or GPU UUID (e.g. 0=4G,1=512M)"


def parse_size(text: str) -> int:
    """Bytes in ``text`` ("4G", "512M", "1024"); ConfigError names the text otherwise."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ConfigError(f"bad size {text!r}: expected {SIZE_FORM}")
    value = int(m.group(1)) * UNITS[(m.group(2) or "").upper()]
    if value > MAX_BYTES:
        raise ConfigError(f"bad size {text!r}: larger than 2**64-1 bytes")
    return value


def format_size(nbytes: int) -> str:
    """The shortest exact spelling: 4G, 1044M, 1536K, 100."""
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes}")
    for suffix in ("T", "G", "M", "K"):
        unit = UNITS[suffix]
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def format_size_mps_control(nbytes: int) -> str:
    """The value for ``set_default_device_pinned_mem_limit``, which takes only M or G.

    Rounded down to whole MiB (the daemon cannot express less); at least 1M."""
    mib = max(nbytes >> 20, 1)
    return f"{mib // 1024}G" if mib % 1024 == 0 else f"{mib}M"


def is_decimal(text: object) -> bool:
    """ASCII digits only: str.isdigit() also takes "²" (int() fails) and "٣" (int() says 3)."""
    return isinstance(text, str) and text.isascii() and text.isdigit()


def parse_device_key(text: str) -> int | str:
    if is_decimal(text):
        ordinal = int(text)
        if ordinal > MAX_ORDINAL:
            raise ConfigError(f"bad device {text!r}: ordinals run from 0 to {MAX_ORDINAL}")
        return ordinal
    if _UUID.fullmatch(text):
        if len(text) > MAX_UUID_LEN:
            raise ConfigError(f"bad device {text[:40]!r}...: a UUID has at most {MAX_UUID_LEN} characters")
        return text
    raise ConfigError(f"bad device {text!r}: expected an ordinal (0, 1, ...) or a GPU UUID (GPU-...)")


def parse_limits(text: str) -> dict[int | str, int]:
    """``"0=4G,GPU-ab=512M"`` -> ``{0: 4 << 30, "GPU-ab": 512 << 20}``."""
    if text == "":
        return {}
    limits: dict[int | str, int] = {}
    entries = text.split(",")
    if len(entries) > MAX_ENTRIES:
        raise ConfigError(f"bad limits {text[:60]!r}...: at most {MAX_ENTRIES} devices")
    for entry in entries:
        key, sep, size = entry.partition("=")
        if not sep:
            raise ConfigError(f"bad limit {entry!r} in {text!r}: expected {LIMITS_FORM}")
        device = parse_device_key(key)
        if device in limits:
            raise ConfigError(f"bad limits {text!r}: device {key} given twice")
        try:
            limits[device] = parse_size(size)
        except ConfigError as exc:
            raise ConfigError(f"bad limits {text!r}: {exc}") from None
    return limits


def format_limits(limits: dict[int | str, int]) -> str:
    """Inverse of parse_limits, ordinals first in order, then UUIDs."""
    keys = sorted((k for k in limits if isinstance(k, int))) + sorted(k for k in limits if isinstance(k, str))
    return ",".join(f"{k}={format_size(limits[k])}" for k in keys)


def parse_percentage(text: str | float | int) -> float:
    """An active thread percentage in (0, 100]."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"bad active thread percentage {text!r}: expected a number in (0, 100]") from None
    if not 0.0 < value <= 100.0:
        raise ConfigError(f"bad active thread percentage {text!r}: expected a number in (0, 100]")
    return value


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m)?")


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``"500ms"``, ``"2s"``, ``"1m"`` or a bare number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not 0 <= text < math.inf:  # YAML's .nan and .inf too: timers could not be set from them
            raise ConfigError(f"bad duration {text!r}: expected a non-negative number of seconds or 500ms, 2s, 1m")
        return float(text)
    m = _DURATION.fullmatch(str(text))
    if m is None:
        raise ConfigError(f"bad duration {text!r}: expected a non-negative number of seconds or 500ms, 2s, 1m")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale
