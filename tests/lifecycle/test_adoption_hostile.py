"""Adoption against what a tenant or a spelling can do to the proof (issue 33, rows 7 and 8), with
the real daemon of each Debian version:

- Row 7: the holder and ``mpsd run`` spell the pipe dir differently (a symlink on the way): the
  genuine daemon is adopted, with one line naming both spellings, and no impostor is counted.
- Row 8: root in a pod (podman, the read-only Allocate mounts) fills ``control_privileged``'s
  queue before mpsd starts: mpsd does not adopt what it cannot prove, but names the pod holding
  the queue in ``/readyz``'s reason, retries with backoff, and adopts once the pod lets go.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest

from mpsd.daemon import peer
from tests.container import HOST_LIBS, Mount
from tests.daemon.test_genuine import kill_and_reap, start
from tests.daemon.test_pipe_dir_readonly import PYTHON, allocate_mounts
from tests.rollout import Node, read, wait_until

pytestmark = [pytest.mark.mps_binary, pytest.mark.every_mps_version]


def test_a_pipe_dir_spelled_two_ways_is_one_directory_not_an_impostor(mps_control, tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("s"), mps_control)
    try:
        alias = node.work.parent / f"{node.work.name}-alias"
        alias.symlink_to(node.work)
        holder = node.spawn("holder", **{"pipe-dir": str(alias / "pipe")})
        daemon = wait_until(node.daemon_pid, "the holder's daemon")
        run, _ = node.start_timed()
        assert node.metric("mpsd_control_impostors_total") == {"": 0.0}
        said = [line for line in read(run).splitlines() if "spelled two ways" in line]
        assert len(said) == 1 and f"names its pipe dir {alias / 'pipe'}, mpsd {node.pipe}" in said[0], said
        assert psutil.Process(daemon).ppid() == holder.pid and node.daemon_pid() == daemon
    finally:
        node.close()


POD_QUEUE = r"""
import os, socket, sys, time
path, signals = sys.argv[1:3]
held = []
while len(held) < 1000:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(0.5)
    try:
        s.connect(path)
    except OSError:
        s.close()
        break
    held.append(s)
print(len(held), flush=True)
open(os.path.join(signals, "ready"), "w").close()
deadline = time.monotonic() + 300
while not os.path.exists(os.path.join(signals, "release")) and time.monotonic() < deadline:
    time.sleep(0.1)
"""
MARK = "mpsd-test-queue-holder"


def test_a_pod_holding_the_daemons_queue_is_named_and_adoption_retries(podman, make_config, run_supervisor,
                                                                        tmp_path):  # fmt: skip
    config = make_config(**{"daemon-lifecycle": "independent", "restart-backoff-max": "1s"})
    daemon = start(config)
    signals = tmp_path / "signals"
    signals.mkdir(mode=0o777)
    area = tmp_path / "allocation"
    area.mkdir()
    mounts = [*allocate_mounts(Path(config.pipe_dir), area), *HOST_LIBS, Mount(PYTHON, PYTHON),
              Mount(signals, "/signals", read_only=False)]  # fmt: skip
    argv = [PYTHON, "-c", POD_QUEUE, f"{config.pipe_dir}/control_privileged", "/signals", MARK]
    result: list = []
    thread = threading.Thread(target=lambda: result.append(podman.run(argv, mounts=mounts, timeout=400)), daemon=True)
    thread.start()
    try:
        adopted_after_release(podman, config, daemon, run_supervisor, signals, thread, result)
    finally:
        kill_and_reap(daemon)


def adopted_after_release(podman, config, daemon, run_supervisor, signals, thread, result) -> None:
    try:
        wait_until(lambda: (signals / "ready").exists() or not thread.is_alive(), "the pod to fill the queue", 120)
        assert thread.is_alive(), result[0].output if result else "the pod ended"
        (holder,) = [p for p in psutil.process_iter(["cmdline"])  # the pod's process, not podman's
                     if (p.info["cmdline"] or [""])[0] == PYTHON and MARK in p.info["cmdline"]]
        who = peer.describe(holder.pid)
        assert "container " in who  # the pod, from its cgroup
        r = run_supervisor(config)
        state = r.wait_for(lambda s: "its queue is full" in s.last_error, what="the reason naming the queue")
        assert f"held by {who}" in state.last_error and not state.daemon_up
        failures = r.sup.status().failures_in_row
        r.wait_for(lambda s: r.sup.status().failures_in_row > failures, what="a retry")  # backoff, not given up
    finally:
        (signals / "release").touch()
        thread.join(120)
    assert result and result[0].returncode == 0, result[0].output if result else "no result"
    assert int(result[0].stdout.split()[0]) > 1  # the queue took connections until it was full
    r.wait_for(lambda s: s.daemon_up and s.configured and r.sup.status().pid == daemon, what="the daemon adopted")
    r.stop()
