"""Pausing the MIG instance daemons for a MIG reconfiguration (``mpsd mig-pause``, ``mpsd mig-resume``).

NVIDIA's MIG manager stops its own operands (device plugin, DCGM, ...) before it changes a layout,
not mpsd's; and destroying a GPU instance fails while a process holds it, which every MPS control
daemon and server of that instance does. So the sequence is the operator's (docs/mig.md): drain the
node's MIG slices, ``mpsd mig-pause`` (the running mpsd quits every instance daemon and starts none
until resumed), reconfigure, ``mpsd mig-resume``.

The request is a file in ``stateDir`` (root's, never a pod's): the running mpsd reads it every
inventory round (mpsd/mig/fleet.py). That an instance's daemon is gone is read from its control
socket, which no longer accepts a connection once the daemon quit (its file may stay behind).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import time

from .. import config as cfg
from ..errors import MpsdError

PAUSE_FILE = "mig-paused"
MIG_UUID = re.compile(r"MIG-[0-9A-Za-z-]{1,80}")


def paused(config: cfg.Config) -> bool:
    return os.path.lexists(os.path.join(config.state_dir, PAUSE_FILE))


def listening(pipe_dir: str, timeout: float = 2.0) -> bool:
    """Whether a daemon listens on ``<pipe_dir>/control`` now (a quit daemon leaves the socket file,
    which then refuses: ECONNREFUSED). The daemon's socket is SOCK_SEQPACKET (seen with the 535-555
    daemons): a stream connect is answered EPROTOTYPE by a listener without starting a session."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(os.path.join(pipe_dir, "control"))
        return True
    except OSError as exc:
        return exc.errno == errno.EPROTOTYPE
    finally:
        sock.close()


def serving(config: cfg.Config) -> list[str]:
    """The MIG instances whose daemon (under ``mig.pipeRoot``) still answers."""
    try:
        names = sorted(n for n in os.listdir(config.mig.pipe_root) if MIG_UUID.fullmatch(n))
    except OSError:
        return []
    return [n for n in names if listening(os.path.join(config.mig.pipe_root, n))]


def pause(config: cfg.Config, timeout: float = 120.0, poll: float = 0.5) -> str:
    """Ask the running mpsd to quit every MIG instance daemon and wait (``timeout``) until none answers."""
    os.makedirs(config.state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(config.state_dir, PAUSE_FILE)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        raise MpsdError(f"cannot write {path}: {exc.strerror}") from exc
    deadline = time.monotonic() + timeout
    while True:
        left = serving(config)
        if not left:
            return (f"MIG instance daemons stopped (mig.pipeRoot {config.mig.pipe_root}); change the MIG layout, "
                    "then run mpsd mig-resume")
        if time.monotonic() >= deadline:
            raise MpsdError(f"MIG instance daemons still answer after {timeout:g}s: {', '.join(left)} (is a pod "
                            "still using them? drain the node's MIG slices first); the pause stays requested")
        time.sleep(poll)


def resume(config: cfg.Config) -> str:
    path = os.path.join(config.state_dir, PAUSE_FILE)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return "MIG instance daemons were not paused"
    except OSError as exc:
        raise MpsdError(f"cannot remove {path}: {exc.strerror}") from exc
    return "MIG instance daemons resume at mpsd's next inventory round (healthInterval)"
