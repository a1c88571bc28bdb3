"""Concurrency of the region core. No process of a region waits on another (issues 7 and 8): a
co-tenant stopped in the middle of a tight charge/uncharge loop, a survivor stopped in the
middle of repairing a dead slot, and a file whose words someone else overwrote never block
another process; and the core is clean under ThreadSanitizer with more threads than a process
has lanes. Real processes and signals."""

from __future__ import annotations

import os
import random
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.core.conftest import VARIANTS, LineProc, Repl, driver_env, snap
from tests.core.test_region import FILE_SIZE, LANE_SIZE, OFF_SLOTS, OFF_USED0, SLOT_SIZE, SLOTS, WORD_SIZE

CAP = 1 << 30
ANSWER_WITHIN = 5.0  # seconds; an answer never depends on a stopped process, so this is only slack for load


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_co_tenant_stopped_mid_loop_never_blocks_another_process(start, tmp_path: Path, variant: str) -> None:
    """SIGSTOP lands anywhere in the spinner's four threads (the _san build pauses between the
    compare-and-swap and the fold, so many stops land with an operation in flight); every time,
    another process opens, charges and uncharges at once."""
    path = tmp_path / "region"
    spinner = start("spin", str(path), str(CAP), "4096", "4", variant=variant)
    assert spinner.proc.stdout is not None and spinner.proc.stdout.readline() == b"ready\n"
    rng = random.Random(7)
    for i in range(40):
        time.sleep(rng.uniform(0.001, 0.02))
        os.kill(spinner.pid, signal.SIGSTOP)
        try:
            other = start()
            assert other.ask(f"open {path}", within=ANSWER_WITHIN) == "ok"
            for _ in range(3):
                assert other.ask(f"charge 0 {CAP} 1048576", within=ANSWER_WITHIN).startswith("ok ")
                assert other.ask("uncharge 0 1048576", within=ANSWER_WITHIN) == "left 0"
            assert other.ask("close", within=ANSWER_WITHIN) == "ok"
        finally:
            os.kill(spinner.pid, signal.SIGCONT)
        assert spinner.proc.poll() is None, f"round {i}: the spinner died"
    spinner.kill()
    last = start()
    assert last.ask(f"open {path}") == "ok"  # reclaims the spinner, whatever it was doing
    assert last.ask("used 0") == "0"
    assert last.ask(f"charge 0 {CAP} {CAP}") == f"ok {CAP}" and last.ask(f"charge 0 {CAP} 1") == f"over {CAP}"


def test_a_repairer_stopped_mid_repair_blocks_nobody(start, tmp_path: Path) -> None:
    """A survivor frozen while it gives a dead process's memory back (holding that slot's repair
    lock) delays only that give-back: others open and charge at once, and a charge that needs the
    dead memory is refused at once (it is still counted: the safe side). Once the frozen repairer
    dies, the next charge repairs the slot itself."""
    path = tmp_path / "region"
    mine = 100
    owner = start()
    assert owner.ask(f"open {path}") == "ok" and owner.ask(f"charge 0 1000 {mine}") == f"ok {mine}"
    dead = start(variant="_fault", fault="charge.applied:2")  # dies with its second charge in flight: 600
    assert dead.ask(f"open {path}") == "ok" and dead.ask("charge 0 1000 200") == "ok 300"
    with pytest.raises(AssertionError, match="died"):
        dead.ask("charge 0 1000 400")
    repairer = start(variant="_fault", fault="repair.announced:stop")
    assert repairer.proc.stdin is not None
    repairer.proc.stdin.write(f"open {path}\n".encode())
    repairer.proc.stdin.flush()
    deadline = time.monotonic() + 10
    while not re.search(r"^State:\s+T", Path(f"/proc/{repairer.pid}/status").read_text(), re.MULTILINE):
        assert time.monotonic() < deadline, "the repairer never stopped at its fault point"
        time.sleep(0.01)
    other = start()
    assert other.ask(f"open {path}", within=ANSWER_WITHIN) == "ok"
    assert other.ask("charge 0 1000 300", within=ANSWER_WITHIN) == "ok 1000"  # 100 + 600 dead + 300
    assert other.ask("charge 0 1000 1", within=ANSWER_WITHIN) == "over 1000"  # refused, not waited on
    assert other.ask("reclaim", within=ANSWER_WITHIN) == "0"
    os.kill(repairer.pid, signal.SIGKILL)
    repairer.kill()
    assert other.ask("charge 0 1000 1", within=ANSWER_WITHIN) == f"ok {mine + 300 + 1}"  # repaired, exactly
    assert other.ask("uncharge 0 301") == "left 0" and owner.ask("used 0") == str(mine)


def poke(path: Path, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<Q", value & ((1 << 64) - 1)))


LANE0 = OFF_SLOTS + 128  # slot 0, lane 0
POISON = {
    # where, what: a live thread ID (as in the old layout's lock word), or garbage
    "old lock word": (64, "tid"),
    "device 0 tag": (OFF_USED0 + 8, "garbage"),
    "slot state": (OFF_SLOTS + 7 * SLOT_SIZE, "tid"),
    "slot state, claimed": (OFF_SLOTS + 7 * SLOT_SIZE, "claimed"),
    "lane in flight": (LANE0 + 7 * SLOT_SIZE + 3 * LANE_SIZE, "garbage"),
    "helper mark": (LANE0 + 64 + 8 * 64, "garbage"),
    "device 0 total": (OFF_USED0, "garbage"),
}


@pytest.mark.parametrize("where", sorted(POISON))
def test_a_poisoned_word_never_hangs_anyone(start, tmp_path: Path, where: str) -> None:
    """The file is writable by every process of the container: whatever one of them writes, no
    other waits on it; it gets an answer (a charge, a refusal, or a one-line error), never a hang,
    and never more than the cap."""
    path = tmp_path / "region"
    holder = start()
    assert holder.ask(f"open {path}") == "ok" and holder.ask("charge 0 1000 100") == "ok 100"
    offset, kind = POISON[where]
    value = {"tid": holder.pid, "garbage": 0xDEADBEEFCAFEF00D, "claimed": 0xABCDEF << 8 | 2}[kind]
    poke(path, offset, value)
    other = start()
    opened = other.ask(f"open {path}", within=ANSWER_WITHIN)
    assert opened == "ok" or (opened.startswith(f"err region {path}") and "\n" not in opened), opened
    if opened == "ok":
        answer = other.ask("charge 0 1000 2000", within=ANSWER_WITHIN)
        assert answer.startswith("over "), answer  # more than the cap is never granted
        charged = other.ask("charge 0 1000 1", within=ANSWER_WITHIN)
        assert re.fullmatch(r"(ok|over) \d+", charged), charged
        other.ask("uncharge 0 1", within=ANSWER_WITHIN)
        other.ask("reclaim", within=ANSWER_WITHIN)
        assert holder.ask("charge 0 1000 1", within=ANSWER_WITHIN).split()[0] in ("ok", "over")
    assert path.stat().st_size == FILE_SIZE


def test_threads_race_cleanly_under_thread_sanitizer(core_bin: Path, tmp_path: Path) -> None:
    """20 threads in one process (more than its 15 lanes: the rest share the last one);
    ThreadSanitizer reports any data race, and the total ends at 0. One process only: TSan sees
    no other, and it emulates 16-byte atomics with a lock of its own process, so a TSan build
    must not share a region with another process (the plain and _san builds race across
    processes in test_region.py)."""
    path = tmp_path / "region"
    env = {**driver_env(), "TSAN_OPTIONS": "halt_on_error=1:exitcode=66"}
    p = subprocess.run([core_bin / "region_cli_tsan", "stress", path, "1000000", "20", "2", "1"],
                       capture_output=True, env=env, timeout=120, check=False)
    assert p.returncode == 0 and b"ThreadSanitizer" not in p.stderr, p.stderr.decode()[-3000:]
    assert re.fullmatch(rb"charges=\d+ refused=\d+ maxseen=\d+ bad=0\n", p.stdout), p.stdout
    with LineProc([core_bin / "region_cli", "repl"]) as tool:
        assert re.search(r"used0=0 .*procs=$", tool.ask(f"snapshot {path}"))


# --- threads of one process: frees on another thread than the charge ---


def lane_shares(data: bytes, slot: int) -> list[int]:
    """Every lane's share of every device in a slot, as stored."""
    base = LANE0 + slot * SLOT_SIZE
    return [x for k in range(16) for x in struct.unpack_from("<64Q", data, base + k * LANE_SIZE + 64)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_frees_on_another_thread_than_the_charge(repl: Repl, tmp_path: Path, variant: str) -> None:
    """A thread that frees what another charged takes its lane below zero; the process's share
    (the sum of its lanes) stays exact, a dead one is given back exactly, and a closed one
    leaves its slot with every lane at zero (free for the next process)."""
    path = tmp_path / "region"
    p, tool = repl(variant), repl()
    assert p.ask(f"open {path}") == "ok" and p.ask("charge 0 1000 300") == "ok 300"
    assert p.ask("tuncharge 0 100") == "left 0" and p.ask("tcharge 0 1000 50") == "ok 250"
    assert p.ask("tuncharge 0 500") == "left 250"  # clamped to what the process holds
    assert p.ask("tcharge 0 1000 250") == "ok 250"
    assert snap(tool, path)["procs"] == [(p.pid, 1, 250)]
    p.kill()
    survivor = repl()
    assert survivor.ask(f"open {path}") == "ok" and survivor.ask("used 0") == "0"
    assert survivor.ask("charge 0 1000 1000") == "ok 1000" and survivor.ask("uncharge 0 1000") == "left 0"
    assert survivor.ask("close") == "ok"

    q = repl(variant)
    assert q.ask(f"open {path}") == "ok" and q.ask("charge 1 1000 100") == "ok 100"
    assert q.ask("tuncharge 1 100") == "left 0"  # lanes +100 and -100: a share of 0
    assert q.ask("close") == "ok"
    data = path.read_bytes()
    assert not any(any(lane_shares(data, slot)) for slot in range(SLOTS))
    assert struct.unpack_from("<Q", data, OFF_USED0 + WORD_SIZE)[0] == 0  # device 1's total
