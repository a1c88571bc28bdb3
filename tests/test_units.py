import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsd.errors import ConfigError
from mpsd.units import (
    format_limits,
    format_size,
    format_size_mps_control,
    is_decimal,
    parse_duration,
    parse_limits,
    parse_percentage,
    parse_size,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("1024", 1024),
        ("1K", 1 << 10),
        ("512M", 512 << 20),
        ("512MB", 512 << 20),
        ("4G", 4 << 30),
        ("4g", 4 << 30),
        ("2T", 2 << 40),
        ("16777215T", 16777215 << 40),
        ("18446744073709551615", (1 << 64) - 1),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "G", "4 G", " 4G", "4G ", "4GiB", "4X", "-1", "1.5G", "4GB2", "16777216T", "18446744073709551616", "0x10"],
)
def test_parse_size_rejects_with_the_text_named(text):
    with pytest.raises(ConfigError, match="bad size") as exc:
        parse_size(text)
    assert repr(text) in str(exc.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", {}),
        ("0=4G", {0: 4 << 30}),
        ("0=4G,1=512M", {0: 4 << 30, 1: 512 << 20}),
        ("GPU-0a1b-2c=1G,3=1", {"GPU-0a1b-2c": 1 << 30, 3: 1}),
        ("MIG-GPU-aa/1/0=2G", {"MIG-GPU-aa/1/0": 2 << 30}),
    ],
)
def test_parse_limits_accepts(text, expected):
    assert parse_limits(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("0", "bad limit"),
        ("0=4G,", "bad limit"),
        ("0=4G,0=1G", "given twice"),
        ("64=1G", "ordinals run from 0 to 63"),
        ("gpu0=1G", "bad device"),
        ("0=4Q", "bad size"),
        ("0=4G;1=2G", "bad size"),
        (" 0=4G", "bad device"),
        ("\u0663=1G", "bad device"),
        ("\u00b2=1G", "bad device"),
        ("GPU-" + "a" * 92 + "=1G", "at most 95 characters"),
        (",".join(f"{i}=1G" for i in range(64)) + ",GPU-a=1G", "at most 64 devices"),
    ],
)
def test_parse_limits_rejects(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_limits(text)


@pytest.mark.parametrize(
    "nbytes, text",
    [(0, "0"), (100, "100"), (1536 << 10, "1536K"), (1044 << 20, "1044M"), (4 << 30, "4G"), (3 << 40, "3T")],
)
def test_format_size(nbytes, text):
    assert format_size(nbytes) == text


@pytest.mark.parametrize(
    "nbytes, text",
    [(4 << 30, "4G"), (1044 << 20, "1044M"), ((1 << 20) + 5, "1M"), (10, "1M"), (2 << 40, "2048G")],
)
def test_format_size_for_the_control_daemon(nbytes, text):
    assert format_size_mps_control(nbytes) == text


@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_size_round_trips(n):
    assert parse_size(format_size(n)) == n


keys = st.one_of(st.integers(0, 63), st.from_regex(r"GPU-[a-f0-9-]{1,20}", fullmatch=True))


@given(st.dictionaries(keys, st.integers(0, (1 << 64) - 1), max_size=8))
def test_limits_round_trip(limits):
    assert parse_limits(format_limits(limits)) == limits


@pytest.mark.parametrize(
    "text, ok",
    [
        ("0", True),
        ("0123", True),
        ("", False),
        ("\u00b2", False),
        ("\u0663", False),
        ("-1", False),
        ("1.0", False),
        (7, False),
    ],
)
def test_is_decimal_takes_ascii_digits_only(text, ok):
    assert is_decimal(text) is ok


def test_percentage_bounds():
    assert parse_percentage("25") == 25.0
    assert parse_percentage(100) == 100.0
    for bad in ("0", "100.5", "-3", "abc", None):
        with pytest.raises(ConfigError, match="expected a number in"):
            parse_percentage(bad)


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("2s", 2.0), ("1m", 60.0), ("3", 3.0), (1.5, 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5h", "-1s", "fast", -2, float("nan"), float("inf"), "nan", "inf"])
def test_bad_durations(text):
    with pytest.raises(ConfigError, match="bad duration"):
        parse_duration(text)


# --- integers of thousands of digits: Python's int() refuses them (ValueError) past 4300 digits

HUGE = "9" * 5000


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: parse_size(HUGE), r"larger than 2\*\*64-1 bytes"),
        (lambda: parse_size(HUGE + "G"), r"larger than 2\*\*64-1 bytes"),
        (lambda: parse_limits(f"0={HUGE}"), r"larger than 2\*\*64-1 bytes"),
        (lambda: parse_limits(f"{HUGE}=4G"), "ordinals run from 0 to 63"),
    ],
)
def test_integers_of_thousands_of_digits_are_a_one_line_config_error(call, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        call()
    assert "\n" not in str(info.value) and len(str(info.value)) < 300  # the text is shown shortened


def test_leading_zeros_are_free_as_in_the_c_parser():
    assert parse_size("0" * 5000 + "4G") == 4 << 30
    assert parse_limits("0" * 5000 + "3=1G") == {3: 1 << 30}


def test_is_decimal_bounds_the_digits_so_int_of_it_is_safe():
    assert is_decimal("9" * 20) and int("9" * 20) == 10**20 - 1
    assert not is_decimal("9" * 21)
    assert not is_decimal(HUGE)


@pytest.mark.parametrize("value", [1 << 2000, -(1 << 2000)], ids=["2**2000", "-2**2000"])
def test_numbers_too_large_for_a_float_are_refused_not_raised(value):
    with pytest.raises(ConfigError, match="bad active thread percentage"):
        parse_percentage(value)
    with pytest.raises(ConfigError, match="bad duration"):
        parse_duration(value)
