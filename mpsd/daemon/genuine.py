"""Is a running control daemon the genuine one of a pipe directory? Asked before ``mpsd run``
adopts a daemon it did not start (``daemonLifecycle: independent``), and before it kills one.

The pipe directory is where every GPU pod finds the daemon, and whoever can write it can put
sockets there; a process's name is chosen by the process. So only what the kernel says counts:

1. the process that called ``listen()`` on ``control_privileged`` (``SO_PEERCRED``,
   mpsd.daemon.peer.listener_pid) is P, and ``control`` is served by P too or by no one;
2. P holds the write lock on this directory's ``control_lock`` (``F_GETLK``; a POSIX lock
   belongs to the file's inode, so a daemon of another directory cannot hold it). The file is
   0666: any local user can open it read-write and wait for that lock, so the lock alone
   proves nothing. Its holder is a daemon only once 3-5 hold for it
   (:func:`daemon_lock_holder`); otherwise the lock is nobody's and the file is replaced;
3. P lives in mpsd's PID namespace (MPS names its clients by PID) and runs as root or as
   mpsd's user;
4. P's executable (``/proc/P/exe``) is ``controlBinary``: the same file, the same bytes, or
   a copy of the same driver version (the version string NVIDIA builds into the binary). Of
   another version it is refused as such: a front-end and a daemon of two versions are not
   meant to talk;
5. P's environment names this pipe directory (``CUDA_MPS_PIPE_DIRECTORY``), compared resolved:
   another spelling of the same directory (a symlink on the way) is one line naming both.

P is then held through a pidfd opened before the checks and found still running after them:
a PID cannot be reused while its process runs, so every fact read by PID was P's.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import select
import shutil
import stat
import struct
from dataclasses import dataclass

from ..logs import OncePerKey
from . import backlog, peer

log = logging.getLogger(__name__)
_said = OncePerKey(64)  # lines said once per holder or spelling, not at every retry

VERSION = re.compile(rb"\x00(\d{3}\.\d{1,3}\.\d{2})\x00")  # "535.261.03", "555.58.02": NUL-terminated
PROGRAM_LIMIT = 256 << 20  # bytes read of an executable to compare it or find its version


@dataclass(frozen=True)
class Proof:
    """What :func:`prove` found. ``pid`` and ``pidfd`` (the caller's to close) when the daemon
    is genuine; otherwise ``problem`` says why not in one line (nothing there at all: "").
    ``impostor``: a socket is served by something that is not this pipe dir's daemon.
    ``owner``: this pipe dir's genuine daemon (by 2-5) whose sockets another process serves:
    restarted, it binds them again."""

    pid: int | None = None
    pidfd: int | None = None
    problem: str = ""
    impostor: bool = False
    owner: int | None = None

    @property
    def absent(self) -> bool:
        return self.pid is None and not self.problem


# ---------------------------------------------------------------- pure


def binary_version(data: bytes) -> str | None:
    """The driver version NVIDIA builds into nvidia-cuda-mps-control ("535.261.03"), or None."""
    m = VERSION.search(data)
    return m.group(1).decode() if m else None


def environ_pipe_dir(environ: bytes) -> str:
    """The pipe dir a process with this /proc/PID/environ block uses (MPS's default without one)."""
    return os.path.normpath(peer.environ_get(environ, "CUDA_MPS_PIPE_DIRECTORY") or peer.DEFAULT_PIPE_DIR)


def status_uids(status: str) -> tuple[int, ...]:
    """Real, effective, saved and filesystem UIDs from a /proc/PID/status text."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return tuple(int(v) for v in line.split()[1:])
    return ()


# ---------------------------------------------------------------- the kernel's view


def control_lock_holder(pipe_dir: str) -> int | None:
    """The PID holding a write lock on pipe_dir/control_lock, None when none does (a read lock
    is anyone's). Not yet a daemon: :func:`daemon_lock_holder` proves it one."""
    return write_lock_holder(os.path.join(pipe_dir, "control_lock"))


def daemon_lock_holder(pipe_dir: str, binary: str, proc: str = "/proc") -> int | None:
    """The PID holding the write lock on pipe_dir/control_lock once it is proven a control
    daemon (3-5 above, of any driver version); None when none does or its holder is no daemon:
    then one line names it (once) and the lock is nobody's (the file is replaced, as for a
    read lock, mpsd.daemon.dirs.prepare)."""
    pid = control_lock_holder(pipe_dir)
    if pid is None:
        return None
    problem, impostor = process_problem(pid, pipe_dir, binary, proc)
    if not impostor:
        return pid
    if _said.first(f"lock {pipe_dir} {pid}"):
        log.warning("%s/control_lock is write-locked by %s, which is no control daemon (%s): the lock is "
                    "nobody's, the file is replaced", pipe_dir, peer.describe(pid, proc), problem)  # fmt: skip
    return None


def write_lock_holder(path: str) -> int | None:
    """The PID holding a POSIX write lock on ``path`` (F_GETLK), None when none does or the
    file cannot be opened (not followed if it is a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        kind, pid = lock_holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return pid if kind == fcntl.F_WRLCK and pid > 0 else None


_FLOCK = "hhqqi4x"  # struct flock (x86-64, arm64): l_type, l_whence, l_start, l_len, l_pid


def lock_holder(fd: int) -> tuple[int, int]:
    """(F_UNLCK, 0), or the type (F_RDLCK/F_WRLCK) and PID of a POSIX lock on the whole file
    held by another process (F_GETLK)."""
    query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return kind, pid


def exited(pidfd: int) -> bool:
    """True once the process of ``pidfd`` has exited (a pidfd turns readable)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def _read(path: str, limit: int = peer.READ_LIMIT) -> bytes:
    return peer._read(path, limit)


def _read_program(path: str) -> bytes:
    """An executable, at most PROGRAM_LIMIT bytes. /proc/PID/exe is the kernel's link to what
    the process runs (not a name anyone chose), so it is followed; only a regular file is read."""
    with open(path, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return f.read(PROGRAM_LIMIT)


def program_problem(pid: int, binary: str, proc: str = "/proc") -> tuple[str, bool]:
    """("", False) when ``pid`` runs ``binary`` (4. above); else why not, and whether it is
    not an MPS control daemon at all (an impostor) rather than one of another version."""
    want = shutil.which(binary)
    if want is None:
        return f"controlBinary {binary!r} not found: cannot tell what the daemon should run", False
    exe = f"{proc}/{pid}/exe"
    try:
        shown = os.readlink(exe)
        have_st, want_st = os.stat(exe), os.stat(want)
        if (have_st.st_dev, have_st.st_ino) == (want_st.st_dev, want_st.st_ino):
            return "", False
        have, wanted = _read_program(exe), _read_program(want)
    except OSError as exc:
        return f"cannot read what {peer.describe(pid, proc)} runs: {os.strerror(exc.errno or errno.EIO)}", True
    if have == wanted:
        return "", False
    have_version, want_version = binary_version(have), binary_version(wanted)
    if have_version is None:
        return f"{peer.describe(pid, proc)} runs {shown}, not nvidia-cuda-mps-control", True
    if have_version != want_version:
        return (
            f"the daemon {peer.describe(pid, proc)} runs nvidia-cuda-mps-control {have_version} ({shown}); "
            f"controlBinary {want} is {want_version or 'of no known version'}: not adopted (a front-end and a "
            "daemon of two versions); stop it on purpose (mpsd stop-daemon) or set controlBinary to its version"
        ), False
    return "", False


def process_problem(pid: int, pipe_dir: str, binary: str, proc: str = "/proc") -> tuple[str, bool]:
    """("", False) when ``pid`` passes 3-5 above; else one line, and whether it is an impostor."""
    who = peer.describe(pid, proc)
    try:
        same_ns = os.readlink(f"{proc}/{pid}/ns/pid") == os.readlink(f"{proc}/self/ns/pid")
        uids = status_uids(_read(f"{proc}/{pid}/status").decode(errors="replace"))
        environ = _read(f"{proc}/{pid}/environ")
    except OSError as exc:
        return f"cannot inspect {who}: {os.strerror(exc.errno or errno.EIO)}", True
    if not same_ns:
        return f"{who} runs in another PID namespace than mpsd", True
    if not uids or uids[1] not in (0, os.geteuid()):
        return f"{who} runs as uid {uids[1] if uids else '?'}, not as root or mpsd's user", True
    problem, impostor = program_problem(pid, binary, proc)
    if problem:
        return problem, impostor
    theirs = environ_pipe_dir(environ)
    if theirs != os.path.normpath(pipe_dir):
        if not same_dir(pipe_dir, theirs, pid, proc):
            return f"{who} is the daemon of pipe dir {theirs}, not of {pipe_dir}", True
        if _said.first(f"spelling {pid} {theirs} {pipe_dir}"):
            log.warning("the daemon %s names its pipe dir %s, mpsd %s: the same directory, spelled two ways",
                        who, theirs, pipe_dir)  # fmt: skip
    return "", False


def same_dir(ours: str, theirs: str, pid: int, proc: str = "/proc") -> bool:
    """True if ``theirs`` (a path in the view of process ``pid``) is the directory ``ours``:
    the same inode, reached from mpsd's root or from the process's own (/proc/PID/root)."""
    try:
        want = os.stat(ours)
    except OSError:
        return False
    for path in (theirs, f"{proc}/{pid}/root{theirs}"):
        try:
            have = os.stat(path)
        except OSError:
            continue
        if (have.st_dev, have.st_ino) == (want.st_dev, want.st_ino):
            return True
    return False


def prove(pipe_dir: str, binary: str, proc: str = "/proc", tries: int = 3) -> Proof:
    """Whether the daemon serving ``pipe_dir`` is genuine (1-5 above); see :class:`Proof`. A
    daemon that exits while it is checked (its /proc entries gone half way) is looked at again."""
    for _ in range(tries):
        proof, changed = _prove_once(pipe_dir, binary, proc)
        if not changed:
            return proof
    return proof


def _prove_once(pipe_dir: str, binary: str, proc: str) -> tuple[Proof, bool]:
    privileged = os.path.join(pipe_dir, "control_privileged")
    lock = control_lock_holder(pipe_dir)
    listener = peer.listener_pid(privileged)
    if listener is None:
        if lock is None or daemon_lock_holder(pipe_dir, binary, proc) is None:  # no daemon's lock: nobody's
            return Proof(), False  # nothing runs here: at most files a dead daemon left
        return Proof(problem=f"{peer.describe(lock, proc)} holds {pipe_dir}/control_lock but "
                     f"{backlog.why_no_answer(privileged, lock, proc)}"), False  # fmt: skip
    if listener == 0:
        return Proof(problem=f"{privileged} is served by a process outside mpsd's PID namespace", impostor=True), False
    changed = Proof(problem=f"the process serving {privileged} (pid {listener}) exited or changed while it was checked")
    try:
        pidfd = os.pidfd_open(listener)
    except OSError:
        return changed, True
    proof = _check(pipe_dir, binary, listener, lock, proc)
    if exited(pidfd) or peer.listener_pid(privileged) != listener:
        os.close(pidfd)
        return changed, True
    if proof.pid is None:
        os.close(pidfd)
        return proof, False
    return Proof(pid=listener, pidfd=pidfd), False


def _check(pipe_dir: str, binary: str, listener: int, lock: int | None, proc: str) -> Proof:
    privileged = os.path.join(pipe_dir, "control_privileged")
    problem, impostor = process_problem(listener, pipe_dir, binary, proc)
    if lock != listener:
        owner = lock if lock is not None and not process_problem(lock, pipe_dir, binary, proc)[0] else None
        held = peer.describe(lock, proc) if lock is not None else "no process"
        return Proof(
            problem=problem or f"{privileged} is served by {peer.describe(listener, proc)}, but "
            f"{pipe_dir}/control_lock is held by {held}: not this pipe dir's daemon",
            impostor=True,
            owner=owner,
        )
    if problem:
        return Proof(problem=problem, impostor=impostor)
    served = peer.impostor(pipe_dir, listener, ("control",), proc)
    if served:  # the daemon is genuine, its client socket is not its own
        return Proof(problem=served, impostor=True, owner=listener)
    return Proof(pid=listener)
