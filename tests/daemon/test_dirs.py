"""Pipe and log directory preparation, against real files, locks and the real daemon."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import time

import pytest

from mpsd.daemon import dirs, genuine
from mpsd.errors import SetupError


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_creates_both_dirs_traversable_by_others(tmp_path):
    os.chmod(tmp_path, 0o700)  # like pytest's own tmp dirs, or /run/nvidia on some distros
    pipe, logs = tmp_path / "a" / "pipe", tmp_path / "b" / "log"
    dirs.prepare(str(pipe), str(logs))
    assert pipe.is_dir() and logs.is_dir()
    assert mode(pipe) & 0o755 == 0o755 and mode(logs) & 0o755 == 0o755
    for component in [pipe, *pipe.parents]:
        assert mode(component) & 0o111 == 0o111, component


def test_existing_modes_only_gain_bits(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir(mode=0o700)
    os.chmod(pipe, 0o1770)
    dirs.prepare(str(pipe), str(tmp_path / "log"))
    assert mode(pipe) == 0o1775  # 1770 plus r-x for others, sticky bit kept


def test_stale_files_removed(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    for name in ("control", "control_lock", "control_privileged", "log", "nvidia-cuda-mps-control.pid", "keep.txt"):
        (pipe / name).write_text("")
    dirs.prepare(str(pipe), str(tmp_path / "log"))
    assert sorted(p.name for p in pipe.iterdir()) == ["keep.txt"]


def test_lock_held_by_another_process_is_refused(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    lock = pipe / "control_lock"
    lock.write_text("")
    holder = subprocess.Popen(
        [
            "python3",
            "-c",
            "import fcntl,os,sys,time; fd=os.open(sys.argv[1],os.O_RDWR); fcntl.lockf(fd,fcntl.LOCK_EX); "
            "print('x',flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"x\n"
        with pytest.raises(SetupError, match=r"another nvidia-cuda-mps-control \(pid \d+ .*\) holds"):
            dirs.prepare(str(pipe), str(tmp_path / "log"))
        assert lock.exists()  # nothing of the live daemon removed
    finally:
        holder.kill()
        holder.wait()
    dirs.prepare(str(pipe), str(tmp_path / "log"))
    assert not lock.exists()


@pytest.mark.every_mps_version
def test_real_daemon_after_sigkill_leaves_files_that_prepare_clears(mps_control, mps_dirs):
    pipe, logs = mps_dirs
    dirs.prepare(str(pipe), str(logs))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    proc = subprocess.Popen([str(mps_control), "-f"], env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not (pipe / "control").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(SetupError, match="another nvidia-cuda-mps-control"):
        dirs.prepare(str(pipe), str(logs))
    proc.kill()
    proc.wait()
    assert (pipe / "control").exists()  # left behind by the dead daemon
    dirs.prepare(str(pipe), str(logs))
    assert not any(pipe.iterdir())


@pytest.mark.parametrize(
    "pipe,log,message",
    [("relative/pipe", "/tmp/x", "expected an absolute path"), ("/tmp/x", "rel", "expected an absolute path")],
)
def test_relative_paths_rejected(pipe, log, message):
    with pytest.raises(SetupError, match=message):
        dirs.prepare(pipe, log)


def test_pipe_dir_that_is_a_file(tmp_path):
    (tmp_path / "pipe").write_text("")
    with pytest.raises(SetupError, match="(not a directory|cannot create)"):
        dirs.prepare(str(tmp_path / "pipe"), str(tmp_path / "log"))


def test_parent_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(SetupError, match="cannot create directory"):
        dirs.prepare(str(tmp_path / "file" / "pipe"), str(tmp_path / "log"))


def test_unlocked_lock_file_is_stale(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    fd = os.open(pipe / "control_lock", os.O_RDWR | os.O_CREAT)
    fcntl.lockf(fd, fcntl.LOCK_EX)  # our own lock: POSIX locks do not conflict within one process
    try:
        assert genuine.daemon_lock_holder(str(pipe), "nvidia-cuda-mps-control") is None
    finally:
        os.close(fd)


@pytest.mark.parametrize(("resolved", "key"), [
    ("/run/mpsd-pipe", "run-mpsd\\x2dpipe"),
    ("/tmp/nvidia-mps", "tmp-nvidia\\x2dmps"),
    ("/run/mpsd/mig/MIG-1a2b", "run-mpsd-mig-MIG\\x2d1a2b"),
    ("/a/.hidden", "a-.hidden"),
    ("/.x", "\\x2ex"),
    ("/a b/\\é", "a\\x20b-\\x5c\\xc3\\xa9"),
    ("/", "-"),
])
def test_lock_key_is_readable_and_one_to_one(resolved, key):
    assert dirs.lock_key(resolved) == key


def test_mpsds_locks_live_in_the_state_dir_keyed_by_the_resolved_pipe_dir(tmp_path):
    (tmp_path / "real" / "pipe").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    state = str(tmp_path / "state")
    fd = dirs.hold_pipe_dir(str(tmp_path / "real" / "pipe"), state)
    try:
        assert os.listdir(tmp_path / "real" / "pipe") == []  # nothing of mpsd's where pods look
        with pytest.raises(dirs.PipeDirHeld) as held:  # another spelling of the same directory
            dirs.hold_pipe_dir(str(tmp_path / "link" / "pipe"), state)
        assert held.value.pid == os.getpid()
        (lock,) = (tmp_path / "state" / "locks").iterdir()
        assert lock.name.endswith("-real-pipe.run.lock") and stat.S_IMODE(lock.stat().st_mode) == 0o600
    finally:
        dirs.release_pipe_dir(fd)


# ---- directories a local user could plant (/tmp is writable by all)

OTHER = 1234
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another UID needs root")


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@needs_root
def test_a_pipe_dir_owned_by_another_user_is_refused_and_left_alone(tmp_path):
    pipe = tmp_path / "pipe"
    pipe.mkdir(mode=0o700)
    (pipe / "control").write_text("planted")
    os.chown(pipe, OTHER, OTHER)
    with pytest.raises(SetupError) as exc:
        dirs.prepare(str(pipe), str(tmp_path / "log"))
    assert f"{pipe}: owned by uid {OTHER}" in one_line(exc)
    assert (pipe / "control").read_text() == "planted" and mode(pipe) == 0o700


@needs_root
def test_a_parent_owned_by_another_user_is_refused(tmp_path):
    planted = tmp_path / "planted"
    planted.mkdir()
    os.chown(planted, OTHER, OTHER)
    with pytest.raises(SetupError) as exc:
        dirs.prepare(str(planted / "nvidia-mps"), str(tmp_path / "log"))
    assert f"{planted}: owned by uid {OTHER}" in one_line(exc)


def test_a_pipe_dir_that_is_a_symlink_is_refused_and_its_target_left_alone(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (target / "control").write_text("keep")
    (tmp_path / "pipe").symlink_to(target)
    with pytest.raises(SetupError) as exc:
        dirs.prepare(str(tmp_path / "pipe"), str(tmp_path / "log"))
    assert f"{tmp_path / 'pipe'}: a symbolic link" in one_line(exc)
    assert (target / "control").read_text() == "keep" and mode(target) == 0o700


@needs_root
def test_a_symlink_planted_by_another_user_on_the_path_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(SetupError) as exc:
        dirs.prepare(str(link / "pipe"), str(tmp_path / "log"))
    assert f"{link}: a symbolic link owned by uid {OTHER}" in one_line(exc)
    assert not (real / "pipe").exists()


def test_a_log_dir_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "log").symlink_to("/etc")  # root would append control.log to wherever it points
    with pytest.raises(SetupError) as exc:
        dirs.prepare(str(tmp_path / "pipe"), str(tmp_path / "log"))
    assert f"{tmp_path / 'log'}: a symbolic link" in one_line(exc)


def test_a_symlink_of_mpsd_s_own_user_above_the_pipe_dir_is_followed(tmp_path):
    """Like /var/run -> /run: a link only root (mpsd's user) could have made."""
    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real")
    dirs.prepare(str(tmp_path / "run" / "pipe"), str(tmp_path / "run" / "log"))
    assert (tmp_path / "real" / "pipe").is_dir()
