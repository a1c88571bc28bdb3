"""The pipe directory and the ``control`` socket as a party of their own (issue 16, defects
1-3): an impostor daemon renamed over the sockets, defaults rewritten by a pod, a front-end
session held open. Every real daemon version (535 takes set_default_* from any UID, 550+ from
root only: a root pod), real processes of other UIDs, real sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpsd.daemon import dirs, peer
from mpsd.daemon.control import Control
from mpsd.registry import Metrics
from mpsd.node import InventoryPump, _observer, _ready
from mpsd.status import collect_status, render_status
from tests.container import HOST_LIBS, Mount
from tests.mpsbin import takes_defaults_from_any_uid
from tests.mpsfixtures import FrontEndHolder
from tests.lifecycle.test_client_view import NOBODY, as_nobody, http_get
from tests.daemon.test_control_real import NoGpus
from tests.lifecycle.test_supervisor import reads_back, wait_until

pytestmark = [
    pytest.mark.mps_binary,
    pytest.mark.every_mps_version,
    pytest.mark.skipif(os.geteuid() != 0, reason="processes of another UID need root"),
]
REPO = Path(__file__).resolve().parents[2]


def start_as_nobody(argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(argv, user=NOBODY, group=NOBODY, extra_groups=[], **kwargs)


# ---------------------------------------------------------------- 1. an impostor daemon


def start_impostor(pipe_dir: str, victim: int, names: tuple[str, ...] = ()) -> subprocess.Popen:
    """A root process (a root pod with the pipe dir) answering in place of the daemon."""
    argv = [sys.executable, "-m", "tests.impostor", pipe_dir, str(victim), *names]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "listening\n"
    return proc


def test_an_impostor_daemon_cannot_make_mpsd_kill_an_unrelated_process(make_config, run_supervisor, procs):
    metrics = Metrics()
    config = make_config(**{"fault-policy": "terminate", "health-timeout": "1s", "restart-backoff-initial": "3s"})
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, gpu_indices=lambda: [0], on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    victim = start_as_nobody(["sleep", "600"])  # any host process of another UID
    procs.append(victim)
    procs.append(start_impostor(config.pipe_dir, victim.pid))
    wait_until(
        lambda: victim.poll() is not None or getattr(r.sup.status(), "impostors", 0) > 0,
        what="the impostor noticed (or the victim killed)",
    )
    assert victim.poll() is None, f"mpsd killed pid {victim.pid} on an impostor's word"
    wait_until(lambda: not _ready(r.board)[0], what="not ready")  # counted first, then reported
    status = r.sup.status()
    assert status.impostors == 1
    assert "impostor" in status.last_error and "control_privileged" in status.last_error
    ready, reason = _ready(r.board)
    assert not ready and "impostor" in reason and str(procs[-1].pid) in reason
    r.wait_for(lambda s: s.configured and r.sup.status().pid != pid, what="the daemon restarted")
    assert r.sup.status().restarts >= 1
    time.sleep(3 * config.health_interval + config.health_timeout)  # rounds on the new daemon
    assert victim.poll() is None and _ready(r.board)[0]
    assert as_nobody(config.control_binary, config.pipe_dir, "get_server_list").stdout.strip() != "4242"
    assert "mpsd_control_impostors_total 1.0" in metrics.scrape().decode()
    pump.close()


def test_an_impostor_on_the_control_socket_alone_is_noticed_and_the_daemon_restarted(
    make_config, run_supervisor, procs
):
    # mpsd's own (root) front-end goes through control_privileged and would get true answers;
    # every pod's front-end and CUDA client goes through control, to the impostor (until the
    # restart, held back here so that a pod's view can be seen before it).
    config = make_config(**{"restart-backoff-initial": "5s"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    procs.append(start_impostor(config.pipe_dir, os.getpid(), ("control",)))
    assert as_nobody(config.control_binary, config.pipe_dir, "get_server_list").stdout.strip() == "4242"
    wait_until(lambda: "/control is served by" in r.sup.status().last_error, what="the impostor reported")
    assert r.sup.status().impostors == 1
    r.wait_for(lambda s: s.configured and r.sup.status().pid != pid, what="the daemon restarted")
    assert as_nobody(config.control_binary, config.pipe_dir, "get_server_list").stdout.strip() != "4242"


# ---------------------------------------------------------------- 2. defaults rewritten by any UID


TAMPER = (
    "set_default_active_thread_percentage 1",
    "set_default_device_pinned_mem_limit 0 1M",
    "set_default_client_priority 1",
)


def as_pod(binary: str, pipe_dir: str, command: str, version: str) -> subprocess.CompletedProcess[str]:
    """A pod's front-end that the daemon takes set_default_* from: any UID on 535 (nobody here),
    only root on 550+ (a root pod: many inference images run as root)."""
    if takes_defaults_from_any_uid(version):
        return as_nobody(binary, pipe_dir, command)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir)
    return subprocess.run([binary], input=command + "\n", capture_output=True, text=True, timeout=30, env=env)


REFUSED_550 = "Insufficient privileges for UID 65534. Control deamon settings can only be modified by the user started it"


def test_which_uid_can_rewrite_the_daemons_defaults_through_control(
    mps_control, mps_dirs, make_config, procs, mps_version
):
    # The fact defect 2 rests on, seen on a daemon mpsd does not watch: 535 takes the defaults
    # from any UID, 550 and 555 only from root (and the daemon's own user, root here).
    pipe, logs = mps_dirs
    dirs.prepare(str(pipe), str(logs))  # traversable by every UID, as mpsd makes it
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    procs.append(subprocess.Popen([str(mps_control), "-f"], env=env, stdout=subprocess.DEVNULL))
    control = Control(str(mps_control), str(pipe), timeout=10)
    wait_until(lambda: (pipe / "control").exists(), what="the daemon listening")
    for command in TAMPER:
        done = as_nobody(str(mps_control), str(pipe), command)
        assert done.returncode == 0  # the front-end exits 0 either way: the answer tells
        if takes_defaults_from_any_uid(mps_version):
            assert "privilege" not in done.stdout + done.stderr
        else:
            assert done.stdout.startswith(REFUSED_550), done.stdout
    if not takes_defaults_from_any_uid(mps_version):
        assert control.get_default_active_thread_percentage() == 100.0
        assert control.get_default_device_pinned_mem_limit(0) is None
        assert control.get_default_client_priority() == 0
        for command in TAMPER:  # a root pod still can
            assert "privilege" not in as_pod(str(mps_control), str(pipe), command, mps_version).stdout
    assert control.get_default_active_thread_percentage() == 1.0
    assert control.get_default_device_pinned_mem_limit(0) == 1 << 20
    assert control.get_default_client_priority() == 1
    refused = as_nobody(str(mps_control), str(pipe), "quit")
    assert "privilege" in (refused.stdout + refused.stderr).lower()
    # mpsd status does not show them as if they were the config
    data = collect_status(make_config(**{"pinned-mem-limit": "0=2G"}), inventory=NoGpus())
    assert data["settings"]["activeThreadPercentage"] == 1.0 and len(data["settingsDrift"]) == 3
    text = render_status(data)
    assert "defaults NOT as configured" in text and "activeThreadPercentage 1 (config 100)" in text


def test_defaults_rewritten_by_a_pod_are_restored_within_a_health_interval(make_config, run_supervisor, mps_version):
    metrics = Metrics()
    config = make_config(**{"active-thread-percentage": "60", "pinned-mem-limit": "0=2G", "client-priority": "0"})
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    # one session: no health check between the three (each would count a restore of its own)
    assert as_pod(config.control_binary, config.pipe_dir, "\n".join(TAMPER), mps_version).returncode == 0
    wait_until(lambda: "mpsd_defaults_restored_total 1.0" in metrics.scrape().decode(), what="the tampering noticed")
    reads_back(config, 60.0, {0: 2 << 30}, priority=0)
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0 and r.sup.status().defaults_restored == 1
    pump.close()


# ---------------------------------------------------------------- 3. a front-end session held open


class RawHolder:
    """A process of another UID that connects to ``control`` and sends nothing: the daemon
    waits on it. Forked (the interpreter of the test's venv may not be reachable by that UID);
    the child makes only system calls."""

    def __init__(self, binary: str, pipe_dir: str) -> None:
        ready_r, ready_w = os.pipe()
        self.hold_r, self.hold_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            try:
                os.close(ready_r)
                os.close(self.hold_w)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(os.path.join(pipe_dir, "control"))
                os.write(ready_w, b"held")
                os.read(self.hold_r, 1)  # until released
            finally:
                os._exit(0)
        os.close(ready_w)
        os.close(self.hold_r)
        self.proc = SimpleNamespace(pid=pid)
        assert os.read(ready_r, 4) == b"held"
        os.close(ready_r)

    def release(self) -> None:
        os.close(self.hold_w)
        os.waitpid(self.proc.pid, 0)


@pytest.mark.parametrize("holder_kind", [RawHolder, FrontEndHolder], ids=["silent-socket", "front-end"])
def test_a_held_session_turns_readyz_503_naming_the_holder_and_never_kills_the_daemon(
    make_config, run_supervisor, holder_kind
):
    metrics = Metrics()
    config = make_config(**{"health-timeout": "1s", "verdict-timeout": "2s"})
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    holder = holder_kind(config.control_binary, config.pipe_dir)
    try:
        wait_until(lambda: not _ready(r.board)[0] or r.sup.status().pid != pid, what="readiness lost")
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0, "a held session killed the daemon"
        ready, reason = _ready(r.board)
        assert "no health verdict" in reason and f"pid {holder.proc.pid}" in reason
        time.sleep(3 * config.health_timeout)  # more checks while it is held: still not killed
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0
        age = metric(metrics.scrape().decode(), "mpsd_health_verdict_age_seconds")
        assert age >= 2
    finally:
        holder.release()
    wait_until(lambda: _ready(r.board)[0], what="ready again once released")
    assert r.sup.status().pid == pid
    assert metric(metrics.scrape().decode(), "mpsd_health_verdict_age_seconds") < age
    pump.close()


def test_a_front_end_that_died_inside_a_stopped_daemon_holds_nothing(mps_control, mps_dirs, procs):
    # Seen as a flake of test_sigstop_is_detected_as_hung_killed_and_restarted: mpsd's own
    # front-end, accepted just before the SIGSTOP and killed at its timeout, stayed in the stopped
    # daemon's descriptors, was taken for a holder, and the hang was never declared.
    pipe, logs = mps_dirs
    dirs.prepare(str(pipe), str(logs))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    daemon = subprocess.Popen([str(mps_control), "-f"], env=env, stdout=subprocess.DEVNULL)
    procs.append(daemon)
    wait_until(lambda: (pipe / "control").exists(), what="the daemon listening")
    front_end = subprocess.Popen([str(mps_control)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    procs.append(front_end)
    wait_until(lambda: peer.session_holders(daemon.pid, str(pipe)) == [front_end.pid], what="the session accepted")
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        front_end.kill()
        front_end.wait(10)
        assert peer.session_holders(daemon.pid, str(pipe)) == []
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


# ---------------------------------------------------------------- the same through a real `mpsd run`


def test_mpsd_run_reports_a_held_session_and_restored_defaults_over_http(mps_control, make_config, mps_version):
    config = make_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        f"--control-binary={mps_control}",
        f"--pipe-dir={config.pipe_dir}",
        f"--log-dir={config.log_dir}",
        f"--state-dir={config.state_dir}",
        f"--metrics-address=127.0.0.1:{port}",
        "--health-interval=0.3s",
        "--health-timeout=1s",
        "--verdict-timeout=2s",
        "--nvml-library=/nonexistent/libnvidia-ml.so.1",
    ]
    proc = subprocess.Popen([sys.executable, "-m", "mpsd", "run", *args], cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is not None or http_get(port, "/readyz")[0] == 200, what="ready")
        assert as_pod(config.control_binary, config.pipe_dir, TAMPER[0], mps_version).returncode == 0
        wait_until(lambda: "mpsd_defaults_restored_total 1.0" in http_get(port, "/metrics")[1], what="restored")
        holder = RawHolder(config.control_binary, config.pipe_dir)
        try:
            wait_until(lambda: http_get(port, "/readyz")[0] == 503, what="not ready while held")
            code, body = http_get(port, "/readyz")
            assert "no health verdict" in body and f"pid {holder.proc.pid}" in body
            assert metric(http_get(port, "/metrics")[1], "mpsd_health_verdict_age_seconds") >= 2
        finally:
            holder.release()
        wait_until(lambda: http_get(port, "/readyz")[0] == 200, what="ready again")
        assert metric(http_get(port, "/metrics")[1], "mpsd_daemon_restarts_total") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.fixture(scope="module")
def silent_holder(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("holder") / "silent_holder"
    source = Path(__file__).with_name("silent_holder.c")
    subprocess.run(["cc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", str(source), "-o", str(exe)], check=True)
    return exe


@pytest.mark.parametrize("kind", ["front-end", "silent-socket"])
def test_a_session_held_from_a_container_is_named_with_the_container(
    make_config, run_supervisor, podman, mps_control, silent_holder, kind
):
    # A pod's process (a podman container: its own network and PID namespaces, the pipe dir
    # mounted read-only as pods get it) holds the daemon's session: the real front-end waiting
    # on its stdin, or a socket that connects and sends nothing. The daemon is not killed, and
    # /readyz names the PID and the container from its cgroup.
    config = make_config(**{"health-timeout": "1s", "verdict-timeout": "2s"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    exe = "/usr/local/bin/holder"
    release = Path(config.state_dir) / "release"
    release.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(release)
    binary = mps_control if kind == "front-end" else silent_holder
    command = exe if kind == "front-end" else f"{exe} {config.pipe_dir}/control"
    mounts = [Mount(config.pipe_dir, config.pipe_dir), *HOST_LIBS, Mount(binary, exe)]
    mounts.append(Mount(str(release.parent), "/hold"))
    run = threading.Thread(
        target=podman.run,
        args=(["sh", "-c", f"cat /hold/release | {command}"],),
        kwargs={"mounts": mounts, "env": {"CUDA_MPS_PIPE_DIRECTORY": config.pipe_dir}, "user": "1000", "timeout": 120},
        daemon=True,
    )
    run.start()
    writer = None
    try:
        writer = open(release, "w")  # noqa: SIM115 (closed below: that releases the session)
        wait_until(lambda: not _ready(r.board)[0], timeout=90, what="not ready while held from the container")
        reason = _ready(r.board)[1]
        ids = podman.podman("ps", "--quiet", "--no-trunc").stdout.split()
        assert ids and f"container {ids[0][:12]}" in reason, reason
        time.sleep(3 * config.health_timeout)  # more checks while it is held: still not killed
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0
    finally:
        if writer is not None:
            writer.close()
        run.join(120)
    wait_until(lambda: _ready(r.board)[0], what="ready again once the container's session ended")
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0
