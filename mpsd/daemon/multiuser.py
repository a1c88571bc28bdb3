"""Pods of any UID on one MPS daemon (config key ``multiUser``).

The control daemon starts MPS servers lazily, one per UID at a time: a CUDA client whose UID
differs from the running server's is put on the daemon's pending list ("NEW CLIENT <pid> from
user <uid>: Server is not ready, push client to pending list") and waits, inside cuInit, until
every client of the running server has exited; an inference pod that never exits makes it wait
forever. The 555 daemon (Debian experimental) can instead serve every UID from one root server:
``nvidia-cuda-mps-control -f -multiuser-server`` (single dash, root only; its man page: "Relax
the single UID user requirement, allowing any UID to connect and share an MPS server started as
root"); 535 and 550 do not know the option (docs/mps-versions.md).

- :func:`probe` asks the binary itself: it starts ``BINARY -f -multiuser-server`` on a private,
  empty pipe dir and reads what it says. A daemon that knows the option starts ("Starting
  control daemon ..."); 535 and 550 start a daemon only for a lone -d or -f and otherwise run
  as a front-end, which finds no daemon there ("Cannot find MPS control daemon process"); a binary
  that refuses the option prints its help and exits. The probe is killed at once either way.
- :func:`resolve` turns ``multiUser`` (auto | on | off) and the probe into the daemon's options.
- Where the daemon serves one UID at a time, :class:`WaitingWatch` finds at each health check
  the CUDA clients waiting for another UID's server. The daemon's pending client keeps its
  control connection open (seen on the real 535, 550 and 555 daemons: tests/lifecycle/
  test_multiuser.py), so the kernel names it: every connection the daemon accepted on its
  control sockets (mpsd.daemon.peer.session_peers: PID and UID by SO_PEERCRED) whose process maps a
  CUDA driver (a front-end does not), is no server, and whose UID is not the UID of any server
  the daemon runs (a server is a child of the daemon; /proc names its UID).
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from . import peer
from .process import spawn
from ..trees import remove_tree
from ..errors import SetupError

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
OPTION = "-multiuser-server"
STARTED = "Starting control daemon"
ROOT_ONLY = "Only root user may enable -multiuser-server"
FRONT_END = "Cannot find MPS control daemon process"
OUTPUT_LIMIT = 64 << 10  # bytes of the probe's output read
SHORT_TMP = 48  # longest temp dir used for the probe's pipe dir (the daemon's limit is 87 bytes)
LOGGED_PER_CHECK = 8  # waiting clients named in the log per health check; the rest counted


# ---------------------------------------------------------------- is there a multi-user server


@dataclass(frozen=True)
class Probe:
    supported: bool
    answer: str  # what the binary's answer shows, one line


@dataclass(frozen=True)
class UidPolicy:
    multi_user: bool
    options: tuple[str, ...]  # appended to ``BINARY -f``
    reason: str  # one line: why this policy


def classify(output: str, exited: bool, waited: float) -> Probe:
    """What ``BINARY -f -multiuser-server`` printed (and whether it exited) says about it."""
    if STARTED in output:
        return Probe(True, f"the daemon started with {OPTION}")
    if ROOT_ONLY in output:
        return Probe(False, f"the daemon knows {OPTION} but takes it from root only, and mpsd does not run as root")
    if FRONT_END in output:
        return Probe(False, f"the binary ignores {OPTION} (it ran as a front-end): drivers before 555 do")
    if exited:
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "nothing")
        return Probe(False, f"the binary refused {OPTION}: it printed {last[:160]!r} and exited")
    return Probe(False, f"no answer to {OPTION} in {waited:g}s")


def probe(binary: str, timeout: float) -> Probe:
    """Start ``binary -f -multiuser-server`` on a private empty pipe dir, read its answer for at
    most ``timeout`` seconds, kill it and its session, remove the directory. SetupError when the
    binary cannot be run at all."""
    short = None if len(tempfile.gettempdir()) <= SHORT_TMP else "/tmp"  # its sockets' paths must fit
    scratch = tempfile.mkdtemp(prefix="mpsd-probe-", dir=short)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
    env.update(CUDA_MPS_PIPE_DIRECTORY=scratch, CUDA_MPS_LOG_DIRECTORY=scratch)
    try:
        proc = spawn(binary, env, OPTION)
        try:
            output, exited, waited = _read_answer(proc, timeout)
        finally:
            _kill(proc)
    finally:
        remove_tree(scratch)  # the daemon's files in it: never followed out (mpsd.trees)
    return classify(output, exited, waited)


def _read_answer(proc: subprocess.Popen, timeout: float) -> tuple[str, bool, float]:
    """Output until the daemon says it started, the process closes its output (exits), or
    ``timeout``; whether it exited; seconds waited."""
    assert proc.stdout is not None
    began = time.monotonic()
    data, exited = b"", False
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(data) < OUTPUT_LIMIT and STARTED.encode() not in data:
            left = timeout - (time.monotonic() - began)
            if left <= 0 or not sel.select(left):
                break
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                exited = True
                break
            data += chunk
    return data.decode(errors="replace"), exited, time.monotonic() - began


def _kill(proc: subprocess.Popen) -> None:
    for target in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # stuck in the kernel: left to the kernel, never waited on again
        log.error("multiUser probe pid=%d did not end 10s after SIGKILL", proc.pid)
    if proc.stdout is not None:
        proc.stdout.close()


def resolve(mode: str, binary: str, timeout: float, ask: Callable[[str, float], Probe] = probe) -> UidPolicy:
    """The daemon's options for ``multiUser`` ``mode``. ``on`` without support is a SetupError."""
    if mode == "off":
        return UidPolicy(False, (), "multiUser off")
    answer = ask(binary, timeout)
    if answer.supported:
        return UidPolicy(True, (OPTION,), f"multiUser {mode}: {answer.answer}")
    if mode == "on":
        raise SetupError(
            f"multiUser on: control binary {binary!r} cannot serve several UIDs: {answer.answer}; "
            "expected the daemon of driver 555 or later, run as root (or multiUser auto or off)"
        )
    return UidPolicy(False, (), f"multiUser auto: {answer.answer}")


V3_OPTION = "-m"  # "MPS v3 Interface", Control Daemon Options: ``-m, --multiuser``


def resolve_v3(mode: str, euid: int) -> UidPolicy:
    """``multiUser`` under MPS v3: the v3 daemon's own ``-m`` (its Interface page lists it; not
    v2's ``-multiuser-server``, which the v3 page does not list), from root only (Dynamo's guide:
    "start the daemon as root in multi-user mode"); no probe is run. Without it each server
    serves the UID the TOML's ``uid`` names (mpsd's own). ``on`` without root is a SetupError."""
    if mode == "off":
        return UidPolicy(False, (), "multiUser off (MPS v3: each server serves mpsd's UID, the file's uid)")
    if euid == 0:
        return UidPolicy(True, (V3_OPTION,), f"multiUser {mode}: MPS v3 daemon started with {V3_OPTION} as root")
    if mode == "on":
        raise SetupError(f"multiUser on: the MPS v3 daemon serves several UIDs only in multi-user mode ({V3_OPTION}), "
                         f"started as root; mpsd runs as uid {euid} (expected root, or multiUser auto or off)")
    return UidPolicy(False, (), f"multiUser auto: mpsd runs as uid {euid}, so each server serves that UID "
                                "(the file's uid): MPS v3's multi-user mode needs root")


def describe_policy(policy: UidPolicy) -> str:
    if policy.multi_user:
        return f"the daemon serves every UID from one root MPS server ({policy.reason})"
    return (
        f"the daemon serves one UID at a time ({policy.reason}): a client of another UID waits until every "
        "client of the running server has exited; mpsd reports such clients"
    )


def daemon_is_multi_user(pid: int, proc: str = "/proc") -> bool | None:
    """Whether the daemon ``pid`` was started with -multiuser-server (its command line); None
    when /proc does not tell."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            argv = f.read(1 << 16).split(b"\0")
    except OSError:
        return None
    if b"-p" in argv and b"3" in argv or b"--protocol" in argv and b"3" in argv:  # a v3 daemon: its own option
        return V3_OPTION.encode() in argv or b"--multiuser" in argv
    return OPTION.encode() in argv


# ---------------------------------------------------------------- clients waiting for another UID


@dataclass(frozen=True)
class Waiting:
    """A CUDA client the daemon holds pending while servers of other UIDs run."""

    pid: int
    uid: int
    servers: tuple[tuple[int, int], ...]  # (server PID, its UID) it waits for
    who: str  # pid, command, pod and container as /proc tells (mpsd.daemon.peer.describe)

    def line(self) -> str:
        held = ", ".join(f"server pid {pid} of uid {uid}" for pid, uid in self.servers)
        uids = ", ".join(sorted({str(uid) for _pid, uid in self.servers}))
        return (
            f"{self.who}, uid {self.uid}, waits for an MPS server: the daemon runs {held} and serves one UID at "
            f"a time; uid {self.uid} gets a server only once every client of uid {uids} has exited "
            "(multiUser, docs/mps-versions.md)"
        )

    def as_dict(self) -> dict:
        return {"pid": self.pid, "uid": self.uid, "who": self.who,
                "servers": [{"pid": pid, "uid": uid} for pid, uid in self.servers]}


def parse_status(text: str) -> tuple[int, int] | None:
    """(real UID, parent PID) from a /proc/PID/status text; None if either is missing."""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["Uid"].split()[0]), int(fields["PPid"].split()[0])
    except (KeyError, IndexError, ValueError):
        return None


def _uid_ppid(pid: int, proc: str) -> tuple[int, int] | None:
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            return parse_status(f.read(1 << 16).decode(errors="replace"))
    except OSError:
        return None


def waiting_clients(
    daemon_pid: int, pipe_dir: str, servers: list[int], proc: str = "/proc", own_pid: int | None = None
) -> list[Waiting]:
    """The CUDA clients connected to the daemon whose UID no running server has (see the
    module's docstring); [] when no server runs (a client then gets one of its own UID)."""
    server_uids: dict[int, int] = {}
    for server in servers:
        found = _uid_ppid(server, proc)
        if found is not None and found[1] == daemon_pid:  # the daemon's child, not a PID it made up
            server_uids[server] = found[0]
    if not server_uids:
        return []
    own = os.getpid() if own_pid is None else own_pid
    held = tuple(sorted(server_uids.items()))
    out = []
    for pid, uid in peer.session_peers(daemon_pid, pipe_dir, proc):
        if pid in (0, own) or pid in server_uids or uid in server_uids.values():
            continue  # outside mpsd's PID namespace, mpsd, a server, or served by one
        found = _uid_ppid(pid, proc)
        if found is None or found[1] == daemon_pid or not peer.maps_cuda(pid, proc):
            continue  # gone, a server not listed yet, or no CUDA client (a front-end session)
        out.append(Waiting(pid, uid, held, peer.describe(pid, proc)))
    return out


class WaitingWatch:
    """Logs each client that starts or stops waiting for another UID's server, once."""

    def __init__(self, pipe_dir: str, proc: str = "/proc") -> None:
        self.pipe_dir, self.proc = pipe_dir, proc
        self._seen: dict[int, Waiting] = {}

    def check(self, daemon_pid: int, servers: list[int]) -> tuple[Waiting, ...]:
        found = {w.pid: w for w in waiting_clients(daemon_pid, self.pipe_dir, servers, self.proc)}
        new = [found[pid] for pid in sorted(found.keys() - self._seen.keys())]
        for waiting in new[:LOGGED_PER_CHECK]:
            log.warning("MPS client waiting for another UID: %s", waiting.line())
        if len(new) > LOGGED_PER_CHECK:  # a pod forking clients cannot flood the log
            log.warning("%d more MPS clients waiting for another UID (mpsd status lists them)",
                        len(new) - LOGGED_PER_CHECK)
        for pid in sorted(self._seen.keys() - found.keys()):
            log.info("MPS client pid=%d no longer waits for another UID's server", pid)
        self._seen = found
        return tuple(found[pid] for pid in sorted(found))

    def clear(self) -> None:
        self._seen.clear()
