"""The MPS v3 control interface (driver R615+): one ``nvidia-cuda-mps-control <module> <verb>
--key=value`` run per command, its CSV answer parsed into values.

NVIDIA's "MPS v3 Interface" page replaces v2's interactive shell with these verbs (``server
list|create``, ``client list --all``, ``namespace create|delete|list|set|get``, ``-q`` to quit);
a front-end follows the running daemon's protocol. Every command goes through
:meth:`Control3.run`, bounded by a timeout; a refused verb (non-zero exit) is a CommandRejected
carrying the daemon's line. The CSV columns are those docs/mps-v3.md lists (``--format=csv,
noheader``); the parsers are pure and tested by tables.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass

from .control import CommandRejected, UnexpectedOutput
from ..errors import ControlError, ControlTimeout, DaemonNotRunning
from ..units import is_decimal

log = logging.getLogger(__name__)

FORMAT = "--format=csv,noheader"
NOT_RUNNING = "Cannot find MPS control daemon process"
SERVER_STATES = ("STOPPED", "INITIALIZING", "ACTIVE", "FAULT")


@dataclass(frozen=True)
class Server3:
    name: str
    uid: int | None
    pid: int | None  # None while the server has no process (no client yet)
    status: str
    allowed_devices: tuple[str, ...]


@dataclass(frozen=True)
class Limits3:
    """A namespace's limits as the daemon prints and takes them ("" = not set)."""

    pinned_memory_limit: str = ""  # <n>M or <n>G
    active_thread_percentage: str = ""
    client_priority: str = ""

    def options(self) -> list[str]:
        pairs = (("pinned-memory-limit", self.pinned_memory_limit),
                 ("active-thread-percentage", self.active_thread_percentage),
                 ("client-priority", self.client_priority))
        return [f"--{k}={v}" for k, v in pairs if v != ""]


@dataclass(frozen=True)
class Namespace3:
    server: str
    name: str
    limits: Limits3
    clients: int


@dataclass(frozen=True)
class Client3:
    pid: int
    uid: int
    server: str
    namespace: str


# ---------------------------------------------------------------- pure parsing


def _rows(output: str, columns: int, what: str) -> list[list[str]]:
    rows = []
    for line in output.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < columns:
            raise UnexpectedOutput(f"unexpected {what} line {line!r}: expected {columns} comma-separated columns")
        rows.append(cells)
    return rows


def _int_or_none(text: str, what: str) -> int | None:
    if text in ("", "-"):
        return None
    if not is_decimal(text) or len(text) > 10:
        raise UnexpectedOutput(f"unexpected {what} {text!r}: expected a decimal number or -")
    return int(text)


def parse_servers(output: str) -> list[Server3]:
    """``server list``: name,uid,pid,status,pipe-directory,allowed-devices... (the device list
    itself holds commas: what lies between the pipe directory and the last column)."""
    servers = []
    for cells in _rows(output, 7, "server list"):
        status = cells[3].upper()
        if status not in SERVER_STATES:
            raise UnexpectedOutput(f"unexpected server status {cells[3]!r}: expected one of {', '.join(SERVER_STATES)}")
        devices = tuple(d for d in cells[5:-1] if d and d != "-")
        servers.append(Server3(cells[0], _int_or_none(cells[1], "uid"), _int_or_none(cells[2], "pid"), status, devices))
    return servers


def parse_namespaces(output: str) -> list[Namespace3]:
    """``namespace list|get``: server,name,pinned-memory-limit,active-thread-percentage,client-priority,clients."""
    out = []
    for c in _rows(output, 6, "namespace"):
        clients = _int_or_none(c[5], "client count") or 0
        out.append(Namespace3(c[0], c[1], Limits3(c[2], c[3], c[4]), clients))
    return out


def parse_clients(output: str) -> list[Client3]:
    """``client list --all``: pid,uid,server,namespace."""
    out = []
    for c in _rows(output, 4, "client list"):
        pid, uid = _int_or_none(c[0], "pid"), _int_or_none(c[1], "uid")
        if pid is None or uid is None:
            raise UnexpectedOutput(f"unexpected client line {','.join(c)!r}: expected a pid and a uid")
        out.append(Client3(pid, uid, c[2], c[3]))
    return out


def same_limits(want: Limits3, got: Limits3) -> bool:
    """Whether the daemon holds ``want`` (percentages compared as numbers: 25 and 25.0 are one)."""
    if want.pinned_memory_limit != got.pinned_memory_limit or want.client_priority != got.client_priority:
        return False
    try:
        return abs(float(want.active_thread_percentage or 0) - float(got.active_thread_percentage or 0)) < 0.05
    except ValueError:
        return False


# ---------------------------------------------------------------- the front-end


class Control3:
    """Verbs to the v3 daemon serving ``pipe_dir``, through ``binary``."""

    def __init__(self, binary: str, pipe_dir: str, log_dir: str | None = None, timeout: float = 3.0) -> None:
        self.binary, self.pipe_dir, self.log_dir, self.timeout = binary, pipe_dir, log_dir, timeout

    def run(self, *args: str, timeout: float | None = None) -> str:
        """One command; what it printed. DaemonNotRunning, ControlTimeout, CommandRejected (the
        daemon's line), ControlError."""
        limit = self.timeout if timeout is None else timeout
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir)
        if self.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        command = " ".join(args)
        try:
            proc = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=limit, env=env,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise ControlTimeout(f"{command!r}: no answer from the MPS v3 control daemon in {limit:g}s") from exc
        except OSError as exc:
            raise ControlError(f"cannot run control binary {self.binary!r}: {exc.strerror}") from exc
        log.debug("control3 command=%r rc=%d out=%r err=%r", command, proc.returncode, proc.stdout, proc.stderr)
        if proc.returncode != 0:
            text = " ".join((proc.stderr + " " + proc.stdout).split()) or f"exit status {proc.returncode}"
            if NOT_RUNNING in text:
                raise DaemonNotRunning(f"{command!r}: no MPS control daemon on pipe dir {self.pipe_dir}: {text}")
            raise CommandRejected(f"{command!r} rejected by the MPS v3 control daemon: {text[:300]}")
        return proc.stdout

    def server_list(self) -> list[Server3]:
        return parse_servers(self.run("server", "list", FORMAT))

    def client_list(self) -> list[Client3]:
        return parse_clients(self.run("client", "list", "--all", FORMAT))

    def namespace_list(self, server: str) -> list[Namespace3]:
        return parse_namespaces(self.run("namespace", "list", f"--server={server}", FORMAT))

    def namespace_create(self, server: str, name: str, limits: Limits3) -> None:
        self.run("namespace", "create", f"--server={server}", f"--name={name}", *limits.options())

    def namespace_set(self, server: str, name: str, limits: Limits3) -> None:
        self.run("namespace", "set", f"--server={server}", f"--name={name}", *limits.options())

    def namespace_delete(self, server: str, name: str) -> None:
        self.run("namespace", "delete", f"--server={server}", f"--name={name}")

    def quit(self, wait: float | None = None) -> None:
        self.run("-q", timeout=wait)
