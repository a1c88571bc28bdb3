"""csrc/region_*.c: container-wide accounting across threads and real processes.

Drivers come in several builds (tests/core/Makefile): plain, `_san` under ASan+UBSan (which also
pauses between a charge's compare-and-swap and its fold, widening the window a SIGKILL must hit),
`_tsan` under ThreadSanitizer and `_fault` with fault injection (tests/core/test_region_faults.py)."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.conftest import VARIANTS, LineProc, Repl, driver_env, snap

MAX = (1 << 64) - 1
# Header offsets of layout version 3 (csrc/region.h, struct ms_hdr); a layout change must update them.
OFF_VERSION, OFF_RESOLVED, OFF_USED0, OFF_SLOTS = 8, 40, 128 + 8 * 64, 128 + 136 * 64
WORD_SIZE, LANE_SIZE = 128, 128 + 8 * 64 + 16 * 8  # a device word; a lane: owner's line, share[64], rsv[8], helpers' line
SLOT_SIZE, SLOTS = 128 + 16 * LANE_SIZE, 256
FILE_SIZE = OFF_SLOTS + SLOTS * SLOT_SIZE
V1_SIZE = 128 + 2 * 8 * 64 + 256 * 576  # the layout before this one


def v1_file() -> bytes:
    """The first bytes of a layout-1 region as the previous shim wrote them, at its size."""
    head = b"MPSSHMRG" + struct.pack("<IIQII", 1, 0x280840, V1_SIZE, 256, 64)
    return head + b"\0" * (V1_SIZE - len(head))

def made_region(repl: Repl, path: Path) -> bytes:
    p = repl()
    assert p.ask(f"open {path}") == "ok"
    assert p.ask("close") == "ok"
    return path.read_bytes()


@pytest.mark.parametrize("variant", VARIANTS)
def test_charge_to_cap_then_refuse_then_back_to_zero(repl: Repl, tmp_path: Path, variant: str) -> None:
    path = tmp_path / "region"
    p = repl(variant)
    assert p.ask(f"open {path}") == "ok"
    assert p.ask("charge 0 1000 400") == "ok 400"
    assert p.ask("charge 0 1000 600") == "ok 1000"
    assert p.ask("charge 0 1000 1") == "over 1000"  # nothing charged
    assert p.ask("charge 0 1000 0") == "ok 1000"
    assert p.ask("charge 1 1000 1000") == "ok 1000"  # devices are separate
    assert p.ask("uncharge 0 400") == "left 0"
    assert p.ask("used 0") == "600"
    assert p.ask("charge 0 1000 401") == "over 600"
    assert p.ask("uncharge 0 600") == "left 0"
    assert p.ask("used 0") == "0"
    assert p.ask("uncharge 0 5") == "left 5"  # more than held: clamped and reported, no wrap
    assert p.ask("used 0") == "0"
    assert p.ask("uncharge 1 1000") == "left 0"
    assert p.ask("used 1") == "0"


def test_no_wrap_at_the_top_of_the_range(repl: Repl, tmp_path: Path) -> None:
    p = repl()
    assert p.ask(f"open {tmp_path / 'r'}") == "ok"
    assert p.ask(f"charge 0 {MAX} {MAX}") == f"ok {MAX}"
    assert p.ask(f"charge 0 {MAX} 1") == f"over {MAX}"
    assert p.ask(f"charge 0 {MAX - 1} 0") == f"over {MAX}"  # cap lowered under what is in use
    assert p.ask("charge 0 10 11") == f"over {MAX}"
    assert p.ask(f"uncharge 0 {MAX}") == "left 0"
    assert p.ask("charge 0 10 11") == "over 0"  # bigger than the cap itself
    assert p.ask("used 0") == "0"


def test_bad_device_is_an_error_not_a_charge(repl: Repl, tmp_path: Path) -> None:
    p = repl()
    assert p.ask(f"open {tmp_path / 'r'}") == "ok"
    for dev in (-1, 64, 1000):
        assert p.ask(f"charge {dev} 100 1").startswith("error")
        assert p.ask(f"uncharge {dev} 1") == "left 1"


def test_processes_share_one_cap(repl: Repl, tmp_path: Path) -> None:
    path = tmp_path / "region"
    a, b = repl(), repl("")
    assert a.ask(f"open {path}") == "ok" and b.ask(f"open {path}") == "ok"
    assert a.ask("charge 0 1000 600") == "ok 600"
    assert b.ask("charge 0 1000 500") == "over 600"
    assert b.ask("charge 0 1000 400") == "ok 1000"
    s = snap(a, path)
    assert s["used0"] == 1000 and s["cap0"] == 1000 and s["nprocs"] == 2
    assert sorted(s["procs"]) == sorted([(a.pid, 1, 600), (b.pid, 1, 400)])  # type: ignore[type-var]
    assert b.ask("uncharge 0 600") == "left 200"  # b holds only 400
    assert a.ask("close") == "ok"  # closing gives a's charges back
    assert b.ask("used 0") == "0"


def test_snapshot_from_an_outside_process_marks_liveness(repl: Repl, tmp_path: Path) -> None:
    path = tmp_path / "region"
    a, b, tool = repl(), repl(), repl()
    assert a.ask(f"open {path}") == "ok" and b.ask(f"open {path}") == "ok"
    assert a.ask("charge 0 100 10") == "ok 10" and b.ask("charge 0 100 20") == "ok 30"
    b.kill()
    s = snap(tool, path)  # tool never opened the region: read-only path
    assert s["version"] == 3 and s["used0"] == 30
    assert sorted(s["procs"]) == sorted([(a.pid, 1, 10), (b.pid, 0, 20)])  # type: ignore[type-var]
    assert a.ask("reclaim") == "1"
    assert snap(tool, path)["procs"] == [(a.pid, 1, 10)]


def test_opening_twice_in_one_process_shares_the_slot(repl: Repl, tmp_path: Path) -> None:
    """A second descriptor, once closed, would drop the process's liveness lock."""
    path = tmp_path / "region"
    a, tool = repl(), repl()
    assert a.ask(f"open {path}") == "ok" and a.ask(f"open {path}") == "ok"
    assert a.ask("charge 0 100 10") == "ok 10"
    assert a.ask(f"snapshot {path}").endswith(f"procs={a.pid}:1:10")  # own process: via its mapping
    assert a.ask("close") == "ok"
    assert snap(tool, path)["procs"] == [(a.pid, 1, 10)]
    assert a.ask("cloexec " + str(path)) == "ok 1"  # one descriptor, close-on-exec
    assert a.ask("close") == "ok"
    assert snap(tool, path)["procs"] == []


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o000, 0o666), (0o077, 0o600)])
def test_created_with_0666_minus_umask(core_bin: Path, tmp_path: Path, umask: int, mode: int) -> None:
    path = tmp_path / "region"
    with LineProc([core_bin / "region_cli", "repl"], umask=umask) as p:
        assert p.ask(f"open {path}") == "ok"
    assert path.stat().st_mode & 0o777 == mode
    assert sorted(os.listdir(tmp_path)) == ["region"]  # no temporary file left behind


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_explicit_mode_ignores_the_umask(core_bin: Path, tmp_path: Path, umask: int) -> None:
    path = tmp_path / "region"
    with LineProc([core_bin / "region_cli", "repl"], umask=umask) as p:
        assert p.ask(f"openmode 666 {path}") == "ok"
    assert path.stat().st_mode & 0o777 == 0o666
    assert sorted(os.listdir(tmp_path)) == ["region"]


def test_an_explicit_mode_leaves_an_existing_file_alone(core_bin: Path, tmp_path: Path) -> None:
    path = tmp_path / "region"
    with LineProc([core_bin / "region_cli", "repl"], umask=0o077) as p:
        assert p.ask(f"open {path}") == "ok"
    with LineProc([core_bin / "region_cli", "repl"], umask=0o022) as p:
        assert p.ask(f"openmode 666 {path}") == "ok"
    assert path.stat().st_mode & 0o777 == 0o600


def test_racing_first_openers_all_see_a_whole_region(core_bin: Path, tmp_path: Path) -> None:
    for round_ in range(4):
        path = tmp_path / f"region{round_}"
        procs = [
            subprocess.Popen(
                [core_bin / "region_cli_san", "stress", path, "1000000", "1", "0.05", str(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=driver_env(),
            )
            for i in range(8)
        ]
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err.decode()
            assert b"bad=0" in out
        assert sorted(os.listdir(tmp_path))[-1] == path.name and len(os.listdir(tmp_path)) == round_ + 1


# --- refusing bad files (and leaving them as they were) ---


def corrupt(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


BAD_FILES: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("bad magic", lambda good: b"NOTMPSSH" + good[8:], "bad magic number"),
    ("random garbage", lambda good: os.urandom(len(good)), "bad magic number"),
    ("version 1", lambda good: corrupt(good, OFF_VERSION, "<I", 1), "layout version 1; this shim reads only version 3"),
    ("a layout-1 file", lambda good: v1_file(), "layout version 1; this shim reads only version 3"),
    ("version 2", lambda good: corrupt(good, OFF_VERSION, "<I", 2), "layout version 2; this shim reads only version 3"),
    ("version 4", lambda good: corrupt(good, OFF_VERSION, "<I", 4), "layout version 4; this shim reads only version 3"),
    ("truncated", lambda good: good[:1000], "is 1000 bytes, expected"),
    ("empty", lambda good: b"", "is 0 bytes, expected"),
    ("too long", lambda good: good + b"\0" * 4096, "bytes, expected"),
    ("garbage slot", lambda good: corrupt(good, OFF_SLOTS, "<Q", 77), "slot 0 has state 0x4d"),
    ("claimed without a nonce", lambda good: corrupt(good, OFF_SLOTS + SLOT_SIZE, "<Q", 2), "slot 1 has state 0x2"),
    ("totals", lambda good: corrupt(good, OFF_USED0, "<Q", 5), "device 0 total 5 differs"),
]


@pytest.mark.parametrize(("what", "damage", "reason"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_file_is_refused_with_a_reason(
    repl: Repl, tmp_path: Path, what: str, damage: Callable[[bytes], bytes], reason: str
) -> None:
    path = tmp_path / "region"
    good = made_region(repl, path)
    assert len(good) == FILE_SIZE
    bad = damage(good)
    path.write_bytes(bad)
    for variant in VARIANTS:
        p = repl(variant)
        answer = p.ask(f"open {path}")
        assert answer.startswith("err region ") and reason in answer, answer
        assert str(path) in answer and "\n" not in answer
        if what != "totals":  # the read-only snapshot checks the layout too (not the totals: no lock)
            assert p.ask(f"snapshot {path}").startswith("err region ")
    assert path.read_bytes() == bad  # nothing lost, nothing "repaired"


def test_directory_or_missing_dir_is_refused(repl: Repl, tmp_path: Path) -> None:
    p = repl()
    assert p.ask(f"open {tmp_path}").startswith("err ")
    assert p.ask(f"open {tmp_path}/no/such/dir/region").startswith("err cannot create region")
    assert p.ask(f"snapshot {tmp_path}/missing").startswith("err cannot open region")


# --- crashes ---


def resolved(path: Path) -> int:
    """How many operations dead processes left in flight were finished or dropped by a survivor."""
    return struct.unpack_from("<Q", path.read_bytes(), OFF_RESOLVED)[0]


def test_sigkill_of_a_holder_gives_its_charges_back(repl: Repl, tmp_path: Path) -> None:
    path = tmp_path / "region"
    a = repl()
    assert a.ask(f"open {path}") == "ok" and a.ask("charge 0 1000 900") == "ok 900"
    a.kill()
    b = repl()
    assert b.ask(f"open {path}") == "ok"  # opening reclaims the dead slot
    assert b.ask("charge 0 1000 1000") == "ok 1000"

    c = repl()
    assert c.ask(f"open {path}") == "ok"
    b.kill()  # now a refusal must reclaim (c opened before b died)
    assert c.ask("charge 0 1000 1000") == "ok 1000"
    assert c.ask("uncharge 0 1000") == "left 0" and c.ask("used 0") == "0"


@pytest.mark.parametrize("variant", VARIANTS)
def test_sigkill_inside_charge_and_uncharge(core_bin: Path, repl: Repl, tmp_path: Path, variant: str) -> None:
    """Four threads loop in charge/uncharge when SIGKILL lands; the survivor resolves what the dead
    threads left in flight (region_ops.h's crash-consistency argument) and can then charge exactly the
    whole cap, no more."""
    path = tmp_path / "region"
    cap = 1 << 20
    # The _san build pauses between the compare-and-swap of the total and the lane's fold, so
    # most kills land with an operation in flight; demand several such resolutions.
    want = 3 if variant == "_san" else 1
    deadline = time.monotonic() + 30
    kills = 0
    while time.monotonic() < deadline and (kills < 3 or resolved(path) < want):
        with LineProc([core_bin / f"region_cli{variant}", "spin", path, str(cap), "4096", "4"]) as spinner:
            assert spinner.proc.stdout is not None and spinner.proc.stdout.readline() == b"ready\n"
            time.sleep(0.05 + 0.01 * kills)
            spinner.kill()
        kills += 1
        p = repl()
        assert p.ask(f"open {path}") == "ok"
        assert p.ask(f"charge 0 {cap} {cap}") == f"ok {cap}"
        assert p.ask(f"charge 0 {cap} 1") == f"over {cap}"  # exactly the cap: no drift either way
        assert p.ask(f"uncharge 0 {cap}") == "left 0" and p.ask("used 0") == "0"
        assert p.ask("close") == "ok"
    assert resolved(path) >= want, f"too few SIGKILLs landed with an operation in flight in {kills} tries"


def test_fork_child_gets_its_own_slot(repl: Repl, tmp_path: Path) -> None:
    path = tmp_path / "region"
    p = repl()
    assert p.ask(f"open {path}") == "ok" and p.ask("charge 0 1000 300") == "ok 300"
    line = p.ask("forkcharge 0 1000 200")
    child = int(re.search(r"pid=(\d+)", line).group(1))  # type: ignore[union-attr]
    assert "rc=0 in_use=500 status=0" in line, line
    s = snap(p, path)
    # the child charged into a slot of its own, and died (exit without close) holding it
    assert sorted(s["procs"]) == sorted([(p.pid, 1, 300), (child, 0, 200)])  # type: ignore[type-var]
    assert p.ask("reclaim") == "1"
    assert p.ask("used 0") == "300"
    assert p.ask("forkcharge 0 1000 701").endswith("rc=1 in_use=300 status=0")  # over cap in the child
    assert p.ask("uncharge 0 300") == "left 0" and p.ask("used 0") == "0"


# --- many threads and processes ---


@pytest.mark.parametrize("variant", VARIANTS)
def test_threads_and_processes_never_overshoot(core_bin: Path, repl: Repl, tmp_path: Path, variant: str) -> None:
    """4 processes x 4 threads charge/uncharge random sizes for 2 s; each checks the total after
    every charge, and an outside observer polls snapshots. It all ends at exactly 0."""
    path = tmp_path / "region"
    cap = 1 << 20
    observer = repl()
    assert observer.ask(f"open {path}") == "ok" and observer.ask("close") == "ok"
    workers = [
        subprocess.Popen(
            [core_bin / f"region_cli{variant}", "stress", path, str(cap), "4", "2", str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=driver_env(),
        )
        for seed in range(4)
    ]
    seen, polls = 0, 0
    while any(w.poll() is None for w in workers):
        s = snap(observer, path)
        assert s["used0"] <= cap, s  # type: ignore[operator]
        seen = max(seen, s["used0"])  # type: ignore[type-var]
        polls += 1
        time.sleep(0.005)
    charges = refused = 0
    for w in workers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err.decode()
        m = re.fullmatch(rb"charges=(\d+) refused=(\d+) maxseen=(\d+) bad=0\n", out)
        assert m is not None, out
        charges += int(m[1])
        refused += int(m[2])
    assert charges > 1000 and refused > 0  # the cap was actually contended
    assert polls > 10 and seen > cap // 2
    s = snap(observer, path)
    assert s["used0"] == 0 and s["procs"] == []


# --- property: the region against a model, with real processes dying ---

# One cap per device for the whole program, as mpsd sets them (one per container, the same in each
# of its processes): a thread may charge from a reserve it took under its cap (docs/shim.md), so a
# cap that changed between two calls of one process is not a case the region promises anything for.
CAPS = [0, 100, 1000, MAX]
ops = st.one_of(
    st.tuples(st.just("charge"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 700)),
    st.tuples(st.just("uncharge"), st.integers(0, 2), st.integers(0, 1), st.integers(0, 700)),
    st.tuples(st.just("kill"), st.integers(0, 2)),
    st.tuples(st.just("reclaim"), st.integers(0, 2)),
)


class Model:
    """What the region must do: one total per device over every slot not yet reclaimed."""

    def __init__(self) -> None:
        self.slots: dict[int, list[int]] = {}  # process index -> used per device
        self.dead: set[int] = set()

    def total(self, dev: int) -> int:
        return sum(used[dev] for used in self.slots.values())

    def reclaim(self) -> int:
        for p in self.dead & self.slots.keys():
            del self.slots[p]
        n = len(self.dead)
        self.dead = set()
        return n

    def open(self, p: int) -> None:
        self.reclaim()
        self.slots[p] = [0, 0]

    def charge(self, p: int, dev: int, cap: int, n: int) -> str:
        if self.total(dev) + n > cap:
            self.reclaim()
            if self.total(dev) + n > cap:
                return f"over {self.total(dev)}"
        self.slots[p][dev] += n
        return f"ok {self.total(dev)}"

    def uncharge(self, p: int, dev: int, n: int) -> str:
        take = min(n, self.slots[p][dev])
        self.slots[p][dev] -= take
        return f"left {n - take}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(caps=st.tuples(st.sampled_from(CAPS), st.sampled_from(CAPS)), program=st.lists(ops, max_size=25))
def test_matches_a_model_with_processes_dying(
    core_bin: Path, tmp_path_factory: pytest.TempPathFactory, caps: tuple[int, int], program: list[tuple[object, ...]]
) -> None:
    path = tmp_path_factory.mktemp("prop") / "region"
    model = Model()
    procs: dict[int, LineProc] = {}

    def proc(i: int) -> LineProc:
        if i not in procs:
            procs[i] = LineProc([core_bin / "region_cli_san", "repl"])
            assert procs[i].ask(f"open {path}") == "ok"
            model.open(i)
        return procs[i]

    try:
        for op in program:
            kind, i = op[0], int(op[1])  # type: ignore[call-overload]
            if kind == "charge":
                _, _, dev, n = op
                cap = caps[dev]  # type: ignore[index]
                assert proc(i).ask(f"charge {dev} {cap} {n}") == model.charge(i, dev, cap, n)  # type: ignore[arg-type]
            elif kind == "uncharge":
                _, _, dev, n = op
                assert proc(i).ask(f"uncharge {dev} {n}") == model.uncharge(i, dev, n)  # type: ignore[arg-type]
            elif kind == "kill" and i in procs:
                procs.pop(i).kill()
                model.dead.add(i)
            elif kind == "reclaim":
                p = proc(i)
                assert p.ask("reclaim") == str(model.reclaim())
            for dev in (0, 1):
                if procs:
                    assert next(iter(procs.values())).ask(f"used {dev}") == str(model.total(dev))
    finally:
        for p in procs.values():
            assert p.close() == 0, p.stderr_text()


def test_closing_another_descriptor_of_the_file_keeps_the_process_alive(repl: Repl, tmp_path: Path) -> None:
    """With classic POSIX locks this would drop the liveness lock (a second library copy reading
    a snapshot, or the program reading the file), and others would reclaim live charges."""
    path = tmp_path / "region"
    a, other = repl(), repl()
    assert a.ask(f"open {path}") == "ok" and a.ask("charge 0 1000 600") == "ok 600"
    assert a.ask(f"touchfd {path}") == "ok"
    assert a.ask(f"snapshot {path}").endswith(f"procs={a.pid}:1:600")  # a snapshot opens and closes one too
    assert other.ask(f"open {path}") == "ok"
    assert other.ask("reclaim") == "0"
    assert other.ask("charge 0 1000 401") == "over 600"


def test_a_living_fork_child_does_not_keep_a_dead_parent_alive(repl: Repl, tmp_path: Path) -> None:
    path = tmp_path / "region"
    parent, other = repl(), repl()
    assert parent.ask(f"open {path}") == "ok" and parent.ask("charge 0 1000 600") == "ok 600"
    child = int(parent.ask("forksleep"))
    try:
        parent.kill()
        assert other.ask(f"open {path}") == "ok"
        assert other.ask("charge 0 1000 1000") == "ok 1000"  # the parent's 600 came back
        os.kill(child, 0)  # while the child still lives
    finally:
        os.kill(child, signal.SIGKILL)


def test_fork_child_of_a_deleted_region_refuses_to_charge(repl: Repl, tmp_path: Path) -> None:
    """The child cannot get a descriptor of its own for a file that is gone: its charges are
    errors (never uncapped), while the parent carries on with the file it has."""
    path = tmp_path / "region"
    p = repl()
    assert p.ask(f"open {path}") == "ok" and p.ask("charge 0 1000 100") == "ok 100"
    path.unlink()
    assert p.ask("forkcharge 0 1000 1").endswith("rc=-1 in_use=0 status=0")
    assert p.ask("charge 0 1000 900") == "ok 1000"
    assert p.ask("charge 0 1000 1") == "over 1000"



@pytest.mark.parametrize("variant", [*VARIANTS, "_tsan"])
@pytest.mark.parametrize("grow_back", [False, True], ids=["shrunk", "zeroed"])
def test_a_region_shrunk_under_its_handle_ends_in_errors_not_sigbus(
    repl: Repl, tmp_path: Path, variant: str, grow_back: bool
) -> None:
    # another process (any UID: the file is 0666) truncates the mapped file; grown back, it
    # reads as zeros. Either way: errors from then on, for good, never a signal (issue 16 #5)
    path = tmp_path / "region"
    p = repl(variant)
    assert p.ask(f"open {path}") == "ok"
    assert p.ask("charge 0 1000 400") == "ok 400"
    os.truncate(path, 0 if grow_back else 4096)
    if grow_back:
        os.truncate(path, FILE_SIZE)
    assert p.ask("charge 0 1000 1").startswith("error")
    assert p.ask("uncharge 0 400") == "left 400"  # nothing to give back to
    assert p.ask("used 0") == str(MAX)  # callers report nothing free
    assert p.ask("reclaim") == "0"
    os.truncate(path, FILE_SIZE)
    assert p.ask("charge 0 1000 1").startswith("error")  # lost for good, even once the size is back
    assert p.ask("close") == "ok"
    assert p.ask(f"open {path}").startswith("err region")  # the zeroed file has no magic: refused
    assert p.proc.poll() is None
