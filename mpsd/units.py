"""Pure functions for sizes and MPS limit strings.

Grammar shared with the C parser in csrc/limits.c (tests compare the two):

    size   := DIGITS [UNIT]          UNIT := (K|M|G|T) [B], case-insensitive, powers of 1024
    key    := DIGITS | UUID          UUID := GPU-... or MIG-... ([A-Za-z0-9-/_])
    limits := key "=" size ("," key "=" size)*

No whitespace inside, no duplicate keys, no value above 2**64 - 1, ordinals below 64 (ASCII
digits only), at most 64 entries, UUIDs of at most 95 characters. Leading zeros are allowed in
any number (the C parser saturates); digits are counted without them, never handed to int() in
thousands (Python refuses more than 4300 digits with a ValueError).
An empty string means "no limits".
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .errors import ConfigError

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_BYTES = (1 << 64) - 1
MAX_ORDINAL = 63
MAX_ENTRIES = 64  # the C parser's table size (csrc/limits.h MS_MAX_DEVICES)
MAX_UUID_LEN = 95  # csrc/limits.h MS_UUID_MAX less the NUL
MAX_DIGITS = 20  # 2**64 - 1 has 20 digits
SHOWN = 60  # characters of a bad value quoted in an error
_SIZE = re.compile(r"([0-9]+)(?:([KMGTkmgt])[Bb]?)?")
_UUID = re.compile(r"(?:GPU|MIG)-[A-Za-z0-9/_-]+")
# limits keyed by ordinal, by UUID or both (a Mapping is invariant in its key type)
Limits = Mapping[int, int] | Mapping[str, int] | Mapping[int | str, int]
SIZE_FORM = "a byte count with an optional K, M, G or T suffix (e.g. 512M, 4G)"
LIMITS_FORM = "DEVICE=SIZE[,DEVICE=SIZE...] with DEVICE an ordinal or GPU UUID (e.g. 0=4G,1=512M)"


def shown(text: str) -> str:
    """``text`` quoted for an error message, cut to its first SHOWN characters."""
    return repr(text) if len(text) <= SHOWN else f"{text[:SHOWN]!r}... ({len(text)} characters)"


def _significant(digits: str) -> str:
    return digits.lstrip("0") or "0"


def parse_size(text: str) -> int:
    """Bytes in ``text`` ("4G", "512M", "1024"); ConfigError names the text otherwise."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ConfigError(f"bad size {shown(text)}: expected {SIZE_FORM}")
    digits = _significant(m.group(1))
    if len(digits) > MAX_DIGITS:
        raise ConfigError(f"bad size {shown(text)}: larger than 2**64-1 bytes")
    value = int(digits) * UNITS[(m.group(2) or "").upper()]
    if value > MAX_BYTES:
        raise ConfigError(f"bad size {shown(text)}: larger than 2**64-1 bytes")
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


def _all_digits(text: object) -> bool:
    return isinstance(text, str) and text.isascii() and text.isdigit()


def is_decimal(text: object) -> bool:
    """ASCII digits only, at most MAX_DIGITS of them, so that int() of it is exact and cheap:
    str.isdigit() also takes "²" (int() fails) and "٣" (int() says 3), and int() of more than
    4300 digits raises ValueError."""
    return _all_digits(text) and len(text) <= MAX_DIGITS  # type: ignore[arg-type]


def parse_device_key(text: str) -> int | str:
    if _all_digits(text):
        digits = _significant(text)
        if len(digits) > len(str(MAX_ORDINAL)) or int(digits) > MAX_ORDINAL:
            raise ConfigError(f"bad device {shown(text)}: ordinals run from 0 to {MAX_ORDINAL}")
        return int(digits)
    if _UUID.fullmatch(text):
        if len(text) > MAX_UUID_LEN:
            raise ConfigError(f"bad device {text[:40]!r}...: a UUID has at most {MAX_UUID_LEN} characters")
        return text
    raise ConfigError(f"bad device {shown(text)}: expected an ordinal (0, 1, ...) or a GPU UUID (GPU-...)")


def parse_limits(text: str) -> dict[int | str, int]:
    """``"0=4G,GPU-ab=512M"`` -> ``{0: 4 << 30, "GPU-ab": 512 << 20}``."""
    if text == "":
        return {}
    limits: dict[int | str, int] = {}
    entries = text.split(",")
    if len(entries) > MAX_ENTRIES:
        raise ConfigError(f"bad limits {shown(text)}: at most {MAX_ENTRIES} devices")
    for entry in entries:
        key, sep, size = entry.partition("=")
        if not sep:
            raise ConfigError(f"bad limit {shown(entry)} in {shown(text)}: expected {LIMITS_FORM}")
        device = parse_device_key(key)
        if device in limits:
            raise ConfigError(f"bad limits {shown(text)}: device {shown(key)} given twice")
        try:
            limits[device] = parse_size(size)
        except ConfigError as exc:
            raise ConfigError(f"bad limits {shown(text)}: {exc}") from None
    return limits


def format_limits(limits: Limits) -> str:
    """Inverse of parse_limits, ordinals first in order, then UUIDs."""
    pairs: list[tuple[int | str, int]] = list(limits.items())
    ordinals = sorted((k, v) for k, v in pairs if isinstance(k, int))
    uuids = sorted((k, v) for k, v in pairs if isinstance(k, str))
    return ",".join(f"{k}={format_size(v)}" for k, v in ordinals + uuids)


def parse_percentage(text: str | float | int) -> float:
    """An active thread percentage in (0, 100]."""
    bad = f"bad active thread percentage {shown(text) if isinstance(text, str) else _number(text)}"
    try:
        value = float(text)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond 1e308
        raise ConfigError(f"{bad}: expected a number in (0, 100]") from None
    if not 0.0 < value <= 100.0:
        raise ConfigError(f"{bad}: expected a number in (0, 100]")
    return value


def _number(value: object) -> str:
    """repr() of a number, which for an int of more than 4300 digits raises ValueError."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    return repr(value)


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m)?")


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``"500ms"``, ``"2s"``, ``"1m"`` or a bare number of seconds."""
    accepted = "expected a non-negative number of seconds or 500ms, 2s, 1m"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        # YAML's .nan and .inf too: timers could not be set from them; float() of a huge int overflows
        if not 0 <= text < 1e300:
            raise ConfigError(f"bad duration {_number(text)}: {accepted}")
        return float(text)
    m = _DURATION.fullmatch(str(text))
    if m is None:
        raise ConfigError(f"bad duration {shown(str(text))}: {accepted}")
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale


# The strings these parsers take, as JSON schema patterns (the Helm chart's schema, mpsd/config/schema.py;
# RE2 and ECMA-262 alike), each a part of what its parser accepts and never more.
DEVICE_PATTERN = f"(?:[0-9]+|{_UUID.pattern})"  # an ordinal or a UUID, as CUDA_VISIBLE_DEVICES names them
SIZE_PATTERN = "0*([1-9][0-9]{0,6}[KMGTkmgt][Bb]?|[1-9][0-9]{0,18})"  # above 0, below 2**64: 7 digits with a unit
PERCENTAGE_PATTERN = r"(100(\.0+)?|0*[1-9][0-9]?(\.[0-9]+)?|0*\.[0-9]*[1-9][0-9]*)"  # (0, 100] as float() reads it
_LIMIT = rf"(0*[1-5]?[0-9]|0*6[0-3]|(GPU|MIG)-[A-Za-z0-9/_-]{{1,{MAX_UUID_LEN - 4}}})=(0+|{SIZE_PATTERN})"
LIMITS_PATTERN = rf"{_LIMIT}(,{_LIMIT})*"  # but a device named twice, or more than MAX_ENTRIES (RE2's bounds)


def duration_pattern(positive: bool) -> str:
    """parse_duration's strings up to 99999s, 9999m or 99999999ms (a day and more); above 0 if positive."""

    def number(digits: int) -> str:
        above_zero = rf"[1-9][0-9]{{0,{digits - 1}}}(\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*"
        return f"0*({above_zero})" if positive else rf"0*({above_zero}|0(\.0+)?)"

    return f"^({number(5)}s?|{number(4)}m|{number(8)}ms)$"
