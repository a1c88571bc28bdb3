"""A node whose ``mpsd run`` is replaced under a running control daemon (``daemonLifecycle:
independent``), for tests/lifecycle/test_rollout.py and benchmarks/rollout.py: real ``mpsd run``
and ``mpsd holder`` processes, the real nvidia-cuda-mps-control, and an ``mpsd exec`` client (the
fake CUDA driver under libmpsshim.so) holding memory in its region.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mpsd.daemon import dirs, genuine
from mpsd.daemon.control import Control
from mpsd.errors import ControlError

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "scripts/demo_client.py"
MPSD = [sys.executable, "-m", "mpsd"]
POLL = 0.005  # seconds between /readyz probes while a start is timed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body); (0, reason) while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def wait_until(predicate, what: str, timeout: float = 60.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(every)
    return result


@dataclass
class Node:
    """Directories of one node under ``work`` (short: the pipe dir holds sockets)."""

    work: Path
    binary: Path
    shim_lib: Path | None = None
    fake_cuda: Path | None = None
    port: int = field(default_factory=free_port)
    started: list[subprocess.Popen] = field(default_factory=list)  # stopped by close()
    _logs: int = 0

    def close(self) -> None:
        """Stop every process started here (latest first) and whatever daemon is left."""
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        stop_daemon(self)

    @property
    def pipe(self) -> Path:
        return self.work / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.work / "log"

    def paths(self) -> list[str]:
        """The flags every command of this node takes: binary and directories."""
        return [f"--control-binary={self.binary}", f"--pipe-dir={self.pipe}", f"--log-dir={self.log_dir}",
                f"--state-dir={self.work / 'state'}"]  # fmt: skip

    def flags(self, **settings: str) -> list[str]:
        values = {
            "metrics-address": f"127.0.0.1:{self.port}",
            "daemon-lifecycle": "independent",
            "health-interval": "0.5s",
            "health-timeout": "5s",
            "restart-backoff-initial": "0.1s",
            "restart-backoff-max": "2s",
            "active-thread-percentage": "50",
            "pinned-mem-limit": "0=2G",
            "client-priority": "1",
        }
        if self.shim_lib is not None:
            values["shim-library"] = str(self.shim_lib)
        values.update(settings)
        return self.paths() + [f"--{k}={v}" for k, v in values.items()]

    def _log(self, name: str) -> Path:
        self._logs += 1
        return self.work / f"{name}-{self._logs}.log"

    def spawn(self, command: str, env: dict[str, str] | None = None, **settings: str) -> subprocess.Popen:
        """``mpsd COMMAND`` with this node's flags (and ``env`` added to its environment, e.g.
        POD_UID); its output in work/COMMAND-N.log (``.log``)."""
        log = self._log(command)
        with open(log, "w") as out:
            proc = subprocess.Popen([*MPSD, command, *self.flags(**settings)], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, env={**_clean_env(), **(env or {})})  # fmt: skip
        proc.log = log  # type: ignore[attr-defined]
        self.started.append(proc)
        return proc

    def ready(self, port: int | None = None) -> bool:
        return http_get(port or self.port, "/readyz")[0] == 200

    def start_timed(self, env: dict[str, str] | None = None, port: int | None = None,
                    **settings: str) -> tuple[subprocess.Popen, float]:  # fmt: skip
        """A new ``mpsd run`` (metrics on ``port``, else the node's) and the seconds from its
        spawn to its first /readyz 200."""
        began = time.monotonic()
        if port is not None:
            settings["metrics-address"] = f"127.0.0.1:{port}"
        proc = self.spawn("run", env, **settings)
        deadline = began + 60
        while not self.ready(port):
            assert proc.poll() is None, f"mpsd run exited {proc.returncode}:\n{read(proc)}"
            assert time.monotonic() < deadline, f"mpsd run not ready in 60s:\n{read(proc)}"
            time.sleep(POLL)
        return proc, time.monotonic() - began

    def lock(self, kind: str) -> Path:
        """mpsd's ``kind`` lock file ("run", "holder") of this node's pipe dir (in its stateDir)."""
        return dirs.lock_path(str(self.work / "state"), str(self.pipe), kind)

    def daemon_pid(self) -> int | None:
        """The daemon holding this pipe dir's control_lock."""
        return genuine.control_lock_holder(str(self.pipe))

    def control(self) -> Control:
        return Control(str(self.binary), str(self.pipe), str(self.log_dir), timeout=20)

    def defaults(self) -> tuple[float, int | None, int]:
        c = self.control()
        return c.get_default_active_thread_percentage(), c.get_default_device_pinned_mem_limit(0), \
            c.get_default_client_priority()  # fmt: skip

    def servers(self) -> list[int]:
        return self.control().get_server_list()

    def quits(self) -> int:
        """``quit`` commands the daemons of this node were sent (control.log's ``Cmd:quit``)."""
        return self.commands().count("Cmd:quit")

    def commands(self) -> list[str]:
        """Every command the daemons of this node were sent, in order (control.log's ``Cmd:...``)."""
        try:
            text = (self.log_dir / "control.log").read_text(errors="replace")
        except FileNotFoundError:
            return []
        return re.findall(r"Cmd:\S+", text)

    def metric(self, name: str, port: int | None = None) -> dict[str, float]:
        """{labels: value} of one family on this node's /metrics (or those on ``port``)."""
        status, body = http_get(port or self.port, "/metrics")
        assert status == 200, body
        found = {}
        for line in body.splitlines():
            m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
            if m:
                found[m.group(1) or ""] = float(m.group(2))
        return found

    def exec_client(self, region: str, allocate: str) -> subprocess.Popen:
        """An ``mpsd exec`` client (the fake driver, the shim) holding ``allocate`` in region
        stateDir/exec/REGION, once it says it holds it."""
        assert self.shim_lib is not None and self.fake_cuda is not None
        path = self.work / "state" / "exec" / region / "region"
        path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(_clean_env(), LD_LIBRARY_PATH=str(self.fake_cuda), FAKE_CUDA_DEVICES="16G")
        log = self._log("exec")
        argv = [*MPSD, "exec", *self.paths(), "--gpu-memory=4G", f"--region={path}", "--",
                sys.executable, str(CLIENT), "exec", "--allocate", allocate, "--hold"]  # fmt: skip
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        proc.log = log  # type: ignore[attr-defined]
        self.started.append(proc)
        wait_until(lambda: proc.poll() is not None or "holding" in log.read_text(), "the exec client to hold")
        assert proc.poll() is None, log.read_text()
        return proc


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("LD_PRELOAD", "CUDA_MPS_", "MPSSHIM_", "MPSD_"))}


def read(proc: subprocess.Popen) -> str:
    return proc.log.read_text(errors="replace")  # type: ignore[attr-defined]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Signal ``proc`` and reap it; its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args[:4]} did not exit in {timeout:g}s after signal {sig}:\n{read(proc)}") from None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_daemon(node: Node) -> None:
    """Quit whatever daemon the node left (tests' teardown)."""
    subprocess.run([*MPSD, "stop-daemon", *node.paths()], cwd=REPO, capture_output=True, timeout=60)
    pid = node.daemon_pid()
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


def served(control: Control) -> bool:
    try:
        control.get_server_list()
        return True
    except ControlError:
        return False
