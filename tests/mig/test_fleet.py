"""One real nvidia-cuda-mps-control per MIG instance, each supervised like the node daemon: its own
pipe and log dir, CUDA_VISIBLE_DEVICES=MIG-<uuid>, defaults applied, restarted when killed,
restored when tampered with, refused when an impostor serves its socket; instances appearing and
vanishing start and stop daemons; the node's board and the metrics follow each instance."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mpsd.lifecycle.health import HealthBoard
from mpsd.mig.fleet import MigFleet, instance_config, whole_gpus_only
from mpsd.mig.metrics import MigMetrics
from tests.mig.conftest import mig

pytestmark = pytest.mark.mps_binary


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def front_end(config, command: str) -> str:
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=config.pipe_dir, CUDA_MPS_LOG_DIRECTORY=config.log_dir)
    return subprocess.run([config.control_binary], input=command + "\n", capture_output=True, text=True, env=env,
                          timeout=10).stdout.strip()


def daemon_of(fleet: MigFleet, uuid: str) -> psutil.Process:
    run = fleet.get(uuid)
    assert run is not None
    wait_until(lambda: run.status().pid is not None and run.status().state == "running", what=f"{uuid} running")
    return psutil.Process(run.status().pid)


@pytest.fixture
def fleet(mig_config):
    made = []

    def make(**overrides) -> MigFleet:
        registry = CollectorRegistry()
        metrics = MigMetrics(registry)
        f = MigFleet(mig_config(**overrides), HealthBoard(), on_change=metrics.update)
        f.registry = registry  # for the test's scrape
        made.append(f)
        return f

    yield make
    for f in made:
        f.stop()


def test_each_instance_gets_its_own_configured_daemon(fleet):
    f = fleet()
    a, b = mig(1), mig(2, "3g.40gb", gpu=2)
    f.reconcile([a, b])
    wait_until(lambda: f.board.current().mig_healthy == {a.uuid, b.uuid}, what="both healthy")
    for device in (a, b):
        run = f.get(device.uuid)
        assert run.config.pipe_dir == os.path.join(f.config.mig.pipe_root, device.uuid)
        assert run.config.log_dir == os.path.join(f.config.log_dir, device.uuid)
        proc = daemon_of(f, device.uuid)
        env = proc.environ()
        assert env["CUDA_VISIBLE_DEVICES"] == device.uuid
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == run.config.pipe_dir
        assert front_end(run.config, "get_default_active_thread_percentage") == "60.0"
        assert Path(run.config.pipe_dir, "control").is_socket()
    assert daemon_of(f, a.uuid).pid != daemon_of(f, b.uuid).pid
    text = generate_latest(f.registry).decode()
    assert f'mpsd_mig_daemon_up{{gpu="1",instance="{a.uuid}",profile="1g.10gb"}} 1.0' in text
    assert f'mpsd_mig_device_healthy{{gpu="2",instance="{b.uuid}",profile="3g.40gb"}} 1.0' in text
    assert "mpsd_mig_instances 2.0" in text


def test_a_killed_instance_daemon_is_restarted_and_the_other_left_alone(fleet):
    f = fleet()
    a, b = mig(1), mig(2)
    f.reconcile([a, b])
    wait_until(lambda: f.board.current().mig_healthy == {a.uuid, b.uuid}, what="both healthy")
    victim, bystander = daemon_of(f, a.uuid), daemon_of(f, b.uuid)
    generation = f.board.current().generation
    victim.send_signal(signal.SIGKILL)
    wait_until(lambda: f.get(a.uuid).status().restarts >= 1 and a.uuid in f.board.current().mig_healthy,
               what="restarted")
    assert daemon_of(f, a.uuid).pid != victim.pid
    assert daemon_of(f, b.uuid).pid == bystander.pid and f.get(b.uuid).status().restarts == 0
    assert f.board.current().generation > generation
    text = generate_latest(f.registry).decode()
    assert f'mpsd_mig_daemon_restarts{{gpu="1",instance="{a.uuid}",profile="1g.10gb"}} 1.0' in text


def test_defaults_changed_behind_mpsd_are_restored_on_that_instance(fleet):
    f = fleet()
    a = mig(1)
    f.reconcile([a])
    wait_until(lambda: a.uuid in f.board.current().mig_healthy, what="healthy")
    config = f.get(a.uuid).config
    assert front_end(config, "set_default_active_thread_percentage 10") == "10.0"
    wait_until(lambda: f.get(a.uuid).status().defaults_restored >= 1, what="restored")
    assert front_end(config, "get_default_active_thread_percentage") == "60.0"


def test_an_impostor_on_an_instance_socket_gets_that_daemon_restarted(fleet, procs):
    f = fleet()
    a = mig(1)
    f.reconcile([a])
    wait_until(lambda: a.uuid in f.board.current().mig_healthy, what="healthy")
    config = f.get(a.uuid).config
    first = daemon_of(f, a.uuid).pid
    victim = subprocess.Popen(["sleep", "60"])
    procs.append(victim)
    # what a writer of the pipe dir can do: its own sockets renamed over the daemon's
    impostor = subprocess.Popen([sys.executable, "-m", "tests.impostor", config.pipe_dir, str(victim.pid)],
                                cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    procs.append(impostor)
    assert impostor.stdout.readline().strip() == "listening"
    wait_until(lambda: f.get(a.uuid).status().impostors >= 1, what="impostor seen")
    wait_until(lambda: f.get(a.uuid).status().pid not in (None, first), what="daemon restarted")


def test_instances_appearing_and_vanishing_start_and_stop_daemons(fleet):
    f = fleet()
    a, b, c = mig(1), mig(2), mig(3, "2g.20gb")
    f.reconcile([a, b])
    wait_until(lambda: f.board.current().mig_healthy == {a.uuid, b.uuid}, what="both healthy")
    gone = daemon_of(f, b.uuid)
    layout = f.board.current().mig_layout
    f.reconcile([a, c])
    assert f.get(b.uuid) is None and [d.uuid for d in f.devices()] == [a.uuid, c.uuid]
    assert f.board.current().mig_layout == layout + 1
    wait_until(lambda: not gone.is_running() or gone.status() == psutil.STATUS_ZOMBIE, what="vanished daemon quit")
    wait_until(lambda: f.board.current().mig_healthy == {a.uuid, c.uuid}, what="new instance healthy")
    text = generate_latest(f.registry).decode()
    assert b.uuid not in text and c.uuid in text
    f.reconcile([a, c])  # the same layout again: nothing changes
    assert f.board.current().mig_layout == layout + 1


def test_no_instances_no_daemons(fleet):
    f = fleet()
    f.reconcile([])
    assert f.devices() == [] and f.board.current().mig_healthy == frozenset()


def test_a_second_mpsd_on_the_same_instance_is_refused_in_one_line(fleet, caplog):
    first, second = fleet(), fleet()
    a = mig(1)
    first.reconcile([a])
    second.reconcile([a])
    assert second.get(a.uuid) is None
    assert any("another mpsd run" in r.getMessage() and a.uuid in r.getMessage() for r in caplog.records)


def test_instance_config_and_whole_gpus_of_a_mixed_node(mig_config):
    config = mig_config(**{"pinned-mem-limit": "0=20G", "exclusive-process": "true"})
    one = instance_config(config, mig(1))
    assert (one.visible_devices, one.pinned_mem_limit, one.exclusive_process) == (mig(1).uuid, {}, False)
    assert one.active_thread_percentage == config.active_thread_percentage

    class G:
        def __init__(self, index, uuid, mig_enabled):
            self.index, self.uuid, self.mig_enabled = index, uuid, mig_enabled

    gpus = [G(1, "GPU-b", True), G(0, "GPU-a", False), G(2, "GPU-c", False)]
    assert whole_gpus_only(config, gpus).visible_devices == "GPU-a,GPU-c"
    assert whole_gpus_only(config, [G(0, "GPU-a", False)]).visible_devices is None  # no MIG: unchanged
    assert whole_gpus_only(mig_config(**{"visible-devices": "0"}), gpus).visible_devices == "0"  # the operator's
    assert whole_gpus_only(mig_config(mig="false"), gpus).visible_devices is None
