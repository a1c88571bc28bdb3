"""``mpsd holder`` and ``mpsd stop-daemon`` with the real control daemon and real ``mpsd run``
processes: the holder restarts its daemon and ``mpsd run`` adopts each one, a hung one is killed
by mpsd and restarted by the holder, a crash loop backs off without anyone else starting a
daemon, one holder per pipe dir, a daemon the holder did not start is waited for, SIGTERM
quits the daemon; stop-daemon stops only what is its to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from mpsd.daemon import genuine
from tests.rollout import MPSD, REPO, Node, read, stop, wait_until
from tests.daemon.test_genuine import dead

pytestmark = pytest.mark.mps_binary


@pytest.fixture
def node(mps_control, tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("h"), mps_control)
    yield n
    n.close()


def parent(pid: int) -> int:
    return psutil.Process(pid).ppid()


def messages(proc) -> list[str]:
    """The log records, as "LEVEL logger message"."""
    return [line.split(" ", 2)[-1] for line in read(proc).splitlines() if line[:4].isdigit()]


def stop_daemon(node: Node) -> subprocess.CompletedProcess:
    return subprocess.run([*MPSD, "stop-daemon", *node.paths()], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_the_holder_restarts_its_daemon_and_mpsd_adopts_each_one_even_hung(node):
    holder = node.spawn("holder")
    first = wait_until(node.daemon_pid, "the holder's daemon")
    run, _ = node.start_timed()
    os.kill(first, signal.SIGKILL)
    second = wait_until(lambda: node.daemon_pid() not in (None, first) and node.daemon_pid(), "a new daemon")
    assert parent(second) == holder.pid  # the holder's, not one mpsd started detached
    wait_until(lambda: node.ready() and node.metric("mpsd_daemon_restarts_total") == {"": 1.0}, "mpsd on the new one")
    os.kill(second, signal.SIGSTOP)  # hung: mpsd kills the verified PID, the holder starts another
    third = wait_until(lambda: node.daemon_pid() not in (None, second) and node.daemon_pid(), "a third", timeout=90)
    assert parent(third) == holder.pid
    wait_until(lambda: node.ready() and node.defaults()[0] == 50, "mpsd on the third, its defaults applied")
    assert f"daemon pid={second} hung" in read(run)
    assert node.metric("mpsd_defaults_restored_total") == {"": 0.0}  # a new daemon's defaults: not tampering
    assert stop(run) == 0 and node.daemon_pid() == third and node.quits() == 0


def test_sigterm_to_the_holder_quits_its_daemon(node):
    holder = node.spawn("holder")
    daemon = wait_until(node.daemon_pid, "the holder's daemon")
    assert stop(holder) == 0
    said = messages(holder)
    assert node.daemon_pid() is None and dead(daemon), said
    assert f"daemon pid={daemon} stopped (quit)" in said[-1], said
    # the daemon's own record of the command (control.log's Cmd:quit) is written by its log FIFO's
    # reader thread, which its exit can outrun: once beside a CPU hog the daemon was gone, quits()
    # 0 (mpsd's messages not kept then). What proves a quit and not a kill is mpsd's line above.
    assert node.quits() <= 1, (node.commands(), said)


def test_one_holder_per_pipe_dir(node):
    first = node.spawn("holder")
    wait_until(node.daemon_pid, "the holder's daemon")
    second = node.spawn("holder")
    assert second.wait(60) == 1
    out = [line for line in read(second).splitlines() if not line[:4].isdigit()]
    assert out == [f"mpsd: pipe dir {node.pipe}: another mpsd holder (pid {first.pid}) holds "
                   f"{node.lock('holder')}; one holder per pipe dir"]  # fmt: skip
    assert first.poll() is None


def test_a_crash_looping_holder_backs_off_and_nobody_else_starts_a_daemon(node, tmp_path):
    broken = tmp_path / "nvidia-cuda-mps-control"
    broken.write_text("#!/bin/sh\necho 'cannot open the driver' >&2\nexit 1\n")
    broken.chmod(0o755)
    settings = {"control-binary": str(broken), "restart-backoff-initial": "0.1s", "restart-backoff-max": "0.8s"}
    holder = node.spawn("holder", **settings)
    run = node.spawn("run", **settings)
    wait_until(lambda: sum("crash loop" in m for m in messages(holder)) >= 3, "three crash-loop lines", timeout=90)
    said = messages(holder)
    failures = [m for m in said if "exited with status 1" in m]
    assert failures[0].startswith("WARNING") and failures[2].startswith("ERROR")  # a crash loop from the third
    assert "crash loop: 3 failures in a row, next start in 0.4s" in failures[2]
    assert "next start in 0.8s" in failures[-1]  # capped at restartBackoffMax
    assert holder.poll() is None and run.poll() is None
    status, body = node_http(node, "/readyz")
    assert status == 503 and f"waiting for the holder pid {holder.pid}" in body
    assert sum("waiting for the holder" in m for m in messages(run)) == 1  # said once
    assert node.daemon_pid() is None  # mpsd started none of its own beside the holder


def node_http(node: Node, path: str):
    from tests.rollout import http_get

    return http_get(node.port, path)


def test_the_holder_waits_for_a_daemon_it_did_not_start(node):
    run, _ = node.start_timed()  # no holder: mpsd starts the daemon detached
    detached = node.daemon_pid()
    holder = node.spawn("holder")
    wait_until(lambda: any("a control daemon the holder did not start runs" in m for m in messages(holder)), "the wait")
    assert node.daemon_pid() == detached and parent(detached) != holder.pid
    os.kill(detached, signal.SIGKILL)
    own = wait_until(lambda: node.daemon_pid() not in (None, detached) and node.daemon_pid(), "the holder's own")
    assert parent(own) == holder.pid
    wait_until(lambda: node.ready() and node.control().get_default_active_thread_percentage() == 50, "mpsd adopts it")
    assert stop(run) == 0 and node.daemon_pid() == own


def test_stop_daemon_stops_only_what_is_its_to_stop(node):
    run, _ = node.start_timed()
    busy = stop_daemon(node)
    assert busy.returncode == 1 and busy.stderr.startswith(f"mpsd: pipe dir {node.pipe}: another mpsd run (pid {run.pid})")
    daemon = node.daemon_pid()
    assert stop(run) == 0 and node.daemon_pid() == daemon
    holder = node.spawn("holder")  # waits for the detached daemon, and would start another one
    wait_until(lambda: any("did not start runs" in m for m in messages(holder)), "the holder to see it")
    held = stop_daemon(node)
    assert held.returncode == 1 and f"the holder pid {holder.pid}" in held.stderr and node.daemon_pid() == daemon
    assert stop(holder) == 0 and node.daemon_pid() == daemon  # not its daemon: left running
    done = stop_daemon(node)
    assert (done.returncode, done.stdout) == (0, f"control daemon pid {daemon} on pipe dir {node.pipe} stopped (quit)\n")
    assert node.daemon_pid() is None and node.quits() == 1
    again = stop_daemon(node)
    assert (again.returncode, again.stdout) == (0, f"no control daemon runs on pipe dir {node.pipe}\n")


def test_while_the_holder_is_away_mpsd_waits_for_it_rather_than_start_a_daemon(node):
    holder = node.spawn("holder")
    first = wait_until(node.daemon_pid, "the holder's daemon")
    run, _ = node.start_timed()
    assert stop(holder) == 0 and dead(first)  # the holder upgraded: its pod deleted, the daemon quit
    wait_until(lambda: "no mpsd holder running, though one kept it before" in node_http(node, "/readyz")[1], "the wait")
    assert node.daemon_pid() is None and run.poll() is None
    again = node.spawn("holder")
    daemon = wait_until(node.daemon_pid, "the new holder's daemon")
    assert parent(daemon) == again.pid
    wait_until(lambda: node.ready() and node.defaults()[0] == 50, "mpsd on the new holder's daemon")


def test_a_read_lock_on_a_holders_lock_file_left_in_the_pipe_dir_is_nobodys_claim(node, procs):
    """Holders before 0.2 locked ``pipeDir/mpsd-holder.lock``, where any pod can open it read-only
    and read-lock it. Such a lock names no holder: the holder starts, mpsd run adopts its daemon
    rather than wait for a holder the read lock would stand for."""
    node.pipe.mkdir(parents=True)
    (node.pipe / "mpsd-holder.lock").touch(mode=0o600)
    pod = subprocess.Popen([sys.executable, "-c", LOCK_SHARED, str(node.pipe / "mpsd-holder.lock")],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    procs.append(pod)
    assert pod.stdout.readline().strip() == "locked"
    holder = node.spawn("holder")
    wait_until(node.daemon_pid, "the holder's daemon")
    assert genuine.write_lock_holder(str(node.lock("holder"))) == holder.pid
    node.start_timed()


LOCK_SHARED = """
import fcntl, sys, time
f = open(sys.argv[1], "rb")
fcntl.lockf(f, fcntl.LOCK_SH)
print("locked", flush=True)
time.sleep(600)
"""
