"""mpsd/lifecycle/standby.py's wait for the pipe dir's lock against a real holder process: whenever the
holder goes (SIGTERM, SIGKILL, between two tries or during one), the standby takes the lock;
stopped first, it takes nothing. Which mpsd may stand by at all. No daemon needed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.daemon import dirs
from mpsd.errors import PluginError
from mpsd.lifecycle.health import HealthBoard
from mpsd.lifecycle.standby import Standby, instance_of

REPO = Path(__file__).resolve().parents[2]
UID = "7c1e2d3f-4a5b-4c6d-9e8f-1a2b3c4d5e6f"
HOLD = ("import sys, time; from mpsd.daemon import dirs; dirs.hold_pipe_dir(sys.argv[1], sys.argv[2]); "
        "print('held', flush=True); time.sleep(600)")


@pytest.fixture
def pipe(tmp_path) -> Path:
    return tmp_path / "pipe"


def state(pipe: Path) -> str:
    return str(pipe.parent / "state")


def lock_file(pipe: Path) -> Path:
    return dirs.lock_path(state(pipe), str(pipe), "run")


def config(pipe: Path, **extra: str) -> cfg.Config:
    return cfg.load(None, {}, {"pipe-dir": str(pipe), "log-dir": str(pipe.parent / "log"), "state-dir": state(pipe),
                               "daemon-lifecycle": "independent", "health-interval": "0.2s", **extra})


def holder(pipe: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(pipe), state(pipe)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def standby_for(pipe: Path, poll: float = 0.2) -> Standby:
    with pytest.raises(dirs.PipeDirHeld) as held:
        dirs.hold_pipe_dir(str(pipe), state(pipe))
    return Standby(config(pipe), held.value, UID, poll=poll)


class Waiting:
    def __init__(self, standby: Standby) -> None:
        self.standby, self.result = standby, []
        self.thread = threading.Thread(target=lambda: self.result.append(standby.wait()), daemon=True)
        self.thread.start()

    def join(self, timeout: float = 30.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the standby did not end"
        return self.result[0]


def test_the_lock_is_taken_whenever_its_holder_goes(pipe):
    rng = random.Random(19)
    for round_ in range(12):
        proc = holder(pipe)
        standby = standby_for(pipe)
        try:
            waiting = Waiting(standby)
            time.sleep(rng.uniform(0, 0.5))  # before, between or during the standby's tries
            proc.send_signal(signal.SIGKILL if round_ % 2 else signal.SIGTERM)
            proc.wait(30)
            fd = waiting.join()
            assert fd is not None and fd == standby.fd, f"round {round_}"
            with pytest.raises(dirs.PipeDirHeld) as again:  # held now: by this process
                dirs.hold_pipe_dir(str(pipe), state(pipe))
            assert again.value.pid == os.getpid()
            dirs.release_pipe_dir(fd)
        finally:
            standby.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_stop_while_standing_by_takes_nothing(pipe):
    proc = holder(pipe)
    standby = standby_for(pipe, poll=60.0)  # a stop does not wait for the next try
    try:
        waiting = Waiting(standby)
        time.sleep(0.3)
        began = time.monotonic()
        standby.stop()
        assert waiting.join() is None and standby.fd is None
        assert time.monotonic() - began < 30  # not the minute until the next try (a loaded machine's margin)
        with pytest.raises(dirs.PipeDirHeld) as held:
            dirs.hold_pipe_dir(str(pipe), state(pipe))
        assert held.value.pid == proc.pid
    finally:
        standby.close()
        proc.kill()
        proc.wait()


def test_the_board_says_what_it_stands_by_for(pipe):
    proc = holder(pipe)
    standby = standby_for(pipe)
    try:
        board = HealthBoard()
        standby.attach(board)
        state = board.current()
        assert not state.daemon_up and not state.configured
        assert state.last_error.startswith(f"standing by for mpsd run pid {proc.pid} ")
        assert state.last_error.endswith(f": no control daemon on pipe dir {pipe}")
    finally:
        standby.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("lifecycle, environ, expected", [
    ("independent", {"POD_UID": UID}, UID),
    ("independent", {}, ""),
    ("independent", {"POD_UID": ""}, ""),
    ("owned", {"POD_UID": UID}, ""),
])
def test_who_may_stand_by(pipe, lifecycle, environ, expected):
    assert instance_of(config(pipe, **{"daemon-lifecycle": lifecycle}), environ) == expected


def test_a_malformed_pod_uid_is_refused(pipe):
    with pytest.raises(PluginError, match=r"^bad POD_UID '\.\./x': expected a pod UID"):
        instance_of(config(pipe), {"POD_UID": "../x"})


def test_readyz_waits_for_a_face_to_serve_not_only_for_it_not_to_have_failed(tmp_path, monkeypatch):
    """A standby is ready "while its faces serve": a face whose thread runs but whose sockets
    are not served yet (the DRA plugin reads its state and the API server first) is not ready."""
    import mpsd.plugin
    from mpsd.dra import service
    from mpsd.node import _ready, _start_dra, _start_plugin

    library = tmp_path / "libmpsshim.so"
    library.write_bytes(b"\x7fELF")
    config = cfg.load(None, {}, {"device-plugin": "true", "dra": "true", "shim-library": str(library)})
    board = HealthBoard()
    board.update(daemon_up=True, configured=True)
    go = {"device plugin": threading.Event(), "DRA plugin": threading.Event()}

    def runner(label: str):
        def run(config, *, stop, started=None, **kwargs):
            go[label].wait(30)
            assert started is not None
            started.set()
            stop.wait()

        return run

    monkeypatch.setattr(mpsd.plugin, "run_plugin", runner("device plugin"))
    monkeypatch.setattr(service, "run_dra", runner("DRA plugin"))
    stop = threading.Event()
    faces = [_start_plugin(config, board, None, list, stop), _start_dra(config, board, None, list, stop)]
    try:
        assert _ready(board, *faces) == (False, "device plugin starting")
        go["device plugin"].set()
        wait = time.monotonic() + 30
        while _ready(board, *faces)[1] == "device plugin starting" and time.monotonic() < wait:
            time.sleep(0.01)
        assert _ready(board, *faces) == (False, "DRA plugin starting")
        go["DRA plugin"].set()
        while not _ready(board, *faces)[0] and time.monotonic() < wait:
            time.sleep(0.01)
        assert _ready(board, *faces) == (True, "")
    finally:
        for event in go.values():
            event.set()
        stop.set()
        for face in faces:
            assert face.thread is not None
            face.thread.join(30)


BARE = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.readline()")


def test_a_lock_held_with_no_pid_in_it_does_not_stall_the_standby(pipe, monkeypatch):
    """A holder letting go truncates the file before it closes it (and a new one writes its PID
    only after it has the lock): a try in between finds the lock held and no PID. mpsd run's
    refusal waits for a PID to name (LOCK_PID_WAIT); the standby's tries must not, or it would
    take over that much later."""
    monkeypatch.setattr(dirs, "LOCK_PID_WAIT", 30.0)
    first = holder(pipe)
    standby = standby_for(pipe)
    first.kill()
    first.wait()
    bare = subprocess.Popen([sys.executable, "-c", BARE, str(lock_file(pipe))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert bare.stdout is not None and bare.stdout.readline() == "held\n"
        lock_file(pipe).write_text("")  # what release_pipe_dir leaves before its close
        waiting = Waiting(standby)
        time.sleep(0.5)
        began = time.monotonic()
        assert bare.stdin is not None
        bare.stdin.close()  # lets go
        bare.wait(30)
        fd = waiting.join(60)
        assert fd is not None and time.monotonic() - began < 10
        dirs.release_pipe_dir(fd)
    finally:
        standby.close()
        if bare.poll() is None:
            bare.kill()
            bare.wait()
