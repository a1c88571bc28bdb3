"""faultPolicy against the real 535 control front-end. No GPU makes real MPS servers, so the
wrapper of the FAULT tests (FaultyServers) adds one server in a chosen state around the real
front-end, and here also its clients: real processes. terminate_client goes to the real
front-end, which knows the command but not the fake server; the wrapper then does what a real
server does to a terminated client (ends its GPU work, which a framework answers by exiting)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsd.control import CommandRejected, Control, UnknownCommand
from mpsd.metrics import Metrics
from mpsd.node import InventoryPump, _observer
from tests.supervisor.test_supervisor import FaultyServers, gone, wait_until

pytestmark = pytest.mark.mps_binary
SERVER = 4242


def client(cooperative: bool, pipe_dir: str | None = None, libcuda: Path | None = None) -> subprocess.Popen:
    """A stand-in MPS client: a cooperative one exits when its work is terminated (SIGUSR1
    here), a stuck one ignores it and stays until killed. With ``pipe_dir`` and ``libcuda``
    it is one mpsd can show to be an MPS client (mpsd.peer): that pipe dir in its environment,
    a CUDA driver (the fake one) mapped."""
    code = (
        "import ctypes, signal, sys, time\n"
        f"{'ctypes.CDLL(sys.argv[1])' if libcuda else 'pass'}\n"
        f"signal.signal(signal.SIGUSR1, {'lambda *_: sys.exit(0)' if cooperative else 'signal.SIG_IGN'})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir) if pipe_dir else None
    argv = [sys.executable, "-c", code] + ([str(libcuda)] if libcuda else [])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "ready\n"
    return proc


class FaultyServerWithClients(FaultyServers):
    def __init__(self, real: Control, state: str, clients: list[subprocess.Popen], sent: list) -> None:
        super().__init__(real, state)
        self.clients, self.sent = clients, sent

    def get_client_list(self, server: int) -> list[int]:
        self.real.get_server_list()
        return [c.pid for c in self.clients if c.poll() is None] if server == SERVER else []

    def terminate_client(self, server: int, pid: int) -> int:
        try:
            self.real.terminate_client(server, pid)
        except UnknownCommand:
            raise  # a driver without terminate_client
        except CommandRejected as exc:
            assert f"Server {server} not found" in str(exc)  # the real daemon parsed it
        self.sent.append((server, pid))
        os.kill(pid, signal.SIGUSR1)
        return 0


def fault(monkeypatch, r, clients, sent, state="FAULT"):
    real = r.sup.control
    monkeypatch.setattr(
        r.sup, "control", lambda timeout=None: FaultyServerWithClients(real(timeout), state, clients, sent)
    )
    return real


@pytest.fixture
def clients(procs):
    return procs


def test_terminate_ends_every_client_of_the_faulted_server_then_kills_the_rest(
    make_config, run_supervisor, monkeypatch, clients, fake_cuda_dir
):
    metrics = Metrics()
    config = make_config(**{"fault-policy": "terminate", "health-interval": "0.3s", "health-timeout": "1s"})
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, gpu_indices=lambda: [0, 1], on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured)
    libcuda = fake_cuda_dir / "libcuda.so.1"
    clients += [client(True, config.pipe_dir, libcuda), client(False, config.pipe_dir, libcuda)]
    ended, stuck = clients
    sent: list = []
    real = fault(monkeypatch, r, clients, sent)
    state = r.wait_for(lambda s: s.faulted_gpus, what="FAULT published")
    assert state.faulted_gpus == {0, 1} and not state.gpu_healthy(0)
    assert "faultPolicy terminate" in state.last_error
    wait_until(lambda: ended.poll() is not None, what="the cooperative client ended by terminate_client")
    assert sorted(sent) == sorted([(SERVER, ended.pid), (SERVER, stuck.pid)])  # every client of the server
    began = time.monotonic()
    wait_until(lambda: stuck.poll() is not None, what="the stuck client killed")
    assert stuck.returncode == -signal.SIGKILL and time.monotonic() - began < 10
    assert r.sup.status().fault_terminations == {"terminate_client": 2, "sigkill": 1}
    text = metrics.scrape().decode()
    assert 'mpsd_fault_terminations_total{method="terminate_client"} 2.0' in text
    assert 'mpsd_fault_terminations_total{method="sigkill"} 1.0' in text
    assert r.board.current().faulted_gpus  # still FAULT until the server says otherwise
    monkeypatch.setattr(r.sup, "control", lambda timeout=None: FaultyServers(real(timeout), "ACTIVE"))
    state = r.wait_for(lambda s: not s.faulted_gpus, what="recovered")
    assert state.gpu_healthy(0) and state.last_error == ""
    assert r.sup.status().restarts == 0  # the daemon itself was never touched
    pump.close()


def test_a_driver_without_terminate_client_falls_back_to_report(
    make_config, run_supervisor, monkeypatch, clients, mps_control, tmp_path, caplog
):
    wrapper = tmp_path / "control-without-terminate"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$#" -gt 0 ] && exec {mps_control} "$@"\n'
        f"sed 's/^terminate_client /terminate_clientx /' | exec {mps_control}\n"
    )
    wrapper.chmod(0o755)
    config = make_config(**{"fault-policy": "terminate", "control-binary": str(wrapper)})
    r = run_supervisor(config, gpu_indices=lambda: [0])
    r.wait_for(lambda s: s.configured)
    clients += [client(cooperative=True)]
    sent: list = []
    fault(monkeypatch, r, clients, sent)
    state = r.wait_for(lambda s: "no terminate_client" in s.last_error, what="fallback reported")
    assert state.faulted_gpus == {0}
    reason = [rec.getMessage() for rec in caplog.records if "no terminate_client" in rec.getMessage()]
    assert len(reason) == 1 and "\n" not in reason[0] and "falls back to report" in reason[0]
    checks = r.sup.status().health_checks
    wait_until(lambda: r.sup.status().health_checks >= checks + 3, what="more health checks")
    assert clients[0].poll() is None and not sent  # nobody ended, nothing killed
    assert r.sup.status().fault_terminations == {}
    assert len([rec for rec in caplog.records if "no terminate_client" in rec.getMessage()]) == 1  # said once


def test_report_leaves_the_clients_alone(make_config, run_supervisor, monkeypatch, clients):
    r = run_supervisor(make_config(), gpu_indices=lambda: [0])
    r.wait_for(lambda s: s.configured)
    clients += [client(cooperative=True)]
    sent: list = []
    fault(monkeypatch, r, clients, sent)
    state = r.wait_for(lambda s: s.faulted_gpus, what="FAULT published")
    assert "clients of those servers must exit" in state.last_error
    checks = r.sup.status().health_checks
    wait_until(lambda: r.sup.status().health_checks >= checks + 3, what="more health checks")
    assert clients[0].poll() is None and not sent and not gone(clients[0].pid)


def test_terminate_set_by_a_reload_acts_on_a_server_already_in_fault(make_config, run_supervisor, monkeypatch, clients):
    terminate = make_config(**{"fault-policy": "terminate"})
    r = run_supervisor(make_config(), gpu_indices=lambda: [0], reload=lambda: terminate)
    r.wait_for(lambda s: s.configured)
    clients += [client(cooperative=True)]
    sent: list = []
    real = fault(monkeypatch, r, clients, sent)
    r.wait_for(lambda s: s.faulted_gpus, what="FAULT published")
    checks = r.sup.status().health_checks
    wait_until(lambda: r.sup.status().health_checks >= checks + 2, what="more health checks")
    assert clients[0].poll() is None and not sent
    r.sup.reload()
    wait_until(lambda: clients[0].poll() is not None, what="the client ended after the reload")
    assert sent == [(SERVER, clients[0].pid)] and r.sup.status().pid is not None
    monkeypatch.setattr(r.sup, "control", real)  # the server exits with its last client
    state = r.wait_for(lambda s: not s.faulted_gpus, what="healthy once the server is gone")
    assert state.gpu_healthy(0) and state.last_error == "" and r.sup.status().servers == ()


@pytest.mark.parametrize(
    "unproven",
    [{"pipe_dir": None, "libcuda": True}, {"pipe_dir": "/tmp/another-pipe-dir", "libcuda": True}, {"libcuda": False}],
    ids=["no-pipe-dir-env", "another-pipe-dir", "no-cuda-driver"],
)
def test_terminate_kills_only_processes_shown_to_be_mps_clients(
    make_config, run_supervisor, monkeypatch, clients, fake_cuda_dir, unproven, caplog
):
    # A client list is the daemon's word (and the pipe dir's sockets are a pod's to replace):
    # SIGKILL only reaches a process whose environment names this pipe dir and that maps a driver.
    config = make_config(**{"fault-policy": "terminate", "health-timeout": "1s"})
    r = run_supervisor(config, gpu_indices=lambda: [0])
    r.wait_for(lambda s: s.configured)
    libcuda = fake_cuda_dir / "libcuda.so.1"
    proven = client(False, config.pipe_dir, libcuda)
    other = client(False, unproven.get("pipe_dir", config.pipe_dir), libcuda if unproven["libcuda"] else None)
    clients += [proven, other]
    fault(monkeypatch, r, clients, [])
    wait_until(lambda: proven.poll() is not None, what="the proven client killed")
    assert proven.returncode == -signal.SIGKILL
    wait_until(lambda: f"client={other.pid} of server={SERVER} not killed" in caplog.text, what="the refusal logged")
    assert other.poll() is None
    assert r.sup.status().fault_terminations.get("sigkill") == 1
