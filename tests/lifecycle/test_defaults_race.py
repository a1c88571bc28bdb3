"""A pod racing the daemon's defaults (issue 21, defect 1): any UID may send set_default_*
through the 0666 ``control`` socket of the 535 daemons, and mpsd's own commands are front-end
sessions of their own. A writer that loops must never get the daemon restarted (a restart
ends every tenant's MPS server): the change is reported, naming the writer where it can be
known, counted, /readyz turns 503 after verdictTimeout, and the defaults are put back at
every round. The real 535 daemon, a real writer of another UID."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from mpsd import config as cfg
from mpsd.daemon import dirs, drift
from mpsd.daemon.control import Control
from mpsd.registry import Metrics
from mpsd.node import InventoryPump, _observer, _ready
from tests.container import HOST_LIBS, Mount
from tests.lifecycle.test_client_view import NOBODY, as_nobody
from tests.daemon.test_control_plane import TAMPER, metric
from tests.lifecycle.test_supervisor import reads_back, wait_until

pytestmark = [
    pytest.mark.mps_binary,
    pytest.mark.skipif(os.geteuid() != 0, reason="a writer of another UID needs root"),
]
WRITE = "set_default_active_thread_percentage 1"


def start_writer(binary: str, pipe_dir: str, command: str = WRITE, uid: int | None = NOBODY) -> subprocess.Popen:
    """A process of another UID (``uid``; None: mpsd's own, i.e. root, as a root pod is) sending
    ``command`` through the front-end in a loop, as fast as the front-end goes (it fails until
    a daemon listens, and goes on)."""
    loop = f'while :; do echo "{command}" | "$0" >/dev/null 2>&1; done'
    as_user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    return subprocess.Popen(
        ["sh", "-c", loop, binary],
        env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir),
        start_new_session=True,
        **as_user,
    )


def stop_writer(writer: subprocess.Popen) -> None:
    os.killpg(writer.pid, 9)
    writer.wait()


def test_a_writer_looping_for_a_minute_never_gets_the_daemon_restarted(make_config, run_supervisor, procs):
    metrics = Metrics()
    config = make_config(**{"active-thread-percentage": "60", "health-interval": "0.5s", "verdict-timeout": "3s"})
    writer = start_writer(config.control_binary, config.pipe_dir)  # there before the daemon: races its start
    procs.append(writer)
    pump = InventoryPump(None, metrics, None)
    try:
        r = run_supervisor(config, on_status=_observer(metrics, pump))
        r.wait_for(lambda s: s.configured, timeout=60, what="configured although a writer races the start")
        pid = r.sup.status().pid
        reasons, contested = [], 0.0
        ends = time.monotonic() + 60
        while time.monotonic() < ends:  # a minute of racing
            status = r.sup.status()
            assert status.pid == pid and status.restarts == 0, f"the daemon was restarted: {status.last_error}"
            reasons.append(_ready(r.board)[1])
            contested = max(contested, metric(metrics.scrape().decode(), "mpsd_defaults_contested_seconds"))
            time.sleep(0.5)
        assert r.sup.status().defaults_restored >= 3  # seen and put back round after round
        raced = [reason for reason in reasons if "defaults changed again" in reason]
        assert raced and all("activeThreadPercentage 1 (config 60)" in r for r in raced), reasons[-1]  # /readyz 503
        # The writer is named once a look at the daemon's session finds its front-end connected
        # (each one lives a few milliseconds): maybe not at the first reasons on a loaded
        # machine, where a reason says "the writer could not be named", but within the minute.
        assert all("last written by" in r or "could not be named" in r for r in raced), raced
        named = [r for r in raced if "nvidia-cuda-mps" in r and "set_default_active_thread_percentage 1" in r]
        assert named, raced[-1]
        assert contested >= 3
        assert metric(metrics.scrape().decode(), "mpsd_daemon_restarts_total") == 0
    finally:
        stop_writer(writer)
    wait_until(lambda: _ready(r.board)[0], what="ready once the writer stopped")
    reads_back(config, 60.0, {})
    assert metric(metrics.scrape().decode(), "mpsd_defaults_contested_seconds") == 0
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0
    pump.close()


# ---------------------------------------------------------------- the exposure, per driver version


@pytest.fixture
def versioned_daemon(mps_version, mps_control, tmp_path_factory):
    """A bare ``-f`` daemon of each selected Debian-packaged version (MPSD_TEST_MPS_VERSIONS; CI
    runs all), started by root as mpsd starts it."""
    version, binary = mps_version, mps_control
    base = tmp_path_factory.mktemp("v", numbered=True)
    pipe, logs = base / "pipe", base / "log"
    dirs.prepare(str(pipe), str(logs))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    proc = subprocess.Popen([str(binary), "-f"], env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    control = Control(str(binary), str(pipe), timeout=10)
    wait_until(lambda: (pipe / "control").exists(), what=f"the {version} daemon listening")
    yield version, control
    os.killpg(proc.pid, 9)
    proc.wait()


@pytest.mark.every_mps_version
def test_which_versions_take_set_default_from_any_uid(versioned_daemon):
    # docs/security.md's per-version exposure: 535 takes set_default_* from any UID through
    # `control`; 550 and later only from root and the daemon's user.
    version, control = versioned_daemon
    config = cfg.load(None, {}, {"active-thread-percentage": "60", "pinned-mem-limit": "0=2G"})
    assert drift.settle(control, config, {0}) == []  # mpsd (root) sets and reads back in one session
    out = as_nobody(control.binary, control.pipe_dir, "\n".join(TAMPER))
    changed = drift.differences(drift.expected(config, {0}), drift.read(control, config, {0}))
    if version.startswith("535"):
        assert out.returncode == 0 and "rivilege" not in out.stdout + out.stderr
        assert len(changed) == 3, changed
    else:
        assert "Control deamon settings can only be modified by the user started it or by the root user" in out.stdout
        assert changed == []


def test_a_writer_in_a_container_is_named_with_the_container(make_config, run_supervisor, podman, mps_control):
    # A pod's writer (a podman container: its own PID and network namespaces, the pipe dir
    # mounted read-only as pods get it, a UID of its own) looping the real front-end: the
    # report names its PID as mpsd sees it and the container from its cgroup.
    config = make_config(**{"active-thread-percentage": "60"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    exe = "/usr/local/bin/nvidia-cuda-mps-control"
    loop = f'end=$(($(date +%s) + 20)); while [ $(date +%s) -lt $end ]; do echo "{WRITE}" | {exe} >/dev/null; done'
    mounts = [Mount(config.pipe_dir, config.pipe_dir), *HOST_LIBS, Mount(mps_control, exe)]
    run = threading.Thread(
        target=podman.run,
        args=(["sh", "-c", loop],),
        kwargs={"mounts": mounts, "env": {"CUDA_MPS_PIPE_DIRECTORY": config.pipe_dir}, "user": "1000", "timeout": 120},
        daemon=True,
    )
    run.start()
    try:
        wait_until(lambda: "container " in r.sup.status().last_error, timeout=90, what="the writer named")
        ids = podman.podman("ps", "--quiet", "--no-trunc").stdout.split()
        error = r.sup.status().last_error
        assert ids and f"container {ids[0][:12]}" in error and "activeThreadPercentage 1 (config 60)" in error, error
        assert r.sup.status().restarts == 0
    finally:
        run.join(120)
