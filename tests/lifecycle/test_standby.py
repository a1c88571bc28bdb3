"""A DaemonSet rolling with maxSurge starts the new mpsd beside the old one: the new ``mpsd run``
(``daemonLifecycle: independent``, ``POD_UID`` set) stands by instead of exiting, is ready while
the old one supervises a daemon it proves genuine without sending it a command, and adopts the
daemon once the old one is gone (mpsd/lifecycle/standby.py). Real ``mpsd run`` and ``mpsd holder``
processes, the real control daemon, an ``mpsd exec`` client holding memory throughout."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rollout import Node, free_port, http_get, read, stop, wait_until

pytestmark = pytest.mark.mps_binary
G = 1 << 30
REPO = Path(__file__).resolve().parents[2]
OLD, NEW = "0b5d9a62-1f2e-4c3d-8e9f-0a1b2c3d4e5f", "7c1e2d3f-4a5b-4c6d-9e8f-1a2b3c4d5e6f"
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ mpsd\.")


@pytest.fixture
def node(mps_control, shim_lib, fake_cuda_dir, tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("s"), mps_control, shim_lib, fake_cuda_dir)
    yield n
    n.close()


def pod(uid: str) -> dict[str, str]:
    return {"POD_UID": uid}


def settled_commands(node: Node) -> list[str]:
    """control.log's commands once it stops growing (the daemon writes after it answers)."""
    seen = node.commands()
    while True:
        time.sleep(0.3)
        now = node.commands()
        if now == seen:
            return now
        seen = now


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_surged_mpsd_stands_by_ready_and_adopts_the_daemon_when_the_old_one_goes(node, sig):
    node.spawn("holder")
    wait_until(node.daemon_pid, "the holder's daemon")
    # The old instance checks its daemon only once (at adoption): every command in control.log
    # from then on would be the standby's.
    old, _ = node.start_timed(pod(OLD), **{"health-interval": "60m"})
    client = node.exec_client("web", "1G")
    daemon, servers = node.daemon_pid(), node.servers()
    commands = settled_commands(node)

    port = free_port()
    new, _ = node.start_timed(pod(NEW), port=port)  # ready while the old one runs
    assert old.poll() is None and new.poll() is None
    assert node.metric("mpsd_standby", port) == {"": 1.0} and node.metric("mpsd_daemon_up", port) == {"": 1.0}
    assert http_get(port, "/healthz")[0] == 200
    time.sleep(1.5)  # three of the standby's looks at the daemon (healthInterval 0.5s)
    assert settled_commands(node) == commands, "the standby sent the daemon a command"
    lines = read(new)
    assert f"another mpsd run (pid {old.pid} " in lines and f"standing by as instance {NEW}" in lines
    assert f"standing by: the control daemon pid={daemon} is genuine, supervised by mpsd run pid {old.pid}" in lines
    assert "adopted" not in lines
    new.send_signal(signal.SIGHUP)  # a reload asked while standing by is done once supervising
    time.sleep(0.3)

    assert stop(old, sig) == (0 if sig == signal.SIGTERM else -9), read(old)
    wait_until(lambda: f"adopted the running control daemon pid={daemon}" in read(new), "the adoption")
    wait_until(lambda: "SIGHUP received while starting: reloading once started" in read(new), "the reload")
    assert node.daemon_pid() == daemon and node.quits() == 0
    assert node.metric("mpsd_standby", port) == {"": 0.0}
    assert wait_until(lambda: node.ready(port), "ready as the supervisor")
    assert node.defaults() == (50, 2 * G, 1) and node.servers() == servers
    assert client.poll() is None, read(client)
    assert wait_until(lambda: node.metric("mpsd_region_memory_used_bytes", port), "the region's series") == {
        '{device="0",region="web"}': 1 * G}
    assert node.metric("mpsd_daemon_restarts_total", port) == {"": 0.0}
    assert node.metric("mpsd_defaults_restored_total", port) == {"": 0.0}
    assert stop(new) == 0 and node.daemon_pid() == daemon and node.quits() == 0


def test_sigterm_while_standing_by_exits_0_and_touches_nothing(node):
    node.spawn("holder")
    wait_until(node.daemon_pid, "the holder's daemon")
    old, _ = node.start_timed(pod(OLD), **{"health-interval": "60m"})
    daemon = node.daemon_pid()
    commands = settled_commands(node)
    port = free_port()
    new, _ = node.start_timed(pod(NEW), port=port)
    began = time.monotonic()
    assert stop(new) == 0, read(new)
    assert time.monotonic() - began < 15  # not a poll's worth of waiting for the lock
    assert "stopped while standing by: the control daemon and the other mpsd run left alone" in read(new)
    assert node.daemon_pid() == daemon and old.poll() is None and node.ready()
    assert settled_commands(node) == commands
    assert node.lock("run").read_text().strip() == str(old.pid)  # the old one's still


def test_a_standby_acts_on_nothing_an_impostor_serves(node, procs):
    """Sockets renamed over the daemon's while standing by: the standby is not ready and says
    why, sends nothing and signals no one (neither the genuine daemon behind the impostor, as a
    supervisor would, nor the impostor or the 'client' it names). Only the supervisor acts."""
    node.spawn("holder")
    daemon = wait_until(node.daemon_pid, "the holder's daemon")
    old, _ = node.start_timed(pod(OLD), **{"health-interval": "60m"})
    commands = settled_commands(node)
    port = free_port()
    new, _ = node.start_timed(pod(NEW), port=port)
    victim = subprocess.Popen(["sleep", "600"])
    procs.append(victim)
    impostor = subprocess.Popen([sys.executable, "-m", "tests.impostor", str(node.pipe), str(victim.pid)],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip
    procs.append(impostor)
    assert impostor.stdout is not None and impostor.stdout.readline().strip() == "listening"
    status, body = wait_until(lambda: (r := http_get(port, "/readyz"))[0] == 503 and r, "the standby not ready")
    assert body.startswith(f"standing by for mpsd run pid {old.pid} ") and f"pid {impostor.pid}" in body, body
    time.sleep(1.5)  # three more looks
    assert node.daemon_pid() == daemon and victim.poll() is None and impostor.poll() is None
    assert old.poll() is None and new.poll() is None
    assert settled_commands(node) == commands
    assert node.metric("mpsd_control_impostors_total", port) == {"": 0.0}  # the supervisor's to count


def test_the_standbys_readiness_follows_the_daemon_it_proves(node):
    """The holder stopped (its daemon quit): nothing on the pipe dir is genuine, the standby
    says why in /readyz; a new holder's daemon makes it ready again, the old mpsd still running."""
    holder = node.spawn("holder")
    wait_until(node.daemon_pid, "the holder's daemon")
    old, _ = node.start_timed(pod(OLD))
    port = free_port()
    node.start_timed(pod(NEW), port=port)
    assert stop(holder) == 0
    status, body = wait_until(lambda: (r := http_get(port, "/readyz"))[0] == 503 and r, "the standby not ready")
    assert body.startswith(f"standing by for mpsd run pid {old.pid} "), body
    assert f"no control daemon on pipe dir {node.pipe}" in body
    assert node.metric("mpsd_daemon_up", port) == {"": 0.0} and node.metric("mpsd_standby", port) == {"": 1.0}
    node.spawn("holder")
    wait_until(lambda: node.ready(port), "the standby ready again")
    assert old.poll() is None


def test_two_instances_started_at_once_one_supervises_and_the_other_takes_over(node):
    """Both pods of a rollout start together (a node joining mid-rollout, a kubelet restart):
    one takes the lock, the other stands by; killing the supervisor hands the daemon over,
    round after round, and never to two at once."""
    ports = {OLD: node.port, NEW: free_port()}

    def spawn(uid: str):
        return node.spawn("run", pod(uid), **{"metrics-address": f"127.0.0.1:{ports[uid]}"})

    runs = {uid: spawn(uid) for uid in ports}
    daemon = wait_until(node.daemon_pid, "a daemon")
    for round_ in range(4):
        wait_until(lambda: all(node.ready(p) for p in ports.values()), f"round {round_}: both ready")
        standing = [uid for uid in ports if node.metric("mpsd_standby", ports[uid]) == {"": 1.0}]
        assert len(standing) == 1, f"round {round_}: standing by: {standing}"
        supervisor = next(uid for uid in ports if uid not in standing)
        assert stop(runs[supervisor], signal.SIGKILL if round_ % 2 else signal.SIGTERM) in (0, -9)
        heir = runs[standing[0]]
        wait_until(lambda: f"adopted the running control daemon pid={daemon}" in read(heir),  # noqa: B023
                   f"round {round_}: the adoption")  # fmt: skip
        runs[supervisor] = spawn(supervisor)
    assert node.daemon_pid() == daemon and node.quits() == 0


@pytest.mark.parametrize("env, lifecycle", [({}, "independent"), (pod(NEW), "owned")], ids=["no-pod-uid", "owned"])
def test_a_second_run_that_is_no_rollout_instance_still_exits_1_naming_the_first(node, env, lifecycle):
    first, _ = node.start_timed(pod(OLD))
    second = node.spawn("run", env, **{"daemon-lifecycle": lifecycle, "metrics-address": f"127.0.0.1:{free_port()}"})
    assert second.wait(60) == 1
    lines = [line for line in read(second).splitlines() if not LOG_RECORD.match(line)]
    assert lines == [f"mpsd: pipe dir {node.pipe}: another mpsd run (pid {first.pid}) holds {node.lock('run')}; "
                     "stop it or give this one another pipeDir"]
    assert first.poll() is None


def test_a_malformed_pod_uid_is_one_line(node):
    node.start_timed(pod(OLD))
    second = node.spawn("run", pod("../x"), **{"metrics-address": f"127.0.0.1:{free_port()}"})
    assert second.wait(60) == 1
    lines = [line for line in read(second).splitlines() if not LOG_RECORD.match(line)]
    assert len(lines) == 1 and lines[0].startswith("mpsd: bad POD_UID '../x': expected a pod UID"), lines
