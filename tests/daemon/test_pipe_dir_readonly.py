"""The MPS pipe dir as pods get it: read-only, in a real container (podman + runc), with the real
nvidia-cuda-mps-control daemon outside and its real front-end inside.

What a client needs of the pipe dir is ``connect()`` to ``control`` (``control_privileged`` for
root): Linux allows that on a read-only bind mount. Creating, renaming or removing anything
there (an impostor's sockets, issue 16 defect 1) needs write access, which no pod gets.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mpsd.daemon import dirs
from mpsd.daemon.control import Control
from mpsd.errors import DaemonNotRunning
from mpsd.alloc.container import HostPaths, container_mounts
from mpsd.alloc.slicing import plan_allocation
from tests.container import HOST_LIBS, Mount
from tests.plugin.conftest import gpus

pytestmark = pytest.mark.mps_binary
FRONT_END = "/usr/local/bin/nvidia-cuda-mps-control"
PYTHON = "/usr/bin/python3"


@pytest.fixture
def daemon(mps_control, mps_dirs):
    """The real control daemon on the host (``-f``), its pipe dir and a Control; killed at teardown."""
    pipe, logs = mps_dirs
    box = _Daemon(Path(mps_control), pipe, logs)
    box.start()
    yield box
    box.stop()


class _Daemon:
    def __init__(self, binary: Path, pipe: Path, logs: Path) -> None:
        self.binary, self.pipe, self.logs = binary, pipe, logs
        self.control = Control(str(binary), str(pipe), str(logs), timeout=10)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        dirs.prepare(str(self.pipe), str(self.logs))
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.logs))
        self.proc = subprocess.Popen([str(self.binary), "-f"], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.control.get_server_list()
                return
            except DaemonNotRunning:
                assert self.proc.poll() is None, f"daemon exited {self.proc.returncode}"
                assert time.monotonic() < deadline, "daemon did not start listening"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def allocate_mounts(pipe: Path, tmp: Path) -> list[Mount]:
    """The mounts the device plugin's Allocate hands a container, as podman bind mounts."""
    (tmp / "regions" / "alloc").mkdir(parents=True)
    (tmp / "lib").mkdir()
    paths = HostPaths(pipe_dir=str(pipe), region_dir=str(tmp / "regions"), shim_host_dir=str(tmp / "lib"))
    plan = plan_allocation([f"{gpus(80)[0].uuid}::0"], gpus(80), 10)
    return [Mount(m.host, m.container, m.read_only)
            for m in container_mounts(plan, paths, str(tmp / "regions" / "alloc"))]


def client_env(daemon: _Daemon) -> dict[str, str]:
    return {"CUDA_MPS_PIPE_DIRECTORY": str(daemon.pipe), "CUDA_MPS_LOG_DIRECTORY": str(daemon.logs)}


def test_a_pod_cannot_create_rename_or_remove_anything_in_the_pipe_dir_it_is_handed(podman, daemon, tmp_path):
    before = sorted(os.listdir(daemon.pipe))
    p = daemon.pipe
    attempts = {
        "create": f"touch {p}/planted",
        "fifo": f"mkfifo {p}/planted-fifo",
        "symlink": f"ln -s / {p}/planted-link",
        "rename over control": f"mv {p}/control {p}/moved",
        "remove control_privileged": f"rm -f {p}/control_privileged",
        "write control_lock": f"echo x > {p}/control_lock",
    }
    script = "".join(f'if {cmd} 2>/dev/null; then echo "WROTE {what}"; fi; ' for what, cmd in attempts.items())
    result = podman.run(["sh", "-c", script], mounts=allocate_mounts(p, tmp_path))
    assert result.returncode == 0, result.output
    assert "WROTE" not in result.stdout, result.output
    assert sorted(os.listdir(p)) == before
    assert daemon.control.get_server_list() is not None  # still its daemon, still answering


@pytest.mark.every_mps_version
@pytest.mark.parametrize("user", [None, "1000:1000"], ids=["root", "uid1000"])
def test_a_pod_filling_the_log_fifo_does_not_stop_the_daemon_answering(podman, daemon, tmp_path, user):
    # A read-only mount does not stop writes into a FIFO, and the daemon blocks for good once
    # its `log` FIFO holds 64 KiB it did not write (seen on every version: it never answers
    # again, issue 33 row 5). Allocate binds /dev/null over `log` in the pod's view: what the
    # pod writes goes nowhere, the daemon's own channel is untouched.
    fill = f"head -c 200000 /dev/zero > {daemon.pipe}/log; stat -c %F {daemon.pipe}/log"
    result = podman.run(["sh", "-c", fill], mounts=allocate_mounts(daemon.pipe, tmp_path), user=user, timeout=60)
    assert not result.timed_out and result.stdout.strip() == "character special file", result.output
    assert daemon.control.get_default_active_thread_percentage() == 100.0  # within its 10 s: still answering
    assert os.stat(daemon.pipe / "log").st_mode & 0o170000 == 0o010000  # the daemon's FIFO itself, untouched


@pytest.mark.every_mps_version
@pytest.mark.parametrize("user", [None, "1000:1000"], ids=["root", "uid1000"])
def test_the_real_front_end_in_a_container_reaches_the_daemon_through_the_read_only_pipe_dir(
    podman, daemon, mps_control, tmp_path, user
):
    daemon.control.set_default_active_thread_percentage(37)
    commands = "get_default_active_thread_percentage\\nget_server_list\\n"
    result = podman.run(
        ["sh", "-c", f"printf '{commands}' | {FRONT_END}"],
        mounts=[*allocate_mounts(daemon.pipe, tmp_path), *HOST_LIBS, Mount(mps_control, FRONT_END)],
        env=client_env(daemon),
        user=user,
    )
    assert result.returncode == 0, result.output
    assert result.stdout.split() == ["37.0"], result.output  # no server without a GPU: the list is empty
    assert "Cannot find MPS control daemon" not in result.stderr


HOLD_READ_LOCK = """
import fcntl, os, sys, time
path, ready, release = sys.argv[1:4]
deadline = time.monotonic() + 60
while True:  # the daemon's write lock is in the way until it exits
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        break
    except OSError:
        os.close(fd)
        if time.monotonic() > deadline:
            sys.exit("never got the lock")
        time.sleep(0.01)
open(ready, "w").close()
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.every_mps_version
def test_a_pods_read_lock_on_control_lock_does_not_keep_the_daemon_from_starting_again(
    podman, daemon, tmp_path
):
    # control_lock is 0666: any pod UID can open it read-only, through a read-only mount too,
    # and take a read lock between a daemon's exit and its restart. The daemon takes a write
    # lock: the real binary then says "An instance of this daemon is already running".
    if not os.path.exists(PYTHON):
        pytest.skip(f"{PYTHON} is needed inside the container")
    signals = tmp_path / "signals"
    signals.mkdir(mode=0o777)
    os.chmod(signals, 0o777)
    lock = daemon.pipe / "control_lock"
    holder: list = []
    thread = threading.Thread(target=lambda: holder.append(podman.run(
        [PYTHON, "-c", HOLD_READ_LOCK, str(lock), "/signals/ready", "/signals/release"],
        mounts=[*allocate_mounts(daemon.pipe, tmp_path), *HOST_LIBS, Mount(PYTHON, PYTHON),
                Mount(signals, "/signals", read_only=False)],
        user="1000:1000", timeout=120)))
    thread.start()
    try:
        daemon.stop()  # the daemon goes (a crash, a fault, a restart by mpsd)
        deadline = time.monotonic() + 90
        while not (signals / "ready").exists():
            assert thread.is_alive(), holder[0].output if holder else "holder ended"
            assert time.monotonic() < deadline, "the pod never took the read lock"
            time.sleep(0.05)
        daemon.start()  # dirs.prepare, then the real daemon: it must start and answer
        assert daemon.control.get_default_active_thread_percentage() == 100.0
    finally:
        (signals / "release").touch()
        thread.join(timeout=150)
    assert holder and holder[0].returncode == 0, holder[0].output if holder else "no result"
