"""Threads racing on one cuMemCreate handle (release against unmap, retain-and-release against
unmap, release against map, a racing double release): the charge follows the driver's own
lifetime of the memory, so the region never counts less than the driver holds (no early
uncharge) and returns to exactly 0 (no leak). The fake driver frees a handle's memory by the real
rule: no reference left (cuMemCreate's, one per cuMemRetainAllocationHandle, less one per
cuMemRelease) and no mapping."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .conftest import CSRC, HERE, ShimEnv


@pytest.fixture(scope="module")
def vmmrace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("vmmrace") / "vmmrace"
    cmd = ["cc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", str(HERE / "vmmrace.c")]
    subprocess.run([*cmd, "-o", str(exe), "-ldl", "-lpthread"], check=True)
    return exe


def race(shim: ShimEnv, exe: Path, mode: str, threads: int, rounds: int) -> dict[str, int]:
    env = shim.env("0=1G", {"MPSSHIM_LOG": "0"})
    proc = subprocess.run(
        [str(exe), mode, str(threads), str(rounds), "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return {k: int(v) for k, v in (f.split("=") for f in proc.stdout.split()[1:])}


def agree(got: dict[str, int]) -> dict[str, int]:
    """What must be 0 in every race: rounds where the region and the driver disagreed after the
    race (mid) and after cleaning up (end), samples with the region below the driver, what is left."""
    assert got["samples"] > 0
    return {k: got[k] for k in ("mid", "end", "premature", "driver_used", "region_used")}


ZERO = {"mid": 0, "end": 0, "premature": 0, "driver_used": 0, "region_used": 0}
ROUNDS = 20000


def test_release_racing_unmap(shim: ShimEnv, vmmrace: Path) -> None:
    got = race(shim, vmmrace, "release-unmap", 2, ROUNDS)
    assert agree(got) == ZERO
    assert (got["ok"], got["failed"]) == (2 * ROUNDS, 0)


@pytest.mark.parametrize("threads", [3, 5])
def test_retains_and_releases_racing_unmap(shim: ShimEnv, vmmrace: Path, threads: int) -> None:
    got = race(shim, vmmrace, "retain-release", threads, ROUNDS)
    assert agree(got) == ZERO
    assert got["ok"] >= ROUNDS  # every unmap; retains that came first released what they took


def test_release_racing_map(shim: ShimEnv, vmmrace: Path) -> None:
    got = race(shim, vmmrace, "release-map", 2, ROUNDS)
    assert agree(got) == ZERO
    assert got["ok"] >= ROUNDS  # every release; the map when it came first


@pytest.mark.parametrize("threads", [2, 4])
def test_racing_double_release(shim: ShimEnv, vmmrace: Path, threads: int) -> None:
    got = race(shim, vmmrace, "release-release", threads, ROUNDS)
    assert agree(got) == ZERO
    assert (got["ok"], got["failed"]) == (ROUNDS, ROUNDS * (threads - 1))
