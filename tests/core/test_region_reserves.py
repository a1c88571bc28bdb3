"""Reserves (issue 32, region_ops.h "Reserves"): a thread's headroom taken from the device's word in
a batch, charged and freed without touching that word, and taken back without its holder's help
(idle, stopped mid-operation, or dead) whenever a charge would otherwise be refused, so that the
cap stays exact. Crash consistency of every step of it (fault-injection build, MPSSHIM_FAULT) as
for the rest of the protocol (test_region_faults.py): the file read after each scenario must
count, to the byte, what the living hold, and a new process's open (which checks the totals
invariant, reserves included) must accept it."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.core.conftest import VARIANTS, LineProc, driver_env
from tests.core.test_region import LANE_SIZE, OFF_SLOTS, OFF_USED0, SLOT_SIZE, SLOTS
from tests.core.test_region_faults import dies_of_sigkill as dies

MIB = 1 << 20
BATCH, NEAR = 4 * MIB, 64 * MIB  # region_ops.h: MS_BATCH, MS_NEAR
CAP = 128 * MIB  # room for batches (a charge takes one while MS_NEAR stays free)
SMALL = 4096
OFF_RSV = 64 + 8 * 64  # ms_lane.rsv, after the owner's line and share[64]


def counted(path: Path, dev: int = 0) -> int:
    """The device's word: what is charged to allocations plus every reserve."""
    return struct.unpack_from("<Q", path.read_bytes(), OFF_USED0 + 128 * dev)[0]


def reserves(path: Path, dev: int = 0) -> int:
    data = path.read_bytes()
    return sum(
        struct.unpack_from("<Q", data, OFF_SLOTS + s * SLOT_SIZE + 128 + k * LANE_SIZE + OFF_RSV + 16 * dev)[0]
        for s in range(SLOTS)
        for k in range(16)
    )


def wait_stopped(p: LineProc, line: str) -> None:
    """Send `line` and wait until the driver stopped itself at its fault point (":stop")."""
    assert p.proc.stdin is not None
    p.proc.stdin.write(f"{line}\n".encode())
    p.proc.stdin.flush()
    deadline = time.monotonic() + 20
    while not re.search(r"^State:\s+T", Path(f"/proc/{p.pid}/status").read_text(), re.MULTILINE):
        assert time.monotonic() < deadline, "the driver never stopped at its fault point"
        time.sleep(0.01)


def exact(start, survivor: LineProc, path: Path, mine: int) -> None:
    """The survivor holds `mine`; after a reclaim nothing else is counted but reserves, every
    one of them can be taken back (all the rest of the cap goes to one charge, to the byte), and
    the file's totals agree with its lanes (a new process's open checks them)."""
    survivor.ask("reclaim")
    assert survivor.ask("used 0") == str(mine)
    assert survivor.ask(f"charge 0 {CAP} {CAP - mine}") == f"ok {CAP}"
    assert survivor.ask(f"charge 0 {CAP} 1") == f"over {CAP}"
    assert counted(path) == CAP and reserves(path) == 0
    assert survivor.ask(f"uncharge 0 {CAP - mine}") == "left 0" and survivor.ask("used 0") == str(mine)
    checker = start()
    assert checker.ask(f"open {path}") == "ok", "the totals invariant does not hold"
    assert checker.ask("used 0") == str(mine) and counted(path) == mine + reserves(path)


def test_a_small_charge_takes_a_batch_and_its_frees_park_there(start, tmp_path: Path) -> None:
    path = tmp_path / "region"
    p = start()
    assert p.ask(f"open {path}") == "ok"
    assert p.ask(f"charge 0 {CAP} {SMALL}") == f"ok {SMALL}"  # in use: reserves are not
    assert counted(path) == SMALL + BATCH and reserves(path) == BATCH
    assert p.ask(f"charge 0 {CAP} {SMALL}") == f"ok {2 * SMALL}"
    assert p.ask(f"uncharge 0 {SMALL}") == "left 0"
    assert counted(path) == SMALL + BATCH and reserves(path) == BATCH  # neither touched the word
    assert p.ask(f"snapshot {path}").startswith(f"ok version=3 nprocs=1 cap0={CAP} used0={SMALL} ")
    assert p.ask(f"charge 0 {CAP} {2 * BATCH}") == f"ok {SMALL + 2 * BATCH}"  # above a batch: exact
    assert counted(path) == SMALL + 3 * BATCH


def test_no_batch_near_the_cap(start, tmp_path: Path) -> None:
    path = tmp_path / "region"
    p = start()
    assert p.ask(f"open {path}") == "ok"
    cap = NEAR + 2 * BATCH - 1  # a batch would leave less than MS_NEAR free
    assert p.ask(f"charge 0 {cap} {SMALL}") == f"ok {SMALL}" and counted(path) == SMALL
    assert p.ask(f"uncharge 0 {SMALL}") == "left 0" and counted(path) == 0  # an empty reserve keeps no free


def test_a_thread_gives_its_reserve_back_when_it_exits(start, tmp_path: Path) -> None:
    path = tmp_path / "region"
    p = start()
    assert p.ask(f"open {path}") == "ok"
    assert p.ask(f"tcharge 0 {CAP} {SMALL}") == f"ok {SMALL}"  # on a thread that then exits
    assert counted(path) == SMALL and reserves(path) == 0
    assert p.ask(f"uncharge 0 {SMALL}") == "left 0" and counted(path) == 0


@pytest.mark.parametrize("stopped", [False, True], ids=["idle", "stopped"])
def test_an_idle_or_stopped_holders_reserve_is_taken_back_at_the_cap(start, tmp_path: Path, stopped: bool) -> None:
    path = tmp_path / "region"
    holder, other = start(), start()
    assert holder.ask(f"open {path}") == "ok" and holder.ask(f"charge 0 {CAP} {SMALL}") == f"ok {SMALL}"
    assert reserves(path) == BATCH
    if stopped:
        os.kill(holder.pid, signal.SIGSTOP)
    assert other.ask(f"open {path}") == "ok"
    assert other.ask(f"charge 0 {CAP} {CAP - SMALL}", within=10) == f"ok {CAP}"  # all the rest, to the byte
    assert other.ask(f"charge 0 {CAP} 1", within=10) == f"over {CAP}"
    assert reserves(path) == 0
    if stopped:
        os.kill(holder.pid, signal.SIGCONT)
    assert holder.ask(f"charge 0 {CAP} {SMALL}") == f"over {CAP}"  # its reserve is gone: exact path, refused
    assert other.ask(f"uncharge 0 {CAP - SMALL}") == "left 0"
    assert holder.ask(f"charge 0 {CAP} {SMALL}") == f"ok {2 * SMALL}"


def test_racing_large_charges_are_exact_while_others_hold_reserves(start, tmp_path: Path) -> None:
    """Six racing 1 GiB charges under 3 GiB plus what three idle holders have charged: exactly
    three succeed, though the holders' reserves (3 batches) are counted when the race starts."""
    path = tmp_path / "region"
    cap, gib = (3 << 30) + 3 * SMALL, 1 << 30
    holders = [start() for _ in range(3)]
    for h in holders:
        assert h.ask(f"open {path}") == "ok" and h.ask(f"charge 0 {cap} {SMALL}").startswith("ok ")
    assert reserves(path) == 3 * BATCH
    racers = [start() for _ in range(6)]
    for r in racers:
        assert r.ask(f"open {path}") == "ok"
    for r in racers:
        assert r.proc.stdin is not None
        r.proc.stdin.write(f"charge 0 {cap} {gib}\n".encode())
        r.proc.stdin.flush()
    answers = [r.proc.stdout.readline().decode().split()[0] for r in racers if r.proc.stdout is not None]
    assert sorted(answers) == ["ok"] * 3 + ["over"] * 3
    assert counted(path) == cap and reserves(path) == 0


# --- crash consistency: killed at each step of the reserve protocol ---


def holding(start, path: Path) -> LineProc:
    """The survivor: SMALL charged (and a batch in its reserve, which the scenarios may take)."""
    s = start()
    assert s.ask(f"open {path}") == "ok" and s.ask(f"charge 0 {CAP} {SMALL}") == f"ok {SMALL}"
    return s


@pytest.mark.parametrize("step", ["deposit.announced", "deposit.applied", "deposit.folded"])
def test_killed_depositing_a_batch(start, tmp_path: Path, step: str) -> None:
    path = tmp_path / "region"
    survivor = holding(start, path)
    victim = start(variant="_fault", fault=step)
    assert victim.ask(f"open {path}") == "ok"
    dies(victim, f"charge 0 {CAP} {SMALL}")
    exact(start, survivor, path, SMALL)


@pytest.mark.parametrize(
    ("step", "line"),
    [(f"reserve.{s}", f"charge 0 {CAP} {SMALL}") for s in ("announced", "applied", "folded")]
    + [(f"park.{s}", f"uncharge 0 {SMALL}") for s in ("announced", "applied", "folded")],
)
def test_killed_charging_from_its_reserve_or_parking_a_free_in_it(start, tmp_path: Path, step: str, line: str) -> None:
    path = tmp_path / "region"
    survivor = holding(start, path)
    victim = start(variant="_fault", fault=step)
    assert victim.ask(f"open {path}") == "ok" and victim.ask(f"charge 0 {CAP} {SMALL}") == f"ok {2 * SMALL}"
    dies(victim, line)  # a second charge comes from the reserve the first took; a free parks there
    exact(start, survivor, path, SMALL)


@pytest.mark.parametrize(
    "step", ["take.announced", "take.applied", "take.folded", "return.announced", "return.applied", "return.folded"]
)
def test_killed_taking_anothers_reserve_back(start, tmp_path: Path, step: str) -> None:
    """The victim needs the survivor's reserve for a charge and dies taking it (its share holds
    it, or the survivor's reserve still does, or the device's word has it back): whichever,
    the repair of the victim's slot leaves exactly what the survivor holds."""
    path = tmp_path / "region"
    survivor = holding(start, path)
    victim = start(variant="_fault", fault=step)
    assert victim.ask(f"open {path}") == "ok"
    dies(victim, f"charge 0 {CAP} {CAP - SMALL}")
    exact(start, survivor, path, SMALL)


@pytest.mark.parametrize("step", ["reserve.applied", "reserve.folded"])
def test_a_stopped_holders_operation_on_its_reserve_is_helped_before_the_reserve_is_taken(
    start, tmp_path: Path, step: str
) -> None:
    """The holder stops right after its compare-and-swap on its reserve (before or after the
    fold), another process takes the rest of that reserve back (overwriting the holder's tag:
    it must record first that the holder's operation reached the word), then the holder dies
    there. Its repairer can tell the operation reached the reserve only from that mark."""
    path = tmp_path / "region"
    survivor = start()
    assert survivor.ask(f"open {path}") == "ok"
    holder = start(variant="_fault", fault=f"{step}:stop")
    assert holder.ask(f"open {path}") == "ok" and holder.ask(f"charge 0 {CAP} {SMALL}") == f"ok {SMALL}"
    wait_stopped(holder, f"charge 0 {CAP} {SMALL}")  # from its reserve: stops mid-operation
    assert survivor.ask(f"charge 0 {CAP} {CAP - 2 * SMALL}", within=10) == f"ok {CAP}"
    os.kill(holder.pid, signal.SIGKILL)
    holder.kill()
    assert survivor.ask(f"uncharge 0 {CAP - 2 * SMALL}") == "left 0"
    exact(start, survivor, path, 0)


@pytest.mark.parametrize("step", ["repair.drained", "take.applied", "take.folded"])
def test_killed_draining_a_dead_slots_reserves(start, tmp_path: Path, step: str) -> None:
    """A dead process's reserves are taken into its slot's lane 0 before its shares go back; a
    repairer killed in the middle leaves that to the next one."""
    path = tmp_path / "region"
    survivor = holding(start, path)
    dead = start()
    assert dead.ask(f"open {path}") == "ok" and dead.ask(f"charge 0 {CAP} {SMALL}") == f"ok {2 * SMALL}"
    assert dead.ask(f"charge 1 {CAP} {SMALL}") == f"ok {SMALL}"  # reserves on two devices
    dead.kill()
    dies(start(variant="_fault", fault=step), f"open {path}")  # opening reclaims the dead slot first
    exact(start, survivor, path, SMALL)
    assert survivor.ask("used 1") == "0" and counted(path, 1) == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_threads_and_processes_with_reserves_never_pass_the_cap(
    start, core_bin: Path, tmp_path: Path, variant: str
) -> None:
    """4 processes x 4 threads charge (1 byte to 1 MiB: batches while 64 MiB are free) and free
    at random for 2 s under a 128 MiB cap (which they would fill four times over), beside an idle
    holder with a batch in its reserve: the device's word itself (reserves included) never passes
    the cap, the refusals took the idle reserve back, and everything else is back at the end."""
    path = tmp_path / "region"
    holder = holding(start, path)
    workers = [
        subprocess.Popen(
            [core_bin / f"region_cli{variant}", "stress", path, str(CAP), "4", "2", str(seed), str(MIB)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=driver_env(),
        )
        for seed in range(4)
    ]
    polls = 0
    while any(w.poll() is None for w in workers):
        assert counted(path) <= CAP
        polls += 1
        time.sleep(0.005)
    charges = refused = 0
    for w in workers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err.decode()
        m = re.fullmatch(rb"charges=(\d+) refused=(\d+) maxseen=(\d+) bad=0\n", out)
        assert m is not None, out
        charges, refused = charges + int(m[1]), refused + int(m[2])
    assert charges > 1000 and refused > 0 and polls > 10  # contended
    assert counted(path) == SMALL and reserves(path) == 0 and holder.ask("used 0") == str(SMALL)
