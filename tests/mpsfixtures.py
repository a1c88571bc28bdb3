"""Fixtures for the tests of the daemon, its lifecycle and the config: configs under tmp dirs for the real control binary
(``mps_control``, tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.lifecycle.health import HealthBoard
from mpsd.lifecycle.supervisor import Supervisor


@pytest.fixture
def mps_dirs(tmp_path_factory) -> tuple[Path, Path]:
    # Short paths: the pipe dir holds unix sockets (108-byte path limit).
    base = Path(tmp_path_factory.mktemp("m", numbered=True))
    return base / "pipe", base / "log"


@pytest.fixture
def make_config(mps_control, mps_dirs):
    pipe, logs = mps_dirs

    def make(**overrides) -> cfg.Config:
        values = {
            "control-binary": str(mps_control),
            "pipe-dir": str(pipe),
            "log-dir": str(logs),
            "metrics-address": "",
            "health-interval": "0.3s",
            "health-timeout": "2s",
            "restart-backoff-initial": "0.1s",
            "restart-backoff-max": "2s",
            "shutdown-timeout": "5s",
            "state-dir": str(pipe.parent / "state"),
        }
        values.update(overrides)
        return cfg.load(None, {}, values)

    return make


class Running:
    """A Supervisor run in a thread; stopped and joined at teardown."""

    def __init__(self, config: cfg.Config, **kwargs) -> None:
        self.board = HealthBoard()
        self.sup = Supervisor(config, self.board, **kwargs)
        self.result: list[object] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result.append(self.sup.run())
        except BaseException as exc:  # surfaced by the test
            self.result.append(exc)

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition"):
        """Wait on board changes until predicate(state) holds."""
        import time

        deadline = time.monotonic() + timeout
        state = self.board.current()
        while not predicate(state):
            left = deadline - time.monotonic()
            if left <= 0 or (self.result and not self.thread.is_alive()):
                raise AssertionError(
                    f"timed out waiting for {what}: state={state} status={self.sup.status()} result={self.result}"
                )
            state = self.board.wait_change(state.generation, min(left, 0.5))
        return state

    def stop(self, timeout: float = 30.0) -> None:
        self.sup.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "supervisor did not stop"


@pytest.fixture
def procs():
    """Processes a test starts: killed (if still running) and reaped at teardown."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture
def run_supervisor():
    started: list[Running] = []

    def start(config: cfg.Config, **kwargs) -> Running:
        r = Running(config, **kwargs)
        started.append(r)
        return r

    yield start
    for r in started:
        if r.thread.is_alive():
            r.stop()


class FrontEndHolder:
    """An interactive front-end left open (as an operator's ``nvidia-cuda-mps-control``
    session would be): the daemon serves one front-end at a time and refuses the others."""

    def __init__(self, binary: str, pipe_dir: str) -> None:
        import subprocess
        import time

        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir)
        deadline = time.monotonic() + 20
        self.proc = None
        while True:  # held once a one-shot front-end is refused while ours still runs
            if self.proc is None or self.proc.poll() is not None:  # refused itself: another one was in
                self.proc = subprocess.Popen(
                    [binary], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
                )
                time.sleep(0.1)
            probe = subprocess.run([binary], input="get_server_list\n", capture_output=True, text=True, env=env)
            if "Cannot send command" in probe.stdout + probe.stderr and self.proc.poll() is None:
                return
            assert time.monotonic() < deadline, "the front-end never took the connection"
            time.sleep(0.02)

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)
