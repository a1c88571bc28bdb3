"""Kubernetes quantities (``4Gi``, ``500m``, ``1e3``, ``12E``) read and written exactly as the
API server does: a pure port of k8s.io/apimachinery/pkg/api/resource (quantity.go
``parseQuantityString``, ``ParseQuantity`` and ``CanonicalizeBytes``, suffix.go, amount.go;
read at kubernetes/apimachinery eed236c and kubernetes/kubernetes 009f497, staging/)::

    quantity := [+-] number suffix       number := digits | digits "." [digits] | "." digits
    suffix   := "" | n u m k M G T P E   (decimal SI: 10**-9 .. 10**18)
              | Ki Mi Gi Ti Pi Ei        (binary SI: 1024**1 .. 1024**6)
              | (e|E) [+-] digits        (decimal exponent)

What the API server does and this module does too:

- ``E`` alone is exa (10**18), ``Ei`` is 2**60, ``E3`` and ``e3`` are exponents;
- the scanner lets the number be empty: ``+``, ``-``, ``.``, ``Mi`` and ``e5`` are zero (the
  empty string is an error); ``1.`` and ``.5`` are numbers;
- an exponent is read as a 64-bit integer and truncated to 32 bits (Go's ``int32()``), and the
  scale arithmetic wraps at 32 bits as Go's does;
- a value finer than a nano is rounded up, away from zero, to the next nano (``0.1n`` is
  ``1n``: "if you want some resources, you should get some");
- a binary-SI value above 2**63-1 is capped at it (``9Ei``); decimal values are not capped;
- a binary-SI value between 0 and 1 becomes decimal SI;
- the canonical form keeps the suffix kind it was parsed with, no fractional digits, and the
  largest exponent that loses nothing (``1.5`` -> ``1500m``, ``1.5Gi`` -> ``1536Mi``,
  ``1000`` -> ``1k``); a string already in that form is kept as written, sign and leading
  zeros included (``+1`` stays ``+1``: the API server stores it so). A decimal-SI exponent
  beyond ``E`` is written ``e21`` (apimachinery 357557a; older versions dropped it).

mpsd refuses one thing the API server accepts: a quantity longer than MAX_LENGTH characters
(no capacity needs one, and a number of thousands of digits is costly to read).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

DECIMAL_SI, BINARY_SI, DECIMAL_EXPONENT = "DecimalSI", "BinarySI", "DecimalExponent"
DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
MAX_LENGTH = 64
MAX_EXPONENT = 1000  # |power of ten| beyond which a value is refused as a number (no capacity is near it)
MAX_BINARY = (1 << 63) - 1  # apimachinery maxAllowed
NANO = -9
_DECIMAL_SUFFIX = {v: k for k, v in DECIMAL.items()}
_BINARY_SUFFIX = {v // 10: k for k, v in BINARY.items()}
_DIGITS = frozenset("0123456789")
_SUFFIX_CHARS = frozenset("eEinumkKMGTP")
_MAX_INT64_FACTORS = 18  # decimal digits an int64 always holds (math.go maxInt64Factors)
_FORM = "expected a number with an optional suffix such as 4Gi, 500m, 25 or 1e3"


def _int32(value: int) -> int:
    """Go's int32() of an integer: the low 32 bits, signed."""
    return (value + (1 << 31)) % (1 << 32) - (1 << 31)


def _parse_int64(text: str) -> int | None:
    """strconv.ParseInt(text, 10, 64): optional sign, ASCII digits, in range; None otherwise."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not digits or not set(digits) <= _DIGITS:
        return None
    value = int(text)
    return value if -(1 << 63) <= value < (1 << 63) else None


@dataclass(frozen=True)
class Quantity:
    """``mantissa * 10**exponent``, the suffix kind it was written with, and the string the API
    server keeps for it when it was already canonical."""

    mantissa: int
    exponent: int
    format: str
    kept: str | None = None

    @property
    def value(self) -> Fraction:
        """The exact number; ValueError beyond 10**MAX_EXPONENT (or finer than its inverse)."""
        if self.mantissa == 0:
            return Fraction(0)
        if abs(self.exponent) > MAX_EXPONENT:
            raise ValueError(f"quantity {self}: beyond 10**{MAX_EXPONENT}")
        return self.mantissa * Fraction(10) ** self.exponent

    def __str__(self) -> str:
        return self.kept if self.kept is not None else canonical(self)


def _strip(mantissa: int, factor: int) -> tuple[int, int]:
    """``mantissa`` without its factors of ``factor``, and how many there were."""
    times = 0
    while mantissa and mantissa % factor == 0:
        mantissa //= factor
        times += 1
    return mantissa, times


def canonical(q: Quantity) -> str:
    """CanonicalizeBytes: the form the API server writes."""
    if q.mantissa == 0:
        return "0"
    fmt = q.format
    if fmt == BINARY_SI:  # parse leaves a binary value's exponent in -9..0: the Fraction is small
        value = q.mantissa * Fraction(10) ** q.exponent
        if -1024 < value < 1024 or value.denominator != 1:
            fmt = DECIMAL_SI  # small, or not a whole number: written in decimal, exactly
        else:
            number, times = _strip(int(value), 1024)
            return f"{number}{_BINARY_SUFFIX.get(times, '')}"
    number, times = _strip(q.mantissa, 10)
    exponent = q.exponent + times
    while exponent % 3:
        number *= 10
        exponent -= 1
    if fmt == DECIMAL_SI and exponent in _DECIMAL_SUFFIX:
        suffix = _DECIMAL_SUFFIX[exponent]
    else:
        suffix = f"e{exponent}" if exponent else ""
    return f"{number}{suffix}"


def _scan(text: str) -> tuple[bool, str, str, str, str]:
    """parseQuantityString: (positive, value, num, denom, suffix), ValueError for a bad form.
    ``num`` has its leading zeros stripped ("0" when none is left); ``value`` is the number as
    written, sign included."""
    positive, pos, end = True, 0, len(text)
    if end and text[0] in "+-":
        positive = text[0] == "+"
        pos = 1
    while True:  # leading zeros
        if pos >= end:
            return positive, "0", "0", "", ""
        if text[pos] != "0":
            break
        pos += 1
    start = pos
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos >= end:
        return positive, text, text[start:], "", ""
    num = text[start:pos] or "0"
    denom = ""
    if text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos] in _DIGITS:
            pos += 1
        denom = text[start:pos]
        if pos >= end:
            return positive, text, num, denom, ""
    value, suffix_start = text[:pos], pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos < end:
        raise ValueError(f"bad quantity {text!r}: {_FORM}")
    return positive, value, num, denom, text[suffix_start:]


def _interpret(suffix: str, text: str) -> tuple[int, int, str]:
    """(base, exponent, format) of a suffix (suffix.go)."""
    if suffix in DECIMAL:
        return 10, DECIMAL[suffix], DECIMAL_SI
    if suffix in BINARY:
        return 2, BINARY[suffix], BINARY_SI
    if len(suffix) > 1 and suffix[0] in "eE":
        parsed = _parse_int64(suffix[1:])
        if parsed is not None:
            return 10, _int32(parsed), DECIMAL_EXPONENT
    accepted = "n, u, m, k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei or e/E and an exponent"
    raise ValueError(f"bad quantity {text!r}: unknown suffix {suffix!r}; accepted: {accepted}")


def parse(text: str) -> Quantity:
    """ParseQuantity: the quantity ``text`` names, or ValueError with one line."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"bad quantity {text!r}: {_FORM}")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"bad quantity {text[:20]!r}... ({len(text)} characters): at most {MAX_LENGTH}")
    if text == "0":
        return Quantity(0, 0, DECIMAL_SI, "0")
    positive, value, num, denom, suffix = _scan(text)
    base, exponent, fmt = _interpret(suffix, text)
    fast = _fast(text, positive, num, denom, base, exponent, fmt)
    if fast is not None:
        return fast
    # inf.Dec's SetString of the number as written, then the suffix applied exactly
    digits = value.lstrip("+-").replace(".", "", 1)
    if not digits:
        raise ValueError(f"bad quantity {text!r}: no digits")
    mantissa = int(digits)
    scale = len(denom) if "." in value else 0  # inf.Dec's scale: digits after the point
    if base == 10:
        scale = _int32(scale + _int32(-exponent))
    else:
        mantissa <<= exponent
    if mantissa and scale > -NANO:  # finer than a nano: up to the next nano, away from zero
        excess = scale + NANO
        mantissa = 1 if excess > len(str(mantissa)) else -(-mantissa // 10**excess)
        scale = -NANO
    if fmt == BINARY_SI:  # here 0 <= scale <= 9 (digits after the point, then nanos at most)
        if mantissa > MAX_BINARY * 10**scale:
            mantissa, scale = MAX_BINARY, 0
        elif 0 < mantissa < 10**scale:
            fmt = DECIMAL_SI  # between 0 and 1: no binary suffix for it
    return Quantity(mantissa if positive else -mantissa, -scale, fmt)


def _fast(text: str, positive: bool, num: str, denom: str, base: int, exponent: int, fmt: str) -> Quantity | None:
    """ParseQuantity's int64 path: its result, keeping ``text`` when it is canonical already;
    None where the API server takes the exact (inf.Dec) path."""
    multiplier = 1
    if base == 10:
        scale = exponent
        precision = _MAX_INT64_FACTORS - (len(num) + len(denom))
    elif not denom:
        scale = 0
        multiplier = 1 << exponent
        precision = 15 - len(num) - exponent * 3 // 10 - 1  # 1Mi has ~6 digits of precision
    else:
        return None
    if precision < 0:
        return None
    scale = _int32(scale - len(denom))
    if scale < NANO:
        return None
    shifted = num + denom
    number = int(shifted)
    result = number * multiplier
    if result >= 1 << 63:
        return None
    if fmt == BINARY_SI:
        keep = exponent % 10 == 0 and number & 0x07 != 0
    else:
        keep = scale % 3 == 0 and not shifted.endswith("000") and shifted[0] != "0"
    return Quantity(result if positive else -result, scale, fmt, text if keep else None)


def parse_quantity(text: object) -> Fraction:
    """The exact number a quantity string names (``4Gi``, ``25``, ``500m``, ``1e3``, ``1E``);
    ValueError with one line otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"bad quantity {text!r}: expected a string such as 4Gi or 25")
    return parse(text).value
