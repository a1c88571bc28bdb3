"""Pods of any UID (mpsd/daemon/multiuser.py) against every real daemon version.

Without a GPU the real nvidia-cuda-mps-server exits at once, so a fake one comes first on the
daemon's PATH (the daemon finds the server through PATH, seen with strace): it stays and never
says Ready. The daemon then holds a server of the first client's UID, lists it in
get_server_list (550+: INITIALIZING), and queues a client of another UID exactly as NVIDIA's
man page says and as the logs in k8s-device-plugin #679 and dra-driver-nvidia-gpu #1153 show:
"NEW CLIENT <pid> from user <uid>: Server is not ready, push client to pending list", with no
new server for it. The clients are tests/daemon/pending_client.c (real processes of other
UIDs that map a libcuda.so and introduce themselves to the real daemon as CUDA clients do).
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.daemon import multiuser
from mpsd.errors import ConfigError, SetupError
from mpsd.registry import Metrics
from mpsd.node import InventoryPump, _observer
from mpsd.status import collect_status, render_status
from tests.container import HOST_LIBS, Mount
from tests.mpsbin import knows_multiuser_server
from tests.test_cli import flags, mpsd
from tests.daemon.test_control_real import NoGpus
from tests.lifecycle.test_supervisor import wait_until

pytestmark = [
    pytest.mark.mps_binary,
    pytest.mark.skipif(os.geteuid() != 0, reason="processes of other UIDs and -multiuser-server need root"),
]
REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


# ---------------------------------------------------------------- pure parts

HELP = (
    "CUDA MPS Control for Linux/Unix.\nCopyright (C) 2003 - 2024 NVIDIA Corporation.\n\n  This program allows "
    "multiple CUDA processes to share a single GPU context. For information on how to use the CUDA MPS, see the "
    "nvidia-cuda-mps-control manual page.\n\n"
)


@pytest.mark.parametrize(
    "output,exited,supported,says",
    [  # what each binary printed to ``-f -multiuser-server`` (tests below run the real ones)
        ("[2026-11-26 17:23:49.426 Control 12578] Starting control daemon using socket /p/control\n", False, True,
         "started with -multiuser-server"),
        (HELP + "Only root user may enable -multiuser-server!\n", True, False, "root only"),
        ("Cannot find MPS control daemon process\n", True, False, "ran as a front-end"),
        (HELP, True, False, "refused -multiuser-server"),
        ("", True, False, "printed 'nothing'"),
        ("", False, False, "no answer to -multiuser-server in 2s"),
    ],
)
def test_classify_the_answer_to_the_option(output, exited, supported, says):
    found = multiuser.classify(output, exited, 2.0)
    assert found.supported is supported and says in found.answer


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Name:\tsleep\nUid:\t1000\t1000\t1000\t1000\nPPid:\t42\n", (1000, 42)),
        ("PPid:\t1\nUid:\t0\t0\t0\t0\n", (0, 1)),
        ("Name:\tx\nUid:\t\n", None),
        ("", None),
        ("Uid:\tabc\nPPid:\t1\n", None),
    ],
)
def test_parse_status(text, expected):
    assert multiuser.parse_status(text) == expected


@pytest.mark.parametrize("text,expected", [("on", "on"), ("off", "off"), ('"auto"', "auto"), ("yes", "on"),
                                           ('"ON"', "on")])
def test_multi_user_in_the_file_bare_yaml_on_off_included(tmp_path, text, expected):
    path = tmp_path / "mpsd.yaml"
    path.write_text(f"version: v1\nmultiUser: {text}\n")
    assert cfg.load(str(path), {}, {}).multi_user == expected


def test_a_bad_multi_user_is_one_line_naming_it(tmp_path):
    path = tmp_path / "mpsd.yaml"
    path.write_text("version: v1\nmultiUser: sometimes\n")
    with pytest.raises(ConfigError, match=r'mpsd.yaml: multiUser: expected auto, on or off, got "sometimes"$'):
        cfg.load(str(path), {}, {})
    assert cfg.load(None, {"MPSD_MULTI_USER": "off"}, {}).multi_user == "off"
    assert cfg.load(None, {}, {}).multi_user == "auto"


def test_resolve_each_mode():
    yes, no = multiuser.Probe(True, "it started"), multiuser.Probe(False, "it ignores the option")
    asked = []

    def ask(answer):
        return lambda binary, timeout: asked.append(binary) or answer

    assert multiuser.resolve("off", "b", 1, ask(yes)) == multiuser.UidPolicy(False, (), "multiUser off")
    assert asked == []  # off does not even ask
    assert multiuser.resolve("auto", "b", 1, ask(yes)).options == ("-multiuser-server",)
    assert multiuser.resolve("auto", "b", 1, ask(no)) == multiuser.UidPolicy(
        False, (), "multiUser auto: it ignores the option"
    )
    assert multiuser.resolve("on", "b", 1, ask(yes)).multi_user
    with pytest.raises(SetupError, match=r"^multiUser on: control binary 'b' cannot serve several UIDs: it ignores"):
        multiuser.resolve("on", "b", 1, ask(no))


def test_the_watch_logs_each_waiting_client_once_and_at_most_a_few_per_check(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="mpsd.daemon.multiuser")
    found: list[multiuser.Waiting] = []
    monkeypatch.setattr(multiuser, "waiting_clients", lambda *args: list(found))
    watch = multiuser.WaitingWatch("/pipe")
    found[:] = [multiuser.Waiting(pid, 1001, ((7, 1000),), f"pid {pid} ('w')") for pid in range(100, 130)]
    assert [w.pid for w in watch.check(1, [7])] == list(range(100, 130))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == multiuser.LOGGED_PER_CHECK + 1 and lines[-1].startswith("22 more MPS clients waiting")
    caplog.clear()
    del found[1:]
    assert [w.pid for w in watch.check(1, [7])] == [100]
    assert len(caplog.records) == 29 and all("no longer waits" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the real binaries


@pytest.mark.every_mps_version
def test_the_probe_reads_the_option_from_each_binary(mps_control, mps_version):
    found = multiuser.probe(str(mps_control), 10.0)
    assert found.supported is knows_multiuser_server(mps_version), found
    if not found.supported:  # 535 and 550 ignore it and run as a front-end
        assert "ran as a front-end" in found.answer
    assert not list(Path(tempfile.gettempdir()).glob("mpsd-probe-*")), "the probe's pipe dir was left"


@pytest.mark.every_mps_version
def test_a_non_root_user_cannot_start_a_multi_user_daemon(mps_control, mps_version, tmp_path):
    scratch = Path(tempfile.mkdtemp(prefix="mu", dir="/tmp"))
    scratch.chmod(0o777)
    try:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(scratch), CUDA_MPS_LOG_DIRECTORY=str(scratch))
        done = subprocess.run([str(mps_control), "-f", "-multiuser-server"], env=env, capture_output=True, text=True,
                              timeout=30, user=NOBODY, group=NOBODY, extra_groups=[], stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(scratch)
    found = multiuser.classify(done.stdout + done.stderr, True, 0.0)
    assert done.returncode == 1 and not found.supported
    assert ("root only" if knows_multiuser_server(mps_version) else "ran as a front-end") in found.answer, found


@pytest.fixture(scope="module")
def world(fake_cuda_dir):
    """A directory every UID can read: the stand-in client, the fake libcuda.so.1 it maps, and a
    fake nvidia-cuda-mps-server (stays, never ready) for the daemon's PATH."""
    root = Path(tempfile.mkdtemp(prefix="mu", dir="/tmp"))
    root.chmod(0o755)
    source = Path(__file__).with_name("pending_client.c")
    subprocess.run(["cc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", str(source), "-o",
                    str(root / "pending_client"), "-ldl"], check=True)
    shutil.copy(fake_cuda_dir / "libcuda.so.1", root / "libcuda.so.1")
    (root / "bin").mkdir(mode=0o755)
    server = root / "bin" / "nvidia-cuda-mps-server"
    server.write_text("#!/bin/sh\nexec sleep 600\n")
    server.chmod(0o755)
    yield root
    shutil.rmtree(root)


def start_client(world: Path, config: cfg.Config, uid: int, procs: list) -> subprocess.Popen:
    proc = subprocess.Popen(
        [str(world / "pending_client"), f"{config.pipe_dir}/control", str(world / "libcuda.so.1")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=uid, group=uid,
        extra_groups=[],
    )
    procs.append(proc)
    said = select.select([proc.stdout], [], [], 60)[0]
    line = proc.stdout.readline() if said else ""
    if line != f"pending {proc.pid}\n":  # what the client and the daemon said (restarted? another connection?)
        log = Path(config.log_dir) / "control.log"
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else ["no control.log"]
        try:
            proc.wait(10)
            stderr = proc.stderr.read()
        except subprocess.TimeoutExpired:
            stderr = "still running" if said else "still running, silent for 60s"
        raise AssertionError(f"client of uid {uid}: {line!r}, {stderr!r}; the daemon's last lines:\n" + "\n".join(tail))
    return proc


def uid_of(pid: int) -> int:
    return multiuser.parse_status(Path(f"/proc/{pid}/status").read_text())[0]


def metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.every_mps_version
def test_a_client_waiting_for_another_uids_server_is_named_within_a_health_interval(
    make_config, run_supervisor, world, monkeypatch, procs, caplog, mps_version
):
    monkeypatch.setenv("PATH", f"{world}/bin:{os.environ['PATH']}")
    caplog.set_level(logging.INFO, logger="mpsd.daemon.multiuser")
    config = make_config(**{"multi-user": "off", "shutdown-timeout": "1s"})  # 555 queues too without the option
    metrics = Metrics()
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured, what="configured")
    first = start_client(world, config, 1000, procs)
    wait_until(lambda: len(r.sup.status().servers) == 1, what="a server for uid 1000")
    server = r.sup.status().servers[0]
    assert uid_of(server) == 1000
    same_uid = start_client(world, config, 1000, procs)  # waits for its own server only
    checks = r.sup.status().health_checks
    other = start_client(world, config, 1001, procs)
    wait_until(lambda: r.sup.status().waiting, what="the waiting client reported")
    # the first health check that began after it connected saw it (the one running then may not)
    assert r.sup.status().health_checks <= checks + 2
    (waiting,) = r.sup.status().waiting
    assert (waiting.pid, waiting.uid, waiting.servers) == (other.pid, 1001, ((server, 1000),))
    assert f"pid {other.pid} ('pending_client')" in waiting.who
    assert {first.pid, same_uid.pid}.isdisjoint(w.pid for w in r.sup.status().waiting)
    lines = [rec.getMessage() for rec in caplog.records if "waits for an MPS server" in rec.getMessage()]
    assert len(lines) == 1 and f"pid {other.pid}" in lines[0] and "uid 1001" in lines[0]
    assert f"server pid {server} of uid 1000" in lines[0] and "only once every client of uid 1000 has exited" in lines[0]
    scrape = metrics.scrape().decode()
    assert metric(scrape, "mpsd_mps_clients_waiting") == 1 and metric(scrape, "mpsd_mps_multi_user") == 0
    # what the daemon itself says and shows: the queued client in its log, nowhere in its lists
    log = (Path(config.log_dir) / "control.log").read_text()
    assert f"NEW CLIENT {other.pid} from user 1001: Server is not ready, push client to pending list" in log
    assert re.search(r"Starting new server \d+ for user 1001", log) is None
    data = collect_status(config, inventory=NoGpus())
    assert data["multiUser"] is False and [w["pid"] for w in data["waiting"]] == [other.pid]
    assert data["clients"] == [] and [s["pid"] for s in data["servers"]] == [server]
    assert f"WAITING for another UID's server: pid {other.pid}" in render_status(data)
    time.sleep(3 * config.health_interval)  # reported once, not at every check
    assert len([rec for rec in caplog.records if "waits for an MPS server" in rec.getMessage()]) == 1
    other.stdin.close()
    other.wait(10)
    wait_until(lambda: not r.sup.status().waiting, what="the client gone")
    assert any(f"pid={other.pid} no longer waits" in rec.getMessage() for rec in caplog.records)
    wait_until(lambda: metric(metrics.scrape().decode(), "mpsd_mps_clients_waiting") == 0, what="the metric at 0")
    pump.close()


@pytest.mark.every_mps_version
def test_multi_user_auto_serves_every_uid_where_the_daemon_can(
    make_config, run_supervisor, world, monkeypatch, procs, mps_version
):
    monkeypatch.setenv("PATH", f"{world}/bin:{os.environ['PATH']}")
    config = make_config(**{"shutdown-timeout": "1s"})  # multiUser auto
    metrics = Metrics()
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured, what="configured")
    multi = knows_multiuser_server(mps_version)
    daemon = r.sup.status().pid
    assert r.sup.status().multi_user is multi
    assert multiuser.daemon_is_multi_user(daemon) is multi
    assert metric(metrics.scrape().decode(), "mpsd_mps_multi_user") == (1 if multi else 0)
    start_client(world, config, 1000, procs)
    wait_until(lambda: len(r.sup.status().servers) == 1, what="a server")
    other = start_client(world, config, 1001, procs)
    checks = r.sup.status().health_checks
    wait_until(lambda: r.sup.status().health_checks >= checks + 2, what="two health checks")
    log = (Path(config.log_dir) / "control.log").read_text()
    if multi:  # one root server for both: nobody waits, both are "user 0" to the daemon
        assert uid_of(r.sup.status().servers[0]) == 0 and r.sup.status().waiting == ()
        assert f"NEW CLIENT {other.pid} from user 0:" in log
        assert collect_status(config, inventory=NoGpus())["multiUser"] is True
    else:
        assert [w.pid for w in r.sup.status().waiting] == [other.pid]
        assert f"NEW CLIENT {other.pid} from user 1001:" in log
    pump.close()


@pytest.mark.every_mps_version
def test_multi_user_on_starts_the_option_or_refuses_in_one_line(make_config, run_supervisor, mps_version):
    r = run_supervisor(make_config(**{"multi-user": "on"}))
    if knows_multiuser_server(mps_version):
        r.wait_for(lambda s: s.configured, what="configured")
        assert multiuser.daemon_is_multi_user(r.sup.status().pid) is True
        return
    r.thread.join(30)
    (error,) = r.result
    assert isinstance(error, SetupError) and "\n" not in str(error)
    assert str(error).startswith("multiUser on: control binary") and "ran as a front-end" in str(error)


def test_mpsd_run_with_multi_user_on_and_a_daemon_before_555_exits_with_one_line(mps_control, mps_dirs, mps_version):
    if knows_multiuser_server(mps_version):
        pytest.skip(f"{mps_version} (the first selected daemon version) supports -multiuser-server")
    result = mpsd("run", *flags(mps_control, mps_dirs), "--multi-user", "on")
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("mpsd: multiUser on: control binary") and "driver 555 or later" in line


def test_a_waiting_client_in_a_pod_is_named_with_its_pod(make_config, run_supervisor, world, monkeypatch, procs,
                                                        podman):
    # A pod's process: a real container whose cgroup sits where the kubelet puts a pod's
    # (kubepods/<qos>/pod<uid>/<container>), UID 1001, the pipe dir mounted read-only.
    monkeypatch.setenv("PATH", f"{world}/bin:{os.environ['PATH']}")
    config = make_config(**{"multi-user": "off", "shutdown-timeout": "1s"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    start_client(world, config, 1000, procs)
    wait_until(lambda: len(r.sup.status().servers) == 1, what="a server for uid 1000")
    pod = str(uuid.uuid4())
    release = Path(tempfile.mkdtemp(prefix="mu", dir="/tmp"))
    release.chmod(0o755)
    os.mkfifo(release / "release")
    mounts = [Mount(config.pipe_dir, config.pipe_dir), *HOST_LIBS, Mount(world / "pending_client", "/usr/local/bin/c"),
              Mount(world / "libcuda.so.1", "/usr/local/lib/libcuda.so.1"), Mount(release, "/hold")]
    command = f"cat /hold/release | /usr/local/bin/c {config.pipe_dir}/control /usr/local/lib/libcuda.so.1"
    run = threading.Thread(
        target=podman.run, args=(["sh", "-c", command],),
        kwargs={"mounts": mounts, "user": "1001", "timeout": 120,
                "extra": [f"--cgroup-parent=/kubepods/besteffort/pod{pod}"]},
        daemon=True,
    )
    run.start()
    writer = None
    try:
        writer = open(release / "release", "w")  # noqa: SIM115 (closed below: the client ends)
        wait_until(lambda: r.sup.status().waiting, timeout=90, what="the pod's client reported")
        (waiting,) = r.sup.status().waiting
        ids = podman.podman("ps", "--quiet", "--no-trunc").stdout.split()
        assert waiting.uid == 1001 and f"pod {pod}" in waiting.who and f"container {ids[0][:12]}" in waiting.who
    finally:
        if writer is not None:
            writer.close()
        run.join(120)
        shutil.rmtree(release)
    wait_until(lambda: not r.sup.status().waiting, what="the pod's client gone")


def test_the_probe_of_a_binary_that_never_answers_is_bounded(tmp_path):
    silent = tmp_path / "silent"
    silent.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    silent.chmod(0o755)
    began = time.monotonic()
    found = multiuser.probe(str(silent), 0.5)
    assert not found.supported and "no answer" in found.answer and time.monotonic() - began < 10
