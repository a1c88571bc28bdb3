"""The MPS v3 control interface (driver R615+): one ``nvidia-cuda-mps-control <module> <verb>
[positional] [--key=value]`` run per command, as NVIDIA's "MPS v3 Interface" page spells each
verb (docs/mps-v3.md's table names the page for every verb, option and column used here):

- ``server list --format=csv``; ``server set <name> --pinned-memory-limit=.. ...`` (the
  server's default namespace);
- ``namespace create <name> --server=<s>`` (no limit options: the page shows none), ``namespace
  set <name> --server=<s> --pinned-memory-limit=.. --active-thread-percentage=..
  --client-priority=..``, ``namespace delete <name> --server=<s> [--force]``, ``namespace list
  --server=<s> --format=csv``, ``namespace get <name> <server> <field>``;
- ``client list --all --format=csv``, ``client terminate <pid>``; ``-q``.

A front-end follows the running daemon's protocol; ``CUDA_MPS_PROTOCOL_VERSION=3`` is set too
(the page: the variable wins over ``-p``), so with no daemon the front-end speaks v3 as well.
Every command is bounded by a timeout. A non-zero exit is a refusal (CommandRejected with the
daemon's line) unless nothing listens on ``<pipe>/control`` (DaemonNotRunning): "no daemon" is
read from the exit status and the socket, never from a message's wording. Answers are read by
mpsd/daemon/answers3.py.
"""

from __future__ import annotations

import logging
import os
import subprocess

from . import peer
from .answers3 import (Client3, Limits3, Namespace3, Server3, differences, parse_clients, parse_namespaces,
                       parse_servers, same_limits)
from .control import CommandRejected, UnexpectedOutput
from ..errors import ControlError, ControlTimeout, DaemonNotRunning

__all__ = ["Client3", "Control3", "Limits3", "Namespace3", "Server3", "differences", "parse_clients",
           "parse_namespaces", "parse_servers", "same_limits", "CommandRejected", "UnexpectedOutput"]

log = logging.getLogger(__name__)

FORMAT = "--format=csv"


class Control3:
    """Verbs to the v3 daemon serving ``pipe_dir``, through ``binary``."""

    def __init__(self, binary: str, pipe_dir: str, log_dir: str | None = None, timeout: float = 3.0) -> None:
        self.binary, self.pipe_dir, self.log_dir, self.timeout = binary, pipe_dir, log_dir, timeout

    def run(self, *args: str, timeout: float | None = None) -> str:
        """One command; what it printed. DaemonNotRunning, ControlTimeout, CommandRejected (the
        daemon's line), ControlError."""
        limit = self.timeout if timeout is None else timeout
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir, CUDA_MPS_PROTOCOL_VERSION="3")
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
            text = " ".join((proc.stderr + " " + proc.stdout).split()) or "no message"
            said = f"exit status {proc.returncode}: {text[:300]}"
            if peer.listener_pid(os.path.join(self.pipe_dir, "control")) is None:
                raise DaemonNotRunning(
                    f"{command!r}: no MPS control daemon listens on {self.pipe_dir}/control ({said})")
            raise CommandRejected(f"{command!r} refused by the MPS v3 control daemon, {said}")
        return proc.stdout

    def server_list(self) -> list[Server3]:
        return parse_servers(self.run("server", "list", FORMAT))

    def server_set(self, server: str, limits: Limits3) -> None:
        """The server's own limits: its default namespace (the page's ``server set``)."""
        if limits.options():
            self.run("server", "set", server, *limits.options())

    def client_list(self) -> list[Client3]:
        return parse_clients(self.run("client", "list", "--all", FORMAT))

    def client_terminate(self, pid: int) -> None:
        self.run("client", "terminate", str(pid))

    def namespace_list(self, server: str) -> list[Namespace3]:
        found = parse_namespaces(self.run("namespace", "list", f"--server={server}", FORMAT), server)
        return [n for n in found if n.server in ("", server)]

    def namespace_get(self, server: str, name: str, field: str) -> str:
        return self.run("namespace", "get", name, server, field).strip()

    def namespace_create(self, server: str, name: str) -> None:
        self.run("namespace", "create", name, f"--server={server}")

    def namespace_set(self, server: str, name: str, limits: Limits3) -> None:
        if limits.options():  # the page: "At least one option flag is required"
            self.run("namespace", "set", name, f"--server={server}", *limits.options())

    def namespace_delete(self, server: str, name: str, force: bool = False) -> None:
        self.run("namespace", "delete", name, f"--server={server}", *(["--force"] if force else []))

    def quit(self, wait: float | None = None) -> None:
        self.run("-q", timeout=wait)
