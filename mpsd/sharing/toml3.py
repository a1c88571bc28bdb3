"""MPS v3 names and the TOML file mpsd starts the daemon with. Pure.

- one server per GPU, named ``g<index>`` (NVML's index), ``allowed_devices`` its UUID; the
  server's own limits (its default namespace) are the config's defaults, as v2's daemon
  defaults are: what a client that picks no namespace gets;
- one namespace per slice, named ``m`` + 15 hex digits of the SHA-256 of the slice's key (an
  allocation ID, ``claim-<uid>``): short (the socket ``<pipe>/<server>/<ns>/control`` must fit
  a unix socket address) and within the Interface page's rule ("lowercase letters, digits, and
  underscores only, up to 64 characters"). The shape does not make a namespace mpsd's: only
  its journal does (mpsd/sharing/owned3.py), so an operator's namespace is never touched;
- ``uid`` only where the daemon is not multi-user (then each server serves one UID).

The file's keys are those NVIDIA's "MPS v3 Configuration File" page lists for release 615
(``schema_version``, ``[servers.<name>]``, ``[servers.<name>.namespaces.<ns>]``); a daemon
refuses any other.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from ..config import Config
from ..daemon.control3 import Limits3
from ..units import format_size_mps_control

SCHEMA_VERSION = "1.0"
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def server_name(index: int) -> str:
    return f"g{index}"


def namespace_name(key: str) -> str:
    return "m" + hashlib.sha256(key.encode()).hexdigest()[:15]


def namespace_dir(pipe_dir: str, server: str, namespace: str) -> str:
    """What a client's CUDA_MPS_PIPE_DIRECTORY names to reach a namespace: it connects to
    ``<this>/control`` ("MPS v3 Namespaces": routed by the socket it connects to)."""
    return os.path.join(pipe_dir, server, namespace)


def socket_problem(pipe_dir: str, server: str, namespace: str) -> str:
    """"" when the namespace's socket path fits a unix socket address, else why not."""
    path = os.path.join(namespace_dir(pipe_dir, server, namespace), "control")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        return f"namespace socket {path} is longer than {MAX_SOCKET_PATH} bytes: expected a shorter pipeDir"
    return ""


def limits(memory: int | None, percentage: float | None, priority: int | None) -> Limits3:
    """A namespace's (or a server's) limits in the daemon's syntax (memory in whole MiB, M or G)."""
    return Limits3(
        "" if memory is None else format_size_mps_control(memory),
        "" if percentage is None else (str(int(percentage)) if float(percentage).is_integer() else f"{percentage:g}"),
        "" if priority is None else str(int(priority)),
    )


@dataclass(frozen=True)
class ServerSpec:
    name: str
    device: str  # UUID
    uid: int | None
    limits: Limits3
    namespaces: dict[str, Limits3] = field(default_factory=dict)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _limit_lines(limits: Limits3) -> list[str]:
    pairs = (("pinned_memory_limit", limits.pinned_memory_limit),
             ("active_thread_percentage", limits.active_thread_percentage),
             ("client_priority", limits.client_priority))
    return [f"{k} = {_quote(v)}" for k, v in pairs if v]


def render(servers: list[ServerSpec]) -> str:
    """The TOML text for ``servers`` (sorted: the same servers give the same file)."""
    lines = ["# written by mpsd at each start of the MPS v3 daemon: changes here are lost",
             f"schema_version = {_quote(SCHEMA_VERSION)}"]
    for spec in sorted(servers, key=lambda s: s.name):
        lines += ["", f"[servers.{spec.name}]", f"allowed_devices = {_quote(spec.device)}"]
        if spec.uid is not None:
            lines.append(f"uid = {spec.uid}")
        lines += _limit_lines(spec.limits)
        for ns in sorted(spec.namespaces):
            lines += ["", f"[servers.{spec.name}.namespaces.{ns}]", *_limit_lines(spec.namespaces[ns])]
    return "\n".join(lines) + "\n"


def default_limits(config: Config) -> Limits3:
    """The servers' own limits (their default namespaces) from the v2-style defaults of the config:
    a device limit by index or UUID of the server's GPU is not known here, so the first
    ordinal-0 limit is taken only when the config sets one limit for every device."""
    memory = config.pinned_mem_limit.get(0) if len(config.pinned_mem_limit) == 1 else None
    return limits(memory, config.active_thread_percentage, config.client_priority)
