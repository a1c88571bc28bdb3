"""Crash consistency of the region (region_ops.h's argument), one window at a time: a fault-injection
build of the driver (MPSSHIM_FAULT=step) kills itself with SIGKILL at every step of claiming a
slot, charging, uncharging and repairing a dead slot (also while giving its own slot back on
close). A survivor then repairs what it left, without waiting on anyone: the total comes back to
exactly what the living hold, and the cap holds to the byte."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.conftest import LineProc

CAP = 1000
MINE = 100  # what the survivor holds throughout


@pytest.fixture
def start(core_bin: Path) -> Iterator:
    procs: list[LineProc] = []

    def run(variant: str = "", fault: str | None = None) -> LineProc:
        env = {"MPSSHIM_FAULT": fault} if fault else None
        p = LineProc([core_bin / f"region_cli{variant}", "repl"], extra_env=env)
        procs.append(p)
        return p

    yield run
    for p in procs:
        if p.proc.poll() is None:
            p.kill()
        else:
            p.close()


def dies_of_sigkill(p: LineProc, line: str) -> None:
    with pytest.raises(AssertionError, match="died"):
        p.ask(line)
    assert p.proc.returncode == -signal.SIGKILL


def survivor_sees_exactly_its_own(survivor: LineProc, path: Path) -> None:
    survivor.ask("reclaim")
    assert survivor.ask("used 0") == str(MINE)
    line = survivor.ask(f"snapshot {path}")
    assert line.endswith(f"procs={survivor.ask('pid')}:1:{MINE}"), line  # no slot left claimed by the dead
    assert survivor.ask(f"charge 0 {CAP} {CAP - MINE}") == f"ok {CAP}"  # all the rest, to the byte
    assert survivor.ask(f"charge 0 {CAP} 1") == f"over {CAP}"
    assert survivor.ask(f"uncharge 0 {CAP}") == "left 0" and survivor.ask("used 0") == "0"


def with_survivor(start, path: Path) -> LineProc:
    s = start()
    assert s.ask(f"open {path}") == "ok" and s.ask(f"charge 0 {CAP} {MINE}") == f"ok {MINE}"
    return s


@pytest.mark.parametrize("step", ["claim.marked", "claim.locked", "claim.done"])
def test_killed_while_claiming_a_slot(start, tmp_path: Path, step: str) -> None:
    path = tmp_path / "region"
    survivor = with_survivor(start, path)
    victim = start("_fault", step)
    dies_of_sigkill(victim, f"open {path}")
    survivor_sees_exactly_its_own(survivor, path)


@pytest.mark.parametrize("overwritten", [False, True], ids=["tag-kept", "tag-overwritten"])
@pytest.mark.parametrize("step", ["charge.announced", "charge.applied", "charge.folded"])
def test_killed_inside_a_charge(start, tmp_path: Path, step: str, overwritten: bool) -> None:
    """With the tag overwritten (another process charged since), the survivor can only tell that
    the dead charge reached the total from the mark the overwriting process left ("helping")."""
    path = tmp_path / "region"
    survivor = with_survivor(start, path)
    victim = start("_fault", f"{step}:2")  # the second charge dies; the first one is held
    assert victim.ask(f"open {path}") == "ok" and victim.ask(f"charge 0 {CAP} 200") == "ok 300"
    dies_of_sigkill(victim, f"charge 0 {CAP} 300")
    if overwritten:  # a charge that fits reclaims nothing: it only overwrites the tag
        assert survivor.ask(f"charge 0 {CAP} 1").startswith("ok ") and survivor.ask("uncharge 0 1") == "left 0"
    survivor_sees_exactly_its_own(survivor, path)


@pytest.mark.parametrize("step", ["uncharge.announced", "uncharge.applied", "uncharge.folded"])
def test_killed_inside_an_uncharge(start, tmp_path: Path, step: str) -> None:
    path = tmp_path / "region"
    survivor = with_survivor(start, path)
    victim = start("_fault", step)
    assert victim.ask(f"open {path}") == "ok" and victim.ask(f"charge 0 {CAP} 500") == "ok 600"
    dies_of_sigkill(victim, "uncharge 0 200")
    survivor_sees_exactly_its_own(survivor, path)


REPAIR_STEPS = ["repair.locked", "repair.resolved", "repair.announced", "repair.applied", "repair.folded",
                "repair.freed"]


def dead_with_an_operation_in_flight(start, path: Path) -> None:
    """A process killed between the compare-and-swap of its second charge and the fold: its
    lane says 200, the total counts 500 for it."""
    dead = start("_fault", "charge.applied:2")
    assert dead.ask(f"open {path}") == "ok" and dead.ask(f"charge 0 {CAP} 200") == "ok 300"
    dies_of_sigkill(dead, f"charge 0 {CAP} 300")


@pytest.mark.parametrize("step", REPAIR_STEPS)
def test_killed_while_repairing_a_dead_slot(start, tmp_path: Path, step: str) -> None:
    path = tmp_path / "region"
    survivor = with_survivor(start, path)
    dead_with_an_operation_in_flight(start, path)
    repairer = start("_fault", step)
    dies_of_sigkill(repairer, f"open {path}")  # opening reclaims the dead slot first
    survivor_sees_exactly_its_own(survivor, path)


# (first repairer's step, second's): a first killed with its give-back in flight leaves the
# second something to resolve; one killed after resolving leaves it the rest of the repair.
PAIRS = [("repair.resolved", "repair.freed"), ("repair.announced", "repair.resolved"),
         ("repair.applied", "repair.resolved"), ("repair.folded", "repair.resolved"),
         ("repair.applied", "repair.freed")]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_repairers_killed_in_turn_compose(start, tmp_path: Path, first: str, second: str) -> None:
    path = tmp_path / "region"
    survivor = with_survivor(start, path)
    dead_with_an_operation_in_flight(start, path)
    for step in (first, second):
        dies_of_sigkill(start("_fault", step), f"open {path}")
    survivor_sees_exactly_its_own(survivor, path)


@pytest.mark.parametrize("step", ["repair.announced", "repair.applied", "repair.folded", "repair.freed"])
def test_killed_while_giving_its_own_slot_back_on_close(start, tmp_path: Path, step: str) -> None:
    path = tmp_path / "region"
    survivor = with_survivor(start, path)
    victim = start("_fault", step)
    assert victim.ask(f"open {path}") == "ok" and victim.ask(f"charge 0 {CAP} 400") == "ok 500"
    assert victim.ask(f"charge 1 {CAP} 50") == "ok 50"  # a second device: the give-back has two operations
    dies_of_sigkill(victim, "close")
    survivor_sees_exactly_its_own(survivor, path)
    assert survivor.ask("used 1") == "0"


def test_without_the_variable_the_fault_build_behaves(start, tmp_path: Path) -> None:
    p = start("_fault")
    assert p.ask(f"open {tmp_path / 'r'}") == "ok" and p.ask("charge 0 10 10") == "ok 10"
    assert p.ask("uncharge 0 10") == "left 0" and p.ask("close") == "ok"


SLOT_SIZE, LANE_PKIND = 128 + 16 * (128 + 8 * 64 + 16 * 8), 128 + 8  # region.h: ms_slot, lane 0's pkind
OFF_SLOTS, OP_REPAIR = 128 + 136 * 64, 2


def test_a_slot_repaired_and_claimed_again_has_its_new_owners_charges_repaired_as_charges(
    start, tmp_path: Path
) -> None:
    """A repair announces its give-back on the dead slot's lane 0 (kind MS_OP_REPAIR) and leaves
    it there. The next process to claim the slot charges on that lane without writing the kind
    on every charge (region_fast.h): taking the lane resets it, or its own operation killed in
    flight would be resolved as a repair (every share zeroed, nothing given back)."""
    path = tmp_path / "region"
    survivor = with_survivor(start, path)  # slot 0
    dead_with_an_operation_in_flight(start, path)  # slot 1
    assert survivor.ask("reclaim") == "1"
    with path.open("rb") as f:
        f.seek(OFF_SLOTS + SLOT_SIZE + LANE_PKIND)
        assert int.from_bytes(f.read(4), "little") == OP_REPAIR  # what the repair left on slot 1
    again = start("_fault", "charge.applied:2")  # claims slot 1, the first free one
    assert again.ask(f"open {path}") == "ok" and again.ask(f"charge 0 {CAP} 200") == "ok 300"
    dies_of_sigkill(again, f"charge 0 {CAP} 300")
    survivor_sees_exactly_its_own(survivor, path)
