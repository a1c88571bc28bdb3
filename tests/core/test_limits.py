"""csrc/limits.c: the C limit parser against its grammar and against mpsd.units.parse_limits.

Every example goes through both builds of the driver (plain, and ASan+UBSan), so the sanitizer
run covers the table and the whole hypothesis corpus."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, find, given, settings
from hypothesis import strategies as st

from mpsd.errors import ConfigError
from mpsd.units import parse_limits
from tests.core.conftest import VARIANTS, LineProc

G = 1 << 30
M = 1 << 20
MAX = (1 << 64) - 1
UUID = "GPU-8c5a6a2e-5b0c-4b5f-9c1e-0f6d2d7a1b3c"


@pytest.fixture(scope="module")
def parsers(core_bin: Path) -> Iterator[list[LineProc]]:
    procs = [LineProc([core_bin / f"limits_cli{v}", "limits"]) for v in VARIANTS]
    yield procs
    for p in procs:
        assert p.close() == 0, p.stderr_text()


def c_parse(proc: LineProc, text: str) -> dict[int | str, int] | str:
    """The C parser's result as parse_limits would give it, or its error message."""
    answer = proc.ask(text)
    if answer.startswith("ERR "):
        return answer[4:]
    assert answer.startswith("OK"), answer
    result: dict[int | str, int] = {}
    for item in answer[2:].split():
        key, _, value = item.rpartition("=")
        result[int(key) if key.isdigit() else key] = int(value)
    return result


def py_parse(text: str) -> dict[int | str, int] | None:
    try:
        return parse_limits(text)
    except ConfigError:
        return None


# (text, expected value or a fragment of the one-line error)
TABLE: list[tuple[str, dict[int | str, int] | str]] = [
    ("", {}),
    ("0=4G", {0: 4 * G}),
    ("0=4G,1=512M", {0: 4 * G, 1: 512 * M}),
    ("0=4g,1=512mb,2=1KB,3=7,4=1T", {0: 4 * G, 1: 512 * M, 2: 1024, 3: 7, 4: 1 << 40}),
    ("63=1", {63: 1}),
    ("007=1G", {7: G}),
    ("0=0", {0: 0}),
    ("0=18446744073709551615", {0: MAX}),
    ("0=000000000000000000000000000001", {0: 1}),
    ("0=16777215T", {0: 16777215 << 40}),
    (f"{UUID}=2G", {UUID: 2 * G}),
    (f"MIG-{UUID[4:]}/1/0=1G,0=2G", {f"MIG-{UUID[4:]}/1/0": G, 0: 2 * G}),
    ("GPU-a_b/c-d=1", {"GPU-a_b/c-d": 1}),
    ("GPU-ab=1,GPU-AB=2", {"GPU-ab": 1, "GPU-AB": 2}),
    ("0=18446744073709551616", "'18446744073709551616': larger than 2**64-1"),
    ("0=16777216T", "'16777216T': larger than 2**64-1"),
    ("0=99999999999999999999999G", "larger than 2**64-1"),
    ("64=1G", "device '64': ordinals run from 0 to 63"),
    ("99999999999999999999999=1G", "ordinals run from 0 to 63"),
    ("0=1G,", "empty entry"),
    (",0=1G", "empty entry"),
    ("0=1G,,1=1G", "empty entry"),
    (",", "empty entry"),
    ("0=1G,0=2G", "device '0' given twice"),
    ("0=1G,00=2G", "device '00' given twice"),
    (f"{UUID}=1G,{UUID}=1G", "given twice"),
    ("0", "entry '0': expected DEVICE=SIZE"),
    ("0=", "size '': expected a byte count"),
    ("=1G", "device '': expected an ordinal"),
    ("0=1Gx", "size '1Gx'"),
    ("0=1B", "size '1B'"),
    ("0=1GBB", "size '1GBB'"),
    ("0=G", "size 'G'"),
    ("0=-1", "size '-1'"),
    ("0=+1", "size '+1'"),
    ("0=1.5G", "size '1.5G'"),
    ("0=1G=2G", "size '1G=2G'"),
    (" 0=1G", "device ' 0'"),
    ("0=1G ", "size '1G '"),
    ("0 =1G", "device '0 '"),
    ("0=1 G", "size '1 G'"),
    ("0=1G;1=1G", "size '1G;1=1G'"),
    ("-1=1G", "device '-1'"),
    ("GPU-=1G", "device 'GPU-'"),
    ("gpu-ab=1G", "device 'gpu-ab'"),
    ("GPU-a b=1G", "device 'GPU-a b'"),
    ("GPU-a.b=1G", "device 'GPU-a.b'"),
    ("0=1G\t", "size '1G\\x09'"),
    ("0=0x10", "size '0x10'"),
]


@pytest.mark.parametrize(("text", "expected"), TABLE)
def test_table(parsers: list[LineProc], text: str, expected: dict[int | str, int] | str) -> None:
    for proc in parsers:
        got = c_parse(proc, text)
        if isinstance(expected, dict):
            assert got == expected
            assert parse_limits(text) == expected
        else:
            assert isinstance(got, str), f"{text!r} accepted as {got}"
            assert expected in got
            assert got.startswith(f"bad limits {text!r}"[:11])
            with pytest.raises(ConfigError):
                parse_limits(text)


def test_error_quotes_the_text_and_escapes_control_bytes(parsers: list[LineProc]) -> None:
    for proc in parsers:
        assert c_parse(proc, "0=1G,x\x01y=2") == (
            "bad limits '0=1G,x\\x01y=2': device 'x\\x01y': "
            "expected an ordinal (0, 1, ...) or a GPU UUID (GPU-... or MIG-...)"
        )
        long = "0=" + "9" * 500
        msg = c_parse(proc, long)
        assert isinstance(msg, str) and "..." in msg and len(msg) < 511


@pytest.mark.parametrize(
    ("text", "why"),
    [
        # Limits of the fixed C table (no allocation while reading environ); units.py has none.
        ("GPU-" + "a" * 92 + "=1G", "a UUID has at most 95 characters"),
        (",".join(f"GPU-{i}=1" for i in range(65)), "more than 64 entries"),
    ],
)
def test_c_table_bounds(parsers: list[LineProc], text: str, why: str) -> None:
    for proc in parsers:
        got = c_parse(proc, text)
        assert isinstance(got, str) and why in got
    ok = "GPU-" + "a" * 91 + "=1G"
    for proc in parsers:
        assert c_parse(proc, ok) == {"GPU-" + "a" * 91: G}


SIZES = [
    ("0", 0),
    ("1", 1),
    ("1k", 1024),
    ("1K", 1024),
    ("1kb", 1024),
    ("1KB", 1024),
    ("1kB", 1024),
    ("3m", 3 * M),
    ("5G", 5 * G),
    ("2T", 2 << 40),
    ("18446744073709551615", MAX),
    ("", None),
    ("K", None),
    ("1B", None),
    ("1X", None),
    ("1KBB", None),
    ("18446744073709551616", None),
    ("16777216T", None),
    ("17179869184G", None),
    ("-1", None),
    (" 1", None),
    ("1 ", None),
]


@pytest.mark.parametrize(("text", "value"), SIZES)
def test_parse_size(core_bin: Path, text: str, value: int | None) -> None:
    for v in VARIANTS:
        with LineProc([core_bin / f"limits_cli{v}", "size"]) as proc:
            assert proc.ask(text) == ("ERR" if value is None else f"OK {value}")


@pytest.mark.parametrize(
    ("limits", "ordinal", "uuid", "cap"),
    [
        ("0=1G", 0, "", G),
        ("0=1G", 1, "", None),
        ("", 0, "", None),
        (f"{UUID}=2G", 0, UUID, 2 * G),
        (f"{UUID}=2G", 0, UUID.lower(), 2 * G),  # UUIDs compare without case
        (f"{UUID}=2G", 0, "", None),
        (f"{UUID}=2G", 0, "GPU-other", None),
        (f"{UUID}=2G,0=1G", 0, UUID, G),  # an ordinal entry wins over a UUID entry
        (f"0=1G,{UUID}=2G", 0, UUID, G),
        (f"1=1G,{UUID}=2G", 0, UUID, 2 * G),
    ],
)
def test_limits_find(core_bin: Path, limits: str, ordinal: int, uuid: str, cap: int | None) -> None:
    with LineProc([core_bin / "limits_cli_san", "find"]) as proc:
        assert proc.ask(f"{limits}|{ordinal}|{uuid}") == ("NOCAP" if cap is None else f"CAP {cap}")


# --- property: the C parser and mpsd.units.parse_limits agree ---

UUID_CHARS = "abcdefABCDEF0123456789-/_"
ordinals = st.integers(0, 70).map(str) | st.integers(0, 63).map(lambda i: "0" * 3 + str(i))
uuids = st.builds(lambda p, s: p + s, st.sampled_from(["GPU-", "MIG-"]), st.text(UUID_CHARS, min_size=1, max_size=40))
digits = (
    st.integers(0, MAX).map(str) | st.integers(0, 1 << 70).map(str) | st.text("0123456789", min_size=1, max_size=25)
)
units = st.sampled_from(["", "k", "K", "m", "M", "g", "G", "t", "T", "KB", "mb", "Gb", "tB"])
sizes = st.builds(lambda d, u: d + u, digits, units)
entries = st.builds(lambda k, s: f"{k}={s}", ordinals | uuids, sizes)
valid_like = st.lists(entries, min_size=0, max_size=8).map(",".join)
NOISE = "0123456789KMGTBkmgtb=,-/_GPUMI x.;+\t\x01\x7f"


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = list(draw(valid_like))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        pos = draw(st.integers(0, len(text)))
        if op == "insert":
            text.insert(pos, draw(st.sampled_from(NOISE)))
        elif text and pos < len(text):
            if op == "delete":
                del text[pos]
            else:
                text[pos] = draw(st.sampled_from(NOISE))
    return "".join(text)


garbage = st.text(NOISE, max_size=40)


def check_agree(parsers: list[LineProc], text: str) -> None:
    want = py_parse(text)
    for proc in parsers:
        got = c_parse(proc, text)
        if want is None:
            assert isinstance(got, str), f"C accepted {text!r} as {got}; units.py refuses it"
            assert got.startswith("bad limits '") and "\n" not in got
        else:
            assert got == want, f"{text!r}: C {got} != units.py {want}"


PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(text=valid_like)
@example(text="0=1G,0=1G")
@example(text="0=18446744073709551615,1=16777216T")
def test_agrees_with_units_on_generated_strings(parsers: list[LineProc], text: str) -> None:
    check_agree(parsers, text)


@PROPERTY
@given(text=mutated())
def test_agrees_with_units_on_mutated_strings(parsers: list[LineProc], text: str) -> None:
    check_agree(parsers, text)


@PROPERTY
@given(text=garbage)
def test_agrees_with_units_on_garbage(parsers: list[LineProc], text: str) -> None:
    check_agree(parsers, text)


def test_generator_reaches_accepted_multi_entry_strings() -> None:
    """The agreement test is worth something only if the generator also makes accepted strings."""
    text = find(valid_like, lambda t: (r := py_parse(t)) is not None and len(r) >= 3)
    assert len(parse_limits(text)) >= 3
