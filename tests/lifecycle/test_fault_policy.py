"""faultPolicy against the real 535 control front-end. No GPU makes real MPS servers, so the
wrapper of the FAULT tests (FaultyServers) adds one server in a chosen state around the real
front-end, and here also its clients: real processes. The server is a stand-in process that
accepts its clients' connections on a unix socket, as a real server holds one per client.
terminate_client goes to the real front-end, which knows the command but not the stand-in
server; the wrapper then does what a real server does to a terminated client (ends its GPU
work, which a framework answers by exiting)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsd.daemon.control import CommandRejected, Control, UnknownCommand
from mpsd.registry import Metrics
from mpsd.node import InventoryPump, _observer
from tests.lifecycle.test_supervisor import FaultyServers, gone, wait_until

pytestmark = pytest.mark.mps_binary
SERVER = 4242


def client(
    cooperative: bool, pipe_dir: str | None = None, libcuda: Path | None = None, server: str | None = None
) -> subprocess.Popen:
    """A stand-in MPS client: a cooperative one exits when its work is terminated (SIGUSR1
    here), a stuck one ignores it and stays until killed. ``pipe_dir``: in its environment
    (which a client can rewrite). ``libcuda``: a CUDA driver (the fake one) mapped. ``server``:
    the socket of a stand-in server it connects to and stays connected to, as an MPS client
    stays connected to its server. Connected and mapping a driver, mpsd can show it to be an
    MPS client (mpsd.daemon.peer)."""
    code = (
        "import ctypes, signal, socket, sys, time\n"
        f"{'ctypes.CDLL(sys.argv[1])' if libcuda else 'pass'}\n"
        f"{'s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[2])' if server else 'pass'}\n"
        f"signal.signal(signal.SIGUSR1, {'lambda *_: sys.exit(0)' if cooperative else 'signal.SIG_IGN'})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir) if pipe_dir else None
    argv = [sys.executable, "-c", code, str(libcuda or ""), server or ""]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "ready\n"
    return proc


def stand_in_server(path: str) -> subprocess.Popen:
    """A process that listens on ``path`` and holds every connection it accepts: an MPS server
    as mpsd.daemon.peer sees one (a real one is a child of the daemon; none runs without a GPU)."""
    code = (
        "import os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o666); s.listen(64)\n"
        "print('listening', flush=True)\n"
        "held = []\n"
        "while True:\n"
        "    held.append(s.accept()[0])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "listening\n"
    return proc


class FaultyServerWithClients(FaultyServers):
    def __init__(
        self, real: Control, state: str, clients: list[subprocess.Popen], sent: list, server: int = SERVER
    ) -> None:
        super().__init__(real, state)
        self.clients, self.sent, self.server = clients, sent, server

    def get_server_list(self):
        self.real.get_server_list()
        return [self.server]

    def get_client_list(self, server: int) -> list[int]:
        self.real.get_server_list()
        return [c.pid for c in self.clients if c.poll() is None] if server == self.server else []

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


def fault(monkeypatch, r, clients, sent, state="FAULT", server=SERVER):
    real = r.sup.control
    monkeypatch.setattr(
        r.sup, "control", lambda timeout=None: FaultyServerWithClients(real(timeout), state, clients, sent, server)
    )
    return real


@pytest.fixture
def clients(procs):
    return procs


@pytest.fixture
def servers():
    """Stand-in servers a test starts (not among its clients): killed at teardown."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_terminate_ends_every_client_of_the_faulted_server_then_kills_the_rest(
    make_config, run_supervisor, monkeypatch, clients, fake_cuda_dir, servers, tmp_path
):
    metrics = Metrics()
    config = make_config(**{"fault-policy": "terminate", "health-interval": "0.3s", "health-timeout": "1s"})
    pump = InventoryPump(None, metrics, None)
    r = run_supervisor(config, gpu_indices=lambda: [0, 1], on_status=_observer(metrics, pump))
    r.wait_for(lambda s: s.configured)
    libcuda, socket_path = fake_cuda_dir / "libcuda.so.1", str(tmp_path / "server")
    server = stand_in_server(socket_path)
    clients += [client(coop, config.pipe_dir, libcuda, socket_path) for coop in (True, False)]
    ended, stuck = clients
    servers.append(server)
    sent: list = []
    real = fault(monkeypatch, r, clients, sent, server=server.pid)
    state = r.wait_for(lambda s: s.faulted_gpus, what="FAULT published")
    assert state.faulted_gpus == {0, 1} and not state.gpu_healthy(0)
    assert "faultPolicy terminate" in state.last_error
    wait_until(lambda: ended.poll() is not None, what="the cooperative client ended by terminate_client")
    assert sorted(sent) == sorted([(server.pid, ended.pid), (server.pid, stuck.pid)])  # every client of the server
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
    [
        {"pipe_dir": True, "libcuda": True, "connected": False},  # only its own word: its environment
        {"pipe_dir": True, "libcuda": True, "connected": "elsewhere"},  # a server of another daemon
        {"pipe_dir": True, "libcuda": False, "connected": True},  # no CUDA driver
    ],
    ids=["environment-only", "connected-elsewhere", "no-cuda-driver"],
)
def test_terminate_kills_only_processes_shown_to_be_mps_clients(
    make_config, run_supervisor, monkeypatch, clients, fake_cuda_dir, unproven, caplog, servers, tmp_path
):
    # A client list is the daemon's word, and a process's environment is its own to rewrite
    # (issue 21, defect 7): SIGKILL only reaches a process the kernel shows connected to the
    # faulted server (SO_PEERCRED of a socket the server holds) and that maps a driver. A
    # client that rewrote CUDA_MPS_PIPE_DIRECTORY in its environment does not escape.
    config = make_config(**{"fault-policy": "terminate", "health-timeout": "1s"})
    r = run_supervisor(config, gpu_indices=lambda: [0])
    r.wait_for(lambda s: s.configured)
    libcuda = fake_cuda_dir / "libcuda.so.1"
    server, elsewhere = stand_in_server(str(tmp_path / "server")), stand_in_server(str(tmp_path / "other"))
    servers += [server, elsewhere]
    connected = {True: str(tmp_path / "server"), "elsewhere": str(tmp_path / "other"), False: None}
    rewritten = client(False, "/tmp/rewritten-pipe-dir", libcuda, connected[True])  # its environment lies
    other = client(
        False, config.pipe_dir, libcuda if unproven["libcuda"] else None, connected[unproven["connected"]]
    )
    clients += [rewritten, other]
    fault(monkeypatch, r, clients, [], server=server.pid)
    wait_until(lambda: rewritten.poll() is not None, what="the connected client killed")
    assert rewritten.returncode == -signal.SIGKILL
    wait_until(lambda: f"client={other.pid} of server={server.pid} not killed" in caplog.text, what="refusal logged")
    assert other.poll() is None
    assert r.sup.status().fault_terminations.get("sigkill") == 1
