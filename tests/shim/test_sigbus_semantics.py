"""A program's own SIGBUS handler behaves under the shim exactly as without it (issue 21,
defect 3): once a region is mapped the shim's guard is the kernel's SIGBUS disposition, and it
must hand the program's SIGBUS on with the kernel's semantics of SA_RESETHAND, SA_NODEFER,
sa_mask and SA_RESTART. Each case runs tests/shim/sigsem.c twice, without the shim and with it
(the region mapped), real SIGBUS from a truncated mapping, raise(SIGBUS) and a timer's SIGBUS;
what it prints and how it ends must be the same."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.shim.conftest import HERE, ShimEnv

FLAGS = [
    "none",
    "siginfo",
    "resethand",
    "siginfo+resethand",
    "nodefer",
    "resethand+nodefer",
    "mask",
    "siginfo+mask+nodefer",
    "reraise",
    "resethand+reraise",
    "siginfo+resethand+reraise",
    "resethand+nodefer+reraise",
    "nodefer+reraise",
    "mask+reraise",
]


@pytest.fixture(scope="module")
def sigsem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("sigsem") / "sigsem"
    cmd = ["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", str(HERE / "sigsem.c"), "-o", str(exe), "-ldl"]
    subprocess.run(cmd + ["-lrt"], check=True)
    return exe


def run(shim: ShimEnv, exe: Path, preload: bool, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one run; a run that does not end is a failure."""
    try:
        proc = subprocess.run(
            [str(exe), *args], env=shim.env("0=1G", preload=preload), capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"sigsem {' '.join(args)} {'with' if preload else 'without'} the shim never ended: {exc.stdout!r}")
    return proc.returncode, proc.stdout, proc.stderr


def same_with_and_without(shim: ShimEnv, exe: Path, *args: str) -> tuple[int, str]:
    bare = run(shim, exe, False, *args)
    shimmed = run(shim, exe, True, *args)
    assert "mapped=0" in bare[2] and "mapped=1" in shimmed[2], (bare[2], shimmed[2])  # the guard is in place
    assert shimmed[:2] == bare[:2], f"sigsem {' '.join(args)}: with the shim {shimmed[:2]}, without {bare[:2]}"
    return bare[:2]


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("trigger", ["fault", "raise"])
def test_a_programs_sigbus_handler_behaves_as_without_the_shim(
    shim: ShimEnv, sigsem: Path, order: str, flags: str, trigger: str
) -> None:
    same_with_and_without(shim, sigsem, order, flags, trigger)


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("flags", ["none", "restart", "siginfo+restart", "resethand+restart"])
def test_sa_restart_is_kept(shim: ShimEnv, sigsem: Path, order: str, flags: str) -> None:
    rc, out = same_with_and_without(shim, sigsem, order, flags, "restart")
    assert rc == 0 and ("read n=1 eintr=0" if "restart" in flags else "read n=-1 eintr=1") in out


# What the kernel does, spelled out (the comparison above would pass if both runs were wrong).


def test_sa_resethand_returning_from_a_fault_dies_of_sigbus(shim: ShimEnv, sigsem: Path) -> None:
    rc, out = same_with_and_without(shim, sigsem, "after", "resethand", "fault")
    assert rc == -signal.SIGBUS and out.count("enter") == 1 and "dfl_now=1" in out


def test_the_crash_reporter_pattern_dies_of_sigbus(shim: ShimEnv, sigsem: Path) -> None:
    # SA_RESETHAND, then raise(SIGBUS) in the handler: pending (SIGBUS is blocked in the
    # handler), delivered with the default action once it returns
    rc, out = same_with_and_without(shim, sigsem, "after", "resethand+reraise", "fault")
    assert rc == -signal.SIGBUS and out.splitlines() == [
        "enter n=1 depth=1 sig=7 code=99999 bus_blocked=1 usr1_blocked=0 dfl_now=1",
        "after-raise n=1",
    ]


def test_sa_nodefer_and_sa_mask_in_the_handler(shim: ShimEnv, sigsem: Path) -> None:
    rc, out = same_with_and_without(shim, sigsem, "after", "siginfo+mask+nodefer", "raise")
    assert rc == 0 and out.splitlines()[0] == "enter n=1 depth=1 sig=7 code=-6 bus_blocked=0 usr1_blocked=1 dfl_now=0"
    rc, out = same_with_and_without(shim, sigsem, "after", "nodefer+reraise", "raise")
    assert rc == 42 and "depth=3" in out  # raised again inside the handler: nested at once
