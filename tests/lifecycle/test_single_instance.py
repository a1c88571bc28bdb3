"""One ``mpsd run`` per pipe directory: a second one exits 1 with one line, however close the
two starts are, and never takes the daemon over later. Real processes, the real daemon."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsd.daemon.control import Control
from mpsd.errors import MpsdError
from tests.procs import control_daemons

pytestmark = pytest.mark.mps_binary
REPO = Path(__file__).resolve().parents[2]
ROUNDS = 6
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) mpsd\.")  # e.g. a chmod logged


def mpsd_run(mps_control: Path, pipe: Path, logs: Path) -> subprocess.Popen[str]:
    args = [
        f"--control-binary={mps_control}",
        f"--pipe-dir={pipe}",
        f"--log-dir={logs}",
        f"--state-dir={pipe.parent / 'state'}",
        "--metrics-address=",
        "--health-interval=0.3s",
        "--restart-backoff-initial=0.1s",
        "--log-level=warning",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "mpsd", "run", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def daemons_of(proc: subprocess.Popen[str]) -> list[int]:
    return [d.pid for d in control_daemons(proc.pid)]


def serves(control: Control) -> bool:
    try:
        control.get_server_list()
        return True
    except MpsdError:
        return False


def test_two_runs_started_at_once_leave_exactly_one(mps_control, mps_dirs):
    pipe, logs = mps_dirs
    for round_ in range(ROUNDS):
        pair = [mpsd_run(mps_control, pipe, logs), mpsd_run(mps_control, pipe, logs)]
        winner = None
        try:
            deadline = time.monotonic() + 30
            while all(p.poll() is None for p in pair):
                assert time.monotonic() < deadline, f"round {round_}: both mpsd run are still running"
                time.sleep(0.05)
            loser = next(p for p in pair if p.poll() is not None)
            winner = next(p for p in pair if p is not loser)
            code, err = stop(loser)
            lines = [line for line in err.strip().splitlines() if not LOG_RECORD.match(line)]
            assert code == 1 and len(lines) == 1, (round_, code, err)
            assert lines[0].startswith(f"mpsd: pipe dir {pipe}: another mpsd run (pid {winner.pid}) ")
            control = Control(str(mps_control), str(pipe), timeout=20)
            while not serves(control):  # the winner's daemon comes up
                assert time.monotonic() < deadline and winner.poll() is None, f"round {round_}: no daemon"
                time.sleep(0.05)
        finally:
            results = [stop(p) for p in pair]
        assert winner is not None and results[pair.index(winner)][0] == 0, results


def test_a_second_run_refused_while_the_first_restarts_its_daemon(mps_control, mps_dirs):
    pipe, logs = mps_dirs
    first = mpsd_run(mps_control, pipe, logs)
    try:
        control = Control(str(mps_control), str(pipe), timeout=20)
        deadline = time.monotonic() + 60
        while not (daemons := daemons_of(first)) or not serves(control):
            assert time.monotonic() < deadline and first.poll() is None, "no daemon"
            time.sleep(0.05)
        daemon = daemons[0]
        second = mpsd_run(mps_control, pipe, logs)
        os.kill(daemon, signal.SIGKILL)  # the first mpsd restarts it; the second must not
        try:
            second.wait(30)
        except subprocess.TimeoutExpired:
            pass
        code, err = stop(second)
        assert code == 1 and "another mpsd run" in err, err
        deadline = time.monotonic() + 60
        while not serves(control) or daemon in daemons_of(first):
            assert time.monotonic() < deadline, "the first mpsd did not restart its daemon"
            time.sleep(0.05)
        assert first.poll() is None
    finally:
        code, err = stop(first)
    assert code == 0, err


def test_a_planted_pipe_dir_stops_mpsd_run_with_one_line(mps_control, mps_dirs):
    pipe, logs = mps_dirs
    target = pipe.parent / "elsewhere"
    target.mkdir()
    pipe.symlink_to(target)
    proc = mpsd_run(mps_control, pipe, logs)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    code, err = stop(proc)  # still running: stopped, and the assertion below fails
    lines = [line for line in err.strip().splitlines() if not LOG_RECORD.match(line)]
    assert code == 1 and lines == [
        f"mpsd: pipe dir {pipe}: a symbolic link; expected a directory, not a link to one: use the real path"
    ], err
    assert not any(target.iterdir())  # no lock, no daemon files
