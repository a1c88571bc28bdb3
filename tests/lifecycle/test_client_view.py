"""The supervisor sees what clients see: the ``control`` socket non-root clients connect
through, and a control.log on a full disk. Real daemon, real sockets, a real tmpfs."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mpsd.daemon.control import Control

pytestmark = pytest.mark.mps_binary
NOBODY = 65534


def as_nobody(binary: str, pipe_dir: str, command: str) -> subprocess.CompletedProcess[str]:
    """One front-end command run as an unprivileged UID: it connects through ``control``."""
    return subprocess.run(
        [binary],
        input=command + "\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir),
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="running a front-end as another UID needs root")
def test_a_deleted_control_socket_fails_the_health_check_and_a_restart_brings_it_back(make_config, run_supervisor):
    config = make_config()
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    control = Path(config.pipe_dir) / "control"
    assert as_nobody(config.control_binary, config.pipe_dir, "get_server_list").returncode == 0
    control.unlink()  # root still gets through control_privileged; nobody else does
    assert as_nobody(config.control_binary, config.pipe_dir, "get_server_list").returncode == 1
    state = r.wait_for(lambda s: not s.configured, what="health check failed")
    assert "control" in state.last_error and str(control) in state.last_error
    r.wait_for(lambda s: s.configured and r.sup.status().pid != pid, what="restarted")
    assert stat.S_ISSOCK(os.lstat(control).st_mode)
    assert r.sup.status().restarts == 1
    assert as_nobody(config.control_binary, config.pipe_dir, "get_server_list").returncode == 0


@pytest.fixture
def small_tmpfs(mps_dirs):
    """The log dir as a 256 KiB tmpfs, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    logs = mps_dirs[1]
    logs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "mpsd-test", str(logs)], check=True)
    yield logs
    subprocess.run(["umount", "-l", str(logs)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full; the file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_the_control_log_survives_a_full_disk_and_resumes(make_config, small_tmpfs, run_supervisor):
    errors: list[threading.ExceptHookArgs] = []
    old_hook = threading.excepthook
    threading.excepthook = errors.append
    try:
        config = make_config(**{"health-interval": "0.2s"})
        r = run_supervisor(config)
        r.wait_for(lambda s: s.configured, what="configured")
        pid = r.sup.status().pid
        control = Control(config.control_binary, config.pipe_dir, timeout=10)
        log = small_tmpfs / "control.log"
        filler = fill(small_tmpfs)
        for n in range(300):  # daemon output while the disk is full: more than a pipe buffer holds
            control.call(f"get_default_device_pinned_mem_limit {1000 + n}")
        filler.unlink()
        control.call("get_default_device_pinned_mem_limit 31337")
        deadline = time.monotonic() + 20
        while "Cmd:get_default_device_pinned_mem_limit 31337" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, "control.log not written after space was freed"
            time.sleep(0.1)
        assert "line(s) of the control daemon's output lost: No space left on device" in log.read_text()
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0  # the daemon never blocked
    finally:
        threading.excepthook = old_hook
    assert not errors, [f"{e.thread.name}: {e.exc_type.__name__}: {e.exc_value}" for e in errors]


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET ``path`` on mpsd's metrics address; (0, "") while nothing listens."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def readyz(port: int) -> tuple[int, str]:
    return http_get(port, "/readyz")


def test_mpsd_run_is_not_ready_while_the_control_socket_is_missing(mps_control, mps_dirs):
    import socket
    import sys

    pipe, logs = mps_dirs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpsd",
            "run",
            f"--control-binary={mps_control}",
            f"--pipe-dir={pipe}",
            f"--log-dir={logs}",
            f"--state-dir={pipe.parent / 'state'}",
            f"--metrics-address=127.0.0.1:{port}",
            "--health-interval=0.3s",
            "--restart-backoff-initial=2s",  # the restart waits: /readyz must say 503 meanwhile
            "--log-level=warning",
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while readyz(port)[0] != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "never ready"
            time.sleep(0.05)
        (pipe / "control").unlink()
        while (reply := readyz(port))[0] != 503:
            assert time.monotonic() < deadline, "still ready without the control socket"
            time.sleep(0.05)
        assert f"{pipe / 'control'} is missing" in reply[1]
        while readyz(port)[0] != 200:
            assert time.monotonic() < deadline, "not ready again"
            time.sleep(0.05)
        assert stat.S_ISSOCK(os.lstat(pipe / "control").st_mode)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
