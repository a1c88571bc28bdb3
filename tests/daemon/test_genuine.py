"""mpsd.daemon.genuine: what proves a running control daemon to be the genuine one of a pipe dir. Pure
parts by tables; the proof itself against the real daemon, a copy of it, one of another
version, one of another pipe dir, and a socket someone else serves."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mpsd.daemon import dirs, genuine, peer
from mpsd.lifecycle import independent
from tests.rollout import REPO, wait_until

ELF_TAIL = b"\x00%s/server.log\x00Using log directory: %s\x00"


@pytest.mark.parametrize(
    ("data", "version"),
    [
        (ELF_TAIL + b"535.261.03\x00CUDA_MPS_CLIENT_PRIORITY\x00", "535.261.03"),
        (b"\x00550.163.01\x00", "550.163.01"),
        (b"\x00555.58.02\x00", "555.58.02"),
        (b"\x00580.159.04\x00", "580.159.04"),
        (b"\x00100.0\x00", None),  # a percentage, not a version
        (b"535.261.03", None),  # not NUL-terminated on both sides: part of some other text
        (b"\x00v535.261.03\x00", None),
        (b"", None),
    ],
)
def test_binary_version(data, version):
    assert genuine.binary_version(data) == version


@pytest.mark.parametrize(
    ("environ", "pipe_dir"),
    [
        (b"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY=/run/mpsd-pipe\0", "/run/mpsd-pipe"),
        (b"CUDA_MPS_PIPE_DIRECTORY=/run/mpsd-pipe/\0", "/run/mpsd-pipe"),
        (b"CUDA_MPS_PIPE_DIRECTORY=/run//x/../mpsd-pipe\0", "/run/mpsd-pipe"),
        (b"PATH=/bin\0", "/tmp/nvidia-mps"),  # MPS's default
        (b"XCUDA_MPS_PIPE_DIRECTORY=/elsewhere\0", "/tmp/nvidia-mps"),
    ],
)
def test_environ_pipe_dir(environ, pipe_dir):
    assert genuine.environ_pipe_dir(environ) == pipe_dir


@pytest.mark.parametrize(
    ("status", "uids"),
    [
        ("Name:\tx\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n", (0, 0, 0, 0)),
        ("Uid:\t1000\t0\t0\t0\n", (1000, 0, 0, 0)),
        ("Name:\tx\n", ()),
    ],
)
def test_status_uids(status, uids):
    assert genuine.status_uids(status) == uids


# ---------------------------------------------------------------- the proof, on real daemons


def other_version(binary: Path, dest: Path) -> str:
    """A copy of ``binary`` whose built-in version string is another one: the real daemon's
    code, as a driver of another version ships it. Its version."""
    data = binary.read_bytes()
    version = genuine.binary_version(data)
    assert version is not None
    other = version[:-1] + ("1" if version[-1] != "1" else "2")
    dest.write_bytes(data.replace(b"\x00" + version.encode() + b"\x00", b"\x00" + other.encode() + b"\x00"))
    dest.chmod(0o755)
    return other


def start(config) -> int:
    """A daemon started detached on the config's pipe dir; its PID."""
    dirs.prepare(config.pipe_dir, config.log_dir)
    independent.start_detached(config)
    pid = genuine.control_lock_holder(config.pipe_dir)
    assert pid is not None
    return pid


def dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_and_reap(pid: int) -> None:
    """SIGKILL a daemon that is not our child and wait until its parent (init) reaped it."""
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), f"pid {pid} to be reaped", timeout=30)


@pytest.fixture
def daemons():
    """PIDs of daemons a test starts (not children of the test): killed at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def config(make_config):
    return make_config(**{"daemon-lifecycle": "independent"})


def proved(config, binary=None) -> genuine.Proof:
    proof = genuine.prove(config.pipe_dir, binary or config.control_binary)
    if proof.pidfd is not None:
        os.close(proof.pidfd)
    return proof




@pytest.mark.mps_binary
def test_nothing_and_files_left_by_a_dead_daemon_are_absent(config, daemons):
    assert proved(config).absent
    pid = start(config)
    daemons.append(pid)
    kill_and_reap(pid)
    assert os.path.exists(os.path.join(config.pipe_dir, "control_privileged"))
    assert proved(config).absent  # sockets nobody answers, a lock nobody holds


@pytest.mark.mps_binary
def test_the_running_daemon_is_proven_by_pid_and_held_by_a_pidfd(config, daemons):
    pid = start(config)
    daemons.append(pid)
    proof = genuine.prove(config.pipe_dir, config.control_binary)
    try:
        assert (proof.pid, proof.problem) == (pid, "")
        assert not genuine.exited(proof.pidfd)
        kill_and_reap(pid)
        assert genuine.exited(proof.pidfd)
    finally:
        os.close(proof.pidfd)


@pytest.mark.mps_binary
def test_a_copy_of_the_same_binary_elsewhere_is_the_same_program(config, daemons, tmp_path):
    copy = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(config.control_binary, copy)  # another inode: as another image would carry it
    daemons.append(start(config))
    assert proved(config, str(copy)).pid == daemons[0]


@pytest.mark.mps_binary
def test_a_daemon_of_another_version_is_refused_naming_both_versions(config, daemons, tmp_path):
    theirs = tmp_path / "nvidia-cuda-mps-control"
    version = other_version(Path(config.control_binary), theirs)
    from mpsd import config as cfg

    daemons.append(start(cfg.replace(config, control_binary=str(theirs))))
    proof = proved(config)
    ours = genuine.binary_version(Path(config.control_binary).read_bytes())
    assert proof.pid is None and not proof.impostor and proof.owner is None
    assert f"runs nvidia-cuda-mps-control {version} ({theirs})" in proof.problem
    assert f"controlBinary {config.control_binary} is {ours}" in proof.problem


@pytest.mark.mps_binary
def test_a_daemon_of_another_pipe_dir_linked_in_is_an_impostor_left_alone(make_config, config, daemons):
    other = make_config(**{"pipe-dir": str(Path(config.pipe_dir).parent / "other")})
    pid = start(other)
    daemons.append(pid)
    os.makedirs(config.pipe_dir)
    for name in ("control_privileged", "control"):  # its sockets, reachable under our names
        os.link(os.path.join(other.pipe_dir, name), os.path.join(config.pipe_dir, name))
    proof = proved(config)
    assert proof.pid is None and proof.impostor and proof.owner is None
    assert f"is the daemon of pipe dir {other.pipe_dir}, not of {config.pipe_dir}" in proof.problem
    assert not dead(pid)


@pytest.mark.mps_binary
def test_a_socket_renamed_over_the_daemons_names_the_genuine_daemon_as_owner(config, daemons, procs):
    pid = start(config)
    daemons.append(pid)
    impostor = subprocess.Popen(
        [sys.executable, "-m", "tests.impostor", config.pipe_dir, str(os.getpid())],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(impostor)
    assert impostor.stdout.readline().strip() == "listening"
    proof = proved(config)
    assert proof.pid is None and proof.impostor and proof.owner == pid
    assert f"pid {impostor.pid}" in proof.problem and "not nvidia-cuda-mps-control" in proof.problem


POD_CGROUP = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b5e8c3a_1f2d_4c6e_9a7b_3d2e1f0a9b8c.slice/"
    "cri-containerd-" + "4f" * 32 + ".scope\n"
)


@pytest.mark.parametrize(
    ("cgroup", "where"),
    [
        ("0::/system.slice/mpsd.service\n", "the systemd unit mpsd.service"),
        ("12:pids:/system.slice/mpsd.service\n1:name=systemd:/system.slice/mpsd.service\n0::/\n",
         "the systemd unit mpsd.service"),
        ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/mpsd.service\n", "the systemd unit mpsd.service"),
        (POD_CGROUP, "pod 0b5e8c3a-1f2d-4c6e-9a7b-3d2e1f0a9b8c container 4f4f4f4f4f4f"),
        ("0::/system.slice/docker-" + "ab" * 32 + ".scope\n", "container " + "ab" * 6),
        ("0::/user.slice/user-0.slice/session-3.scope\n", ""),  # a login: what mpsd starts outlives it
        ("0::/\n", ""),
        ("4:memory:/process_api/207f3ddbe90b027d91e8a157979ee12a\n0::/\n", ""),
    ],
)
def test_confining_cgroup(cgroup, where):
    assert independent.confining_cgroup(cgroup) == where


@pytest.mark.mps_binary
@pytest.mark.every_mps_version
def test_a_daemon_running_as_another_non_root_uid_is_not_adopted(config, daemons):
    """The real daemon started by UID 1000 on a pipe dir of its own: the same binary and pipe
    dir, its own lock, its own sockets; only its UID is wrong (guard 3: root or mpsd's user)."""
    dirs.prepare(config.pipe_dir, config.log_dir, config.control_binary)
    for path in (config.pipe_dir, config.log_dir):
        os.chown(path, 1000, 1000)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=config.pipe_dir, CUDA_MPS_LOG_DIRECTORY=config.log_dir)
    subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", config.control_binary, "-d"],
                   env=env, check=True, timeout=30, capture_output=True)  # fmt: skip
    pid = wait_until(lambda: genuine.control_lock_holder(config.pipe_dir), "the UID 1000 daemon")
    daemons.append(pid)
    assert psutil.Process(pid).uids().effective == 1000
    proof = proved(config)
    assert proof.pid is None and proof.impostor
    assert proof.problem.endswith("runs as uid 1000, not as root or mpsd's user"), proof.problem
    assert genuine.daemon_lock_holder(config.pipe_dir, config.control_binary) is None  # its lock is nobody's


@pytest.mark.mps_binary
@pytest.mark.every_mps_version
def test_a_daemon_in_another_pid_namespace_is_not_adopted(config, procs):
    """The real daemon started under ``unshare -p -f`` (root, the same binary and pipe dir):
    MPS names clients by PID, so a daemon that sees other PIDs is not this node's (guard 3)."""
    dirs.prepare(config.pipe_dir, config.log_dir, config.control_binary)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=config.pipe_dir, CUDA_MPS_LOG_DIRECTORY=config.log_dir)
    unshared = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", config.control_binary, "-f"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    procs.append(unshared)
    pid = wait_until(lambda: peer.listener_pid(os.path.join(config.pipe_dir, "control_privileged")),
                     "the daemon in its own PID namespace")  # fmt: skip
    assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    proof = proved(config)
    assert proof.pid is None and proof.impostor
    assert proof.problem.endswith("runs in another PID namespace than mpsd"), proof.problem
