"""``mpsd`` as a real subprocess: run + SIGTERM, probes, status, exec, check-config, exit codes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.procs import control_daemon, control_daemons

REPO = Path(__file__).resolve().parents[2]


def mpsd(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
        cwd=REPO,
        timeout=120,
        **kw,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 60, why: str = "never ready") -> None:
    """Until mpsd run's /readyz answers 200; fails when mpsd exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        try:
            if get(f"http://127.0.0.1:{port}/readyz")[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def flags(mps_control, mps_dirs, **extra) -> list[str]:
    pipe, logs = mps_dirs
    values = {
        "control-binary": str(mps_control),
        "pipe-dir": str(pipe),
        "log-dir": str(logs),
        "state-dir": str(pipe.parent / "state"),
        "metrics-address": "",
        "health-interval": "0.5s",
        "nvml-library": str(pipe.parent / "no-nvml.so"),
    }
    values.update(extra)
    return [f"--{k}={v}" for k, v in values.items()]


@pytest.mark.every_mps_version
@pytest.mark.mps_binary
def test_run_serves_probes_and_sigterm_exits_0_leaving_no_daemon(mps_control, mps_dirs):
    port = free_port()
    args = flags(mps_control, mps_dirs, **{"metrics-address": f"127.0.0.1:{port}", "active-thread-percentage": "45"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpsd", "run", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_ready(proc, port)
        assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
        code, text = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200 and "mpsd_daemon_up 1.0" in text
        children = psutil.Process(proc.pid).children(recursive=True)
        assert control_daemons(proc.pid), children
        status = mpsd("status", "--json", *flags(mps_control, mps_dirs))
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["daemon"] == "up" and data["settings"]["activeThreadPercentage"] == 45.0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "daemon stopped" in out and "config source=" in out
    for child in children:
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, child


@pytest.mark.mps_binary
def test_sigkill_of_mpsd_takes_the_daemon_with_it(mps_control, mps_dirs):
    # A daemon left behind would hold control_lock, and the next mpsd run would refuse the pipe dir.
    args = flags(mps_control, mps_dirs)
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "run", *args], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while mpsd("status", *args).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "never up"
            time.sleep(0.1)
        while (daemon := control_daemon(proc.pid)) is None:
            assert time.monotonic() < deadline, "no control daemon under mpsd run"
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
        psutil.wait_procs([daemon], timeout=30)
        assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE
        again = subprocess.Popen(
            [sys.executable, "-m", "mpsd", "run", *args], cwd=REPO, stderr=subprocess.PIPE, text=True
        )
        try:
            while mpsd("status", *args).returncode != 0:
                assert again.poll() is None, again.stderr.read()
                assert time.monotonic() < deadline, "second mpsd never up"
                time.sleep(0.1)
            again.send_signal(signal.SIGTERM)
            assert again.wait(60) == 0
        finally:
            if again.poll() is None:
                again.kill()
                again.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.mps_binary
def test_run_reports_a_setup_error_in_one_line(mps_control, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = mpsd("run", *flags(mps_control, (blocker / "pipe", tmp_path / "log")))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("mpsd: cannot create directory")


def test_status_without_daemon_exits_1(mps_control, mps_dirs):
    result = mpsd("status", *flags(mps_control, mps_dirs))
    assert result.returncode == 1
    assert result.stdout.startswith("daemon: down")


def test_exec_sets_the_client_environment(tmp_path):
    state = tmp_path / "state"
    result = mpsd(
        "exec",
        "--pipe-dir=/run/mps/pipe",
        f"--state-dir={state}",
        "--gpu-memory",
        "4G",
        "--gpu-compute",
        "25",
        "--",
        "env",
    )
    assert result.returncode == 0, result.stderr
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps/pipe"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4G"
    import shim

    assert env["LD_PRELOAD"].split(":")[0] == str(shim.library_path())
    region = Path(env["MPSSHIM_REGION"])
    assert region.name == "region" and region.parent.parent == state / "exec"
    assert not region.parent.exists()  # the per-exec region is removed afterwards


def test_exec_with_region_and_limits_by_device(tmp_path):
    region = tmp_path / "slice" / "region"
    result = mpsd(
        "exec", "--region", str(region), "--gpu-memory", "0=1G,1=512M", f"--state-dir={tmp_path}", "--", "env"
    )
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1G,1=512M"
    assert env["MPSSHIM_REGION"] == str(region)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env


def test_exec_without_shim_and_exit_code(tmp_path):
    cmd = 'echo "[$LD_PRELOAD][$XLA_PYTHON_CLIENT_PREALLOCATE][$TF_FORCE_GPU_ALLOW_GROWTH]"; exit 7'
    result = mpsd("exec", "--no-shim", f"--state-dir={tmp_path}", "--", "sh", "-c", cmd)
    assert result.returncode == 7
    assert result.stdout.strip() == "[][][]"  # no shared cap: nothing to say to frameworks


def test_exec_tells_frameworks_to_allocate_on_demand_unless_the_user_said_otherwise(tmp_path):
    # the processes of an exec (and other execs of its --region) share one cap (issue 21, defect 8)
    ours = ("XLA_PYTHON_CLIENT_PREALLOCATE", "TF_FORCE_GPU_ALLOW_GROWTH")
    clean = {k: v for k, v in os.environ.items() if k not in ours}
    result = subprocess.run([sys.executable, "-m", "mpsd", "exec", f"--state-dir={tmp_path}", "--", "env"],
                            capture_output=True, text=True, env=clean, cwd=REPO, timeout=120)
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    result = mpsd("exec", f"--state-dir={tmp_path}", "--", "env", env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" and env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


@pytest.mark.parametrize(
    "args,env,message",
    [
        (["exec", "--gpu-memory", "4Q", "--", "true"], {}, "--gpu-memory: bad size '4Q'"),
        (["exec", "--gpu-compute", "120", "--", "true"], {}, "--gpu-compute: bad active thread percentage"),
        (["exec", "--no-shim"], {}, "exec: expected a command after --"),
        (
            ["run", "--slices-per-gpu", "ten"],
            {},
            'flag --slices-per-gpu: devicePlugin.slicesPerGpu: expected an integer 1..100, got "ten"',
        ),
        (
            ["status"],
            {"MPSD_HEALTH_TIMEOUT": "later"},
            "environment MPSD_HEALTH_TIMEOUT: healthTimeout: expected a duration",
        ),
        (["run", "--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        # int() of more than 4300 digits raises ValueError: it escaped as a traceback, exit 1
        (["exec", "--gpu-memory", "9" * 5000, "--", "true"], {}, "--gpu-memory: bad size '99999"),
        (["exec", "--gpu-memory", "9" * 5000 + "=4G", "--", "true"], {}, "ordinals run from 0 to 63"),
        (["exec", "--gpu-memory", "0=" + "9" * 5000 + "M", "--", "true"], {}, "larger than 2**64-1 bytes"),
        (["status"], {"MPSD_SLICES_PER_GPU": "9" * 5000}, "devicePlugin.slicesPerGpu: expected an integer 1..100"),
        (["status"], {"MPSD_PINNED_MEM_LIMIT": "0=" + "9" * 5000}, "pinnedMemLimit: expected DEVICE=SIZE"),
        (["status"], {"MPSD_METRICS_ADDRESS": ":" + "9" * 5000}, "metricsAddress: expected host:port"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_malformed_input_exits_2_with_one_line(args, env, message):
    result = mpsd(*args, env=env)
    assert result.returncode == 2, result
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert len(result.stderr) < 1000, "a bad value is shown shortened"


def test_check_config(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("version: v1\npinnedMemLimit: 0=2G\ndevicePlugin:\n  slicesPerGpu: 4\n")
    result = mpsd("check-config", str(good), "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["pinnedMemLimit"] == "0=2G" and data["devicePlugin"]["slicesPerGpu"] == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\ndevicePlugin:\n  slicesPerGpu: ten\n")
    result = mpsd("check-config", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip() == f'mpsd: {bad}: devicePlugin.slicesPerGpu: expected an integer 1..100, got "ten"'


@pytest.mark.mps_binary
def test_sighup_reloads_the_file(mps_control, mps_dirs, tmp_path):
    config = tmp_path / "mpsd.yaml"
    config.write_text("version: v1\nactiveThreadPercentage: 70\n")
    args = flags(mps_control, mps_dirs)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpsd", "run", "--config", str(config), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def atp():
        result = mpsd("status", "--json", *args)
        return json.loads(result.stdout)["settings"].get("activeThreadPercentage")

    try:
        deadline = time.monotonic() + 60
        while atp() != 70.0:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        config.write_text("version: v1\nactiveThreadPercentage: 35\n")
        proc.send_signal(signal.SIGHUP)
        while atp() != 35.0:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "reloaded applied=activeThreadPercentage" in out


def test_status_table_shows_defaults_gpus_and_clients_with_memory():
    from mpsd.status import render_status

    data = {
        "pipeDir": "/run/mps",
        "daemon": "up",
        "error": "",
        "settings": {"activeThreadPercentage": 50.0, "pinnedMemLimit": {"0": 2 << 30, "1": None}, "clientPriority": 0},
        "servers": [{"pid": 900, "clients": [901]}],
        "gpus": [{"index": 0, "name": "H100", "uuid": "GPU-1", "memory_used": 3 << 30, "memory_total": 80 << 30}],
        "clients": [
            {
                "pid": 901,
                "client_id": 0,
                "server": 900,
                "device": "GPU-1",
                "namespace": "4026531836",
                "command": "python serve.py",
                "usedMemory": 1 << 30,
            }
        ],
    }
    assert render_status(data).splitlines() == [
        "daemon: up  pipe dir: /run/mps",
        "defaults: active threads 50.0%  pinned limit 0=2G,1=unset  client priority 0",
        "gpu 0: H100 GPU-1  memory 3072/81920 MiB",
        "servers: 900",
        "     PID   SERVER DEVICE                       MEMORY  COMMAND",
        "     901      900 GPU-1                         1024M  python serve.py",
    ]


def test_reload_reads_the_environment_main_was_given(monkeypatch, tmp_path):
    import mpsd.node
    from mpsd.cli import main

    config = tmp_path / "mpsd.yaml"
    config.write_text("version: v1\nactiveThreadPercentage: 70\n")
    env = {"MPSD_CONFIG": str(config), "MPSD_HEALTH_INTERVAL": "7s"}
    seen = {}
    monkeypatch.setattr(mpsd.node, "run", lambda c, reload: seen.update(first=c, reload=reload) or 0)
    assert main(["run"], env=env) == 0
    config.write_text("version: v1\nactiveThreadPercentage: 35\n")
    again = seen["reload"]()
    assert (seen["first"].health_interval, again.health_interval) == (7.0, 7.0)
    assert again.active_thread_percentage == 35.0
