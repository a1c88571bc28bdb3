"""Kubernetes quantities as the API server reads and writes them (mpsd/dra/quantity.py).

The tables are the Kubernetes source's own, from k8s.io/apimachinery/pkg/api/resource/quantity_test.go
(kubernetes/apimachinery eed236c): TestQuantityParse (values and formats, the invalid list),
TestQuantityString (canonical strings and the alternates that parse to them), TestQuantityParseEmit
and TestParseQuantity (canonical forms around 2**63). The properties check every generated
quantity against an independent computation with Fractions, and the canonical form against its
definition (no fractional digits, the largest exponent, a round trip that keeps the value)."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsd.dra.claims import parse_quantity
from mpsd.dra.quantity import BINARY_SI, DECIMAL_EXPONENT, DECIMAL_SI, MAX_BINARY, canonical, parse

D, B, X = DECIMAL_SI, BINARY_SI, DECIMAL_EXPONENT
KI = 1024

# TestQuantityParse: input -> decQuantity(mantissa, exponent, format)
PARSE = [
    ("0", 0, 0, D), ("0n", 0, 0, D), ("0u", 0, 0, D), ("0m", 0, 0, D), ("0Ki", 0, 0, B), ("0k", 0, 0, D),
    ("0Mi", 0, 0, B), ("0M", 0, 0, D), ("0Gi", 0, 0, B), ("0G", 0, 0, D), ("0Ti", 0, 0, B), ("0T", 0, 0, D),
    ("1", 1, 0, D),
    ("1Ki", KI, 0, B), ("8Ki", 8 * KI, 0, B), ("7Mi", 7 * KI**2, 0, B), ("6Gi", 6 * KI**3, 0, B),
    ("5Ti", 5 * KI**4, 0, B), ("4Pi", 4 * KI**5, 0, B), ("3Ei", 3 * KI**6, 0, B),
    ("10Ti", 10 * KI**4, 0, B), ("100Ti", 100 * KI**4, 0, B),
    ("5n", 5, -9, D), ("4u", 4, -6, D), ("3m", 3, -3, D), ("9", 9, 0, D), ("8k", 8, 3, D), ("50k", 5, 4, D),
    ("7M", 7, 6, D), ("6G", 6, 9, D), ("5T", 5, 12, D), ("40T", 4, 13, D), ("300T", 3, 14, D), ("2P", 2, 15, D),
    ("1E", 1, 18, D),
    ("1E-3", 1, -3, X), ("1e3", 1, 3, X), ("1E6", 1, 6, X), ("1e9", 1, 9, X), ("1E12", 1, 12, X),
    ("1e15", 1, 15, X), ("1E18", 1, 18, X),
    ("1e14", 1, 14, X), ("1e13", 1, 13, X), ("100.035k", 100035, 0, D),
    ("0.001", 1, -3, D), ("0.0005k", 5, -1, D), ("0.005", 5, -3, D), ("0.05", 5, -2, D), ("0.5", 5, -1, D),
    ("0.00050k", 5, -1, D), ("0.00500", 5, -3, D), ("0.05000", 5, -2, D), ("0.50000", 5, -1, D),
    ("0.5e0", 5, -1, X), ("0.5e-1", 5, -2, X), ("0.5e-2", 5, -3, X), ("10.035M", 10035, 3, D),
    ("1.2e3", 12, 2, X), ("1.3E+6", 13, 5, X), ("1.40e9", 14, 8, X), ("1.53E12", 153, 10, X),
    ("1.6e15", 16, 14, X), ("1.7E18", 17, 17, X),
    ("9.01", 901, -2, D), ("8.1k", 81, 2, D), ("7.123456M", 7123456, 0, D), ("6.987654321G", 6987654321, 0, D),
    ("5.444T", 5444, 9, D), ("40.1T", 401, 11, D), ("300.2T", 3002, 11, D), ("2.5P", 25, 14, D),
    ("1.01E", 101, 16, D),
    ("3.001n", 4, -9, D), ("1.1E-9", 2, -9, X), ("0.0000000001", 1, -9, D), ("0.0000000005", 1, -9, D),
    ("0.00000000050", 1, -9, D), ("0.5e-9", 1, -9, X), ("0.9n", 1, -9, D), ("0.00000012345", 124, -9, D),
    ("0.00000012354", 124, -9, D), ("9Ei", MAX_BINARY, 0, B), ("9223372036854775807Ki", MAX_BINARY, 0, B),
    ("12E", 12, 18, D),
    ("100.035Ki", 10243584, -2, B), ("0.5Mi", KI**2 // 2, 0, B), ("0.05Gi", 536870912, -1, B),
    ("0.025Ti", 274877906944, -1, B),
    ("0.000000000001Ki", 2, -9, D), (".001", 1, -3, D), (".0001k", 100, -3, D), ("1.", 1, 0, D),
    ("1.G", 1, 9, D),
]
INVALID = ["", "1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01i", "-3.01e-", " 1", "1 "]

# TestQuantityString (canonical, alternate), TestQuantityParseEmit (in, canonical) and
# TestParseQuantity (input, canonical; the input itself where the test gives none)
CANONICAL = [
    ("1024Mi", "1Gi"), ("307200Ki", "300Mi"), ("1025024Mi", "1001Gi"), ("1024Gi", "1Ti"), ("5000m", "5"),
    ("0.5", "500m"), ("1000M", "1G"), ("0.001T", "1G"), ("1000u", "1m"), ("1.08", "1080m"),
    ("1080000000n", "1080m"), (".001e12", "1e9"), ("0.001e0", "1e-3"), ("1000e-12", "1e-9"), ("00", "0"),
    ("1Ki", "1Ki"), ("1Mi", "1Mi"), ("1Gi", "1Gi"), (".001Ki", "1024m"), (".000001Ki", "1024u"),
    (".000000001Ki", "1024n"), (".000000000001Ki", "2n"),
    ("1Gi", "1Gi"), ("300Mi", "300Mi"), ("6Ki", "6Ki"), ("1001Gi", "1001Gi"), ("1Ti", "1Ti"), ("5", "5"),
    ("500m", "500m"), ("1G", "1G"), ("1m", "1m"), ("80m", "80m"), ("1080m", "1080m"), ("300M", "300M"),
    ("1T", "1T"), ("1234567M", "1234567M"), ("1234567m", "1234567m"), ("3k", "3k"), ("1025", "1025"),
    ("0", "0"), ("1e9", "1e9"), ("1e-3", "1e-3"), ("1e-9", "1e-9"), ("80e-3", "80e-3"), ("300e6", "300e6"),
    ("1e12", "1e12"), ("1e3", "1e3"), ("3e3", "3e3"), ("1n", "1n"), ("80n", "80n"), ("1080n", "1080n"),
    ("1u", "1u"), ("80u", "80u"), ("1080u", "1080u"),
    ("999999999999999999", "999999999999999999"), ("999999999999999999.0", "999999999999999999"),
    ("999999999999999999.1", "999999999999999999100m"), ("9999999999999999999", "9999999999999999999"),
    ("1E", "1E"), ("1000000000000000000", "1E"), ("1.0E", "1E"), ("9999999999999999999000m", "9999999999999999999"),
    ("1.0000000000000000001E", "1000000000000000000100m"), ("1.000000000000000001E", "1000000000000000001"),
    ("10E", "10E"), ("10000000000000000000", "10E"), ("10.0E", "10E"), ("10000000000000000000000m", "10E"),
    ("10.0000000000000000001E", "10000000000000000000100m"), ("10.000000000000000001E", "10000000000000000001"),
    ("9223372036854775806", "9223372036854775806"), ("9223372036854775806.1", "9223372036854775806100m"),
    ("9223372036854775807000m", "9223372036854775807"), ("9223372036854775808.1", "9223372036854775808100m"),
]


def value(mantissa: int, exponent: int) -> Fraction:
    return mantissa * Fraction(10) ** exponent


@pytest.mark.parametrize("text, mantissa, exponent, fmt", PARSE)
def test_the_kubernetes_parse_table(text: str, mantissa: int, exponent: int, fmt: str) -> None:
    # and, as the Go test does, the same with a "-" (the value negated) and a "+" in front
    for sign, factor in (("", 1), ("-", -1), ("+", 1)):
        q = parse(sign + text)
        assert (q.value, q.format) == (factor * value(mantissa, exponent), fmt), sign + text
        assert parse_quantity(sign + text) == factor * value(mantissa, exponent)  # what claims read


@pytest.mark.parametrize("text", INVALID + ["4GB", "4gi", "1e", "--1", "1e99999999999999999999", "1Ee3", "4Gi\n"])
def test_what_the_api_server_refuses_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError, match="^bad quantity [^\n]*$"):
        parse(text)


@pytest.mark.parametrize("text, expected", CANONICAL)
def test_the_kubernetes_canonical_forms(text: str, expected: str) -> None:
    assert str(parse(text)) == expected
    assert str(parse("-" + text)) == ("0" if expected == "0" else "-" + expected)


@pytest.mark.parametrize("text, expected", [
    # the scanner's leniency, as the API server has it: an empty number is zero
    ("+", 0), ("-", 0), (".", 0), ("-.", 0), ("Mi", 0), ("e5", 0), ("k", 0),
    # an exponent is a 64-bit integer cut to 32 bits: 2**32 is 0, so 1e4294967296 is 1
    ("1e4294967296", 1), ("1e4294967299", 1000),
    ("1000E", 10**21),  # beyond E (apimachinery 357557a writes it 1e21)
])
def test_the_api_servers_quirks_are_kept(text: str, expected: int) -> None:
    assert parse(text).value == expected


def test_a_string_already_canonical_is_kept_as_written() -> None:
    # ParseQuantity keeps the string when its int64 path finds it canonical: sign and zeros too
    assert [str(parse(t)) for t in ("+1", "01", "+1Ki", "1E3", "1000E", "1024Ki")] == [
        "+1", "01", "+1Ki", "1E3", "1e21", "1Mi"]


def test_beyond_any_capacity_is_a_one_line_error_not_a_hang() -> None:
    q = parse("1e2000000000")  # the API server accepts it; its value has two billion digits
    assert str(q) == "100e1999999998"
    with pytest.raises(ValueError, match="beyond 10\\*\\*1000"):
        parse_quantity("1e2000000000")
    assert parse("1e-2000000000").value == Fraction(1, 10**9)  # rounded up to a nano


def test_a_longer_quantity_than_any_capacity_needs_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 64"):
        parse("1" * 65)
    with pytest.raises(ValueError, match="expected a string"):
        parse_quantity(4)


# --- properties -------------------------------------------------------------------------------

DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


@st.composite
def quantities(draw: st.DrawFn) -> tuple[str, Fraction, str]:
    """(text, its value as the API server computes it, format) from parts drawn separately."""
    whole = draw(st.text("0123456789", max_size=12))
    point = draw(st.booleans())
    frac = draw(st.text("0123456789", max_size=12)) if point else ""
    if not whole and not frac:
        whole = draw(st.text("123456789", min_size=1, max_size=1))
    number = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    kind = draw(st.sampled_from(["decimal", "binary", "exponent"]))
    if kind == "decimal":
        suffix = draw(st.sampled_from(sorted(DECIMAL_SUFFIXES)))
        scaled, fmt = number * Fraction(10) ** DECIMAL_SUFFIXES[suffix], DECIMAL_SI
    elif kind == "binary":
        suffix = draw(st.sampled_from(sorted(BINARY_SUFFIXES)))
        scaled, fmt = number * 2 ** BINARY_SUFFIXES[suffix], BINARY_SI
    else:
        power = draw(st.integers(-30, 30))
        sign = "+" if power >= 0 and draw(st.booleans()) else ""
        suffix = draw(st.sampled_from("eE")) + sign + str(power)
        scaled, fmt = number * Fraction(10) ** power, DECIMAL_EXPONENT
    nanos = -(-scaled * 10**9 // 1)  # finer than a nano: up to the next nano
    scaled = Fraction(nanos, 10**9)
    if fmt == BINARY_SI and scaled > MAX_BINARY:
        scaled = Fraction(MAX_BINARY)
    if fmt == BINARY_SI and 0 < scaled < 1:
        fmt = DECIMAL_SI
    text = whole + ("." if point else "") + frac + suffix
    return text, scaled, fmt


@given(quantities(), st.sampled_from(["", "+", "-"]))
def test_every_quantity_has_the_value_the_api_server_gives_it(q: tuple[str, Fraction, str], sign: str) -> None:
    text, expected, fmt = q
    got = parse(sign + text)
    assert got.value == (-expected if sign == "-" else expected)
    assert got.format == fmt or got.value == 0


_CANONICAL = re.compile(r"-?[1-9][0-9]*(?:[numkMGTPE]|Ki|Mi|Gi|Ti|Pi|Ei|e-?[0-9]+)?|0")


@given(quantities(), st.sampled_from(["", "-"]))
def test_the_canonical_form_keeps_the_value_and_is_canonical(q: tuple[str, Fraction, str], sign: str) -> None:
    parsed = parse(sign + q[0])
    text = canonical(parsed)
    assert _CANONICAL.fullmatch(text), text  # no fraction, no sign but "-", no leading zero
    again = parse(text)
    assert again.value == parsed.value and canonical(again) == text
    decimal = re.fullmatch(r"-?([0-9]+)(?:[numkMGTP]|e-?[0-9]+)?", text)
    if parsed.value and parsed.format != BINARY_SI and decimal:
        assert int(decimal.group(1)) % 1000, text  # the largest exponent: no factor of 1000 left
