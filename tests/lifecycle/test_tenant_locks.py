"""Locks a tenant can take never decide who keeps the daemon (issue 33, rows 1 and 2), run as
the attacks run: real ``mpsd run`` and ``mpsd holder`` processes, the real daemon of each
Debian version, a root pod (podman) with the pipe dir mounted read-only as Allocate mounts it,
and a local user of UID 1000.

- Row 1: root in a pod blocks in ``flock`` (and in a POSIX read lock) on every file of the pipe
  dir it can open read-only. A handover (the old mpsd run of a rollout goes, the holder is
  replaced) still ends with one mpsd supervising, which notices a hung daemon.
- Row 2: UID 1000 opens the 0666 ``control_lock`` and waits for its write lock until the daemon
  dies once. The waiter is no daemon: its lock is nobody's, and a new daemon starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import psutil
import pytest

from tests.daemon.test_pipe_dir_readonly import PYTHON, allocate_mounts
from tests.container import HOST_LIBS, Mount
from tests.rollout import Node, free_port, read, stop, wait_until

pytestmark = [pytest.mark.mps_binary, pytest.mark.every_mps_version]
OLD, NEW = "0b5e8c3a-1f2d-4c6e-9a7b-3d2e1f0a9b8c", "7c1e2d3f-4a5b-4c6d-9e8f-1a2b3c4d5e6f"

POD_LOCKS = r"""
import fcntl, os, sys, threading, time
pipe, signals = sys.argv[1:3]
taken = []

def hold(path, how):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if how == "lockf":
            fcntl.lockf(fd, fcntl.LOCK_SH)  # a POSIX read lock: blocks a write lock
        else:
            fcntl.flock(fd, fcntl.LOCK_EX if how == "flock-ex" else fcntl.LOCK_SH)
    except OSError:
        return
    taken.append(f"{how} {path}")
    threading.Event().wait()

for root, _, files in os.walk(pipe):
    for name in files:
        path = os.path.join(root, name)
        if os.path.isfile(path) and not os.path.islink(path):
            for how in ("flock-ex", "flock-sh", "lockf"):
                threading.Thread(target=hold, args=(path, how), daemon=True).start()
open(os.path.join(signals, "ready"), "w").close()
deadline = time.monotonic() + 300
while not os.path.exists(os.path.join(signals, "release")) and time.monotonic() < deadline:
    time.sleep(0.1)
print("\n".join(taken))
"""


@pytest.fixture
def node(mps_control, tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("t"), mps_control)
    yield n
    n.close()


def pod(uid: str) -> dict[str, str]:
    return {"POD_UID": uid}


def parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def holders_daemon(node: Node, holder: subprocess.Popen, *not_these: int | None) -> int | None:
    """The daemon holding control_lock once it is the holder's child and none of ``not_these``."""
    pid = node.daemon_pid()
    return pid if pid not in (None, *not_these) and parent(pid) == holder.pid else None  # type: ignore[operator]


class LockingPod:
    """A root pod blocking in every lock it can take on the pipe dir's files, in a thread."""

    def __init__(self, podman, node: Node, tmp_path) -> None:
        self.signals = tmp_path / "signals"
        self.signals.mkdir(mode=0o777)
        mounts = [*allocate_mounts(node.pipe, tmp_path), *HOST_LIBS, Mount(PYTHON, PYTHON),
                  Mount(self.signals, "/signals", read_only=False)]  # fmt: skip
        self.result: list = []
        argv = [PYTHON, "-c", POD_LOCKS, str(node.pipe), "/signals"]
        self.thread = threading.Thread(target=lambda: self.result.append(
            podman.run(argv, mounts=mounts, timeout=400)), daemon=True)  # fmt: skip
        self.thread.start()
        wait_until(lambda: (self.signals / "ready").exists() or not self.thread.is_alive(), "the pod's locks", 120)
        assert self.thread.is_alive(), self.result[0].output if self.result else "the pod ended"

    def release(self) -> str:
        (self.signals / "release").touch()
        self.thread.join(120)
        assert self.result and self.result[0].returncode == 0, self.result[0].output if self.result else "no result"
        return self.result[0].stdout


def test_a_pod_blocking_in_every_lock_of_the_pipe_dir_cannot_win_a_handover(podman, node, tmp_path):
    holder = node.spawn("holder")
    first = wait_until(node.daemon_pid, "the holder's daemon")
    old, _ = node.start_timed(pod(OLD))
    locks = LockingPod(podman, node, tmp_path)
    try:
        port = free_port()
        new, _ = node.start_timed(pod(NEW), port=port)  # stands by: the old one supervises
        assert node.metric("mpsd_standby", port) == {"": 1.0}
        assert stop(old) == 0
        wait_until(lambda: "this mpsd supervises the daemon now" in read(new), "the new mpsd to take over", 60)
        assert node.metric("mpsd_standby", port) == {"": 0.0}
        os.kill(first, signal.SIGSTOP)  # hung: the supervisor notices, kills it, the holder starts another
        second = wait_until(lambda: holders_daemon(node, holder, first), "the hung daemon replaced", 90)
        wait_until(lambda: node.ready(port) and node.defaults()[0] == 50, "the new mpsd on the new daemon")
        assert f"daemon pid={first} hung" in read(new)
        assert stop(holder) == 0  # the holder replaced too, the pod still blocking
        again = node.spawn("holder")
        wait_until(lambda: holders_daemon(node, again, first, second), "the new holder's daemon", 60)
        wait_until(lambda: node.ready(port), "the new mpsd on the new holder's daemon")
    finally:
        taken = locks.release()
    assert taken, "the pod took no lock at all: the attack did not run"


WAITER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)  # control_lock is 0666
print("waiting", flush=True)
fcntl.lockf(fd, fcntl.LOCK_EX)  # F_SETLKW: until the daemon exits
print("locked", flush=True)
sys.stdin.readline()
"""


def waiter(control_lock: str) -> subprocess.Popen[str]:
    """A process of UID 1000 waiting for the write lock on ``control_lock``."""
    proc = subprocess.Popen(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "/usr/bin/python3", "-c",
                             WAITER, control_lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
    return proc


def test_a_local_user_waiting_for_control_lock_is_no_daemon_to_the_holder(node, procs):
    holder = node.spawn("holder")
    first = wait_until(node.daemon_pid, "the holder's daemon")
    run, _ = node.start_timed()
    user = waiter(str(node.pipe / "control_lock"))
    procs.append(user)
    os.kill(first, signal.SIGKILL)  # the daemon dies once
    assert user.stdout is not None and user.stdout.readline() == "locked\n"
    wait_until(lambda: holders_daemon(node, holder, first, user.pid), "a new daemon of the holder", 60)
    wait_until(node.ready, "mpsd run on it")
    said = read(holder)
    assert f"control_lock is write-locked by pid {user.pid} ('python3'), which is no control daemon" in said
    assert "runs as uid 1000" in said and user.poll() is None
    assert run.poll() is None


def test_a_local_user_waiting_for_control_lock_is_no_daemon_to_an_owning_mpsd(make_config, run_supervisor, procs):
    config = make_config()
    r = run_supervisor(config)
    first = r.wait_for(lambda s: s.daemon_up and s.configured, what="the daemon up") and r.sup.status().pid
    user = waiter(os.path.join(config.pipe_dir, "control_lock"))
    procs.append(user)
    os.kill(first, signal.SIGKILL)
    assert user.stdout is not None and user.stdout.readline() == "locked\n"
    r.wait_for(lambda s: s.daemon_up and s.configured and r.sup.status().pid not in (None, first),
               timeout=60, what="a new daemon")  # fmt: skip
    assert user.poll() is None
