"""Preparing the pipe and log directories before the control daemon starts.

* Only a path no other local user controls is used: every component that exists must belong
  to root (or mpsd's own user), a symbolic link on the way must too, the directory itself must
  not be a link, and no directory on the way may be writable by others without the sticky
  bit. Anything else (a directory planted in ``/tmp`` by another user) is refused with one
  line, before anything is created, changed or removed there.
* Created if missing (mode 0755), with every ancestor made traversable (``o+x``) so that MPS
  servers, which run with the client's UID, can reach the sockets (a 0700 parent makes them
  exit at start and the client hang or fail).
* mpsd's own locks live in ``<stateDir>/locks/``, never in the pipe dir: every pod is handed
  the pipe dir, and a read-only descriptor (all a read-only mount gives) still takes an
  ``flock`` or a POSIX read lock, which blocks a write lock. ``<key>.run.lock`` is flock'ed by
  ``mpsd run`` for its whole life (:func:`hold_pipe_dir`): a second ``mpsd run`` on the same
  directory stops (or stands by) at once; ``<key>.holder.lock`` is the holder's
  (mpsd/lifecycle/holder.py). The key is the pipe dir's resolved path (:func:`lock_key`), so
  two spellings of one directory share one lock.
* Files a crashed daemon left in the pipe dir (``control``, ``control_lock``, ...) are
  removed, unless a daemon still holds ``control_lock``: then it is an error, because two
  daemons on one pipe dir would fight over the clients. A lock there is a daemon's only once
  its holder is proven one (mpsd.daemon.genuine.daemon_lock_holder): the file is 0666, so any
  process that reaches the pipe dir can take a read lock on it, and any local user who can
  open it read-write a write lock; such a lock is logged with its holder and the file replaced.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from ..errors import SetupError
from ..units import is_decimal
from . import genuine

log = logging.getLogger(__name__)

STALE_FILES = ("control", "control_privileged", "log", "control_lock", "nvidia-cuda-mps-control.pid")
TRAVERSE = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
CLIENT_SOCKET = "control"  # what clients other than root connect through (root: control_privileged)
LOCKS = "locks"  # in stateDir: mpsd's own locks, one per pipe dir and kind
LOCK_PID_WAIT = 1.0  # seconds a refused mpsd waits for the holder to write its PID


class PipeDirHeld(SetupError):
    """Another process (an ``mpsd run``, or ``mpsd stop-daemon`` while it works) holds the pipe
    dir's run lock (:func:`lock_path`); ``pid`` is the one it wrote there (None when it wrote none in time)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def prepare(pipe_dir: str, log_dir: str, binary: str = "nvidia-cuda-mps-control") -> None:
    """Make both directories ready for a new daemon (of ``binary``, controlBinary); SetupError
    (one line) when it cannot."""
    pipe = _absolute(pipe_dir, "pipe dir")
    ensure_dir(pipe, 0o755, "pipe dir")
    ensure_dir(_absolute(log_dir, "log dir"), 0o755, "log dir")
    holder = genuine.daemon_lock_holder(str(pipe), binary)
    if holder is not None:
        raise SetupError(
            f"pipe dir {pipe_dir}: another nvidia-cuda-mps-control ({genuine.peer.describe(holder)}) holds "
            f"{pipe / 'control_lock'}; stop it (mpsd stop-daemon), adopt it (daemonLifecycle: independent) "
            "or choose another pipeDir"
        )
    remove_stale(pipe)


def keep_log_target(pipe_dir: str) -> bool:
    """Pods get /dev/null bound over ``<pipeDir>/log`` (mpsd/alloc/container.py), and a bind mount
    needs its target: where no daemon has made its FIFO yet (not started, or in backoff after
    remove_stale), an empty FIFO of root's (0600) stands in, so that a container created meanwhile
    still starts. The daemon unlinks it and makes its own at its start, as after a crash. True when
    the target is there; a pipe dir that is missing or not a directory is left to the supervisor."""
    try:
        fd = os.open(pipe_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        os.mkfifo("log", 0o600, dir_fd=fd)
        return True
    except FileExistsError:
        return True
    except OSError as exc:
        log.warning("cannot create the log FIFO's stand-in in %s: %s", pipe_dir, exc.strerror or exc)
        return False
    finally:
        os.close(fd)


def _absolute(value: str, what: str) -> Path:
    path = Path(value)
    if not path.is_absolute():
        raise SetupError(f"{what} {value!r}: expected an absolute path")
    return Path(os.path.normpath(path))


def check_path(path: Path, what: str = "directory") -> None:
    """SetupError (one line) unless no other local user controls ``path``: each component
    that exists belongs to root or mpsd's user, as does a symbolic link on the way; ``path``
    itself is not a link; no directory on the way is writable by others without the sticky
    bit. The first missing component ends the check (mpsd creates the rest itself)."""
    trusted = {0, os.geteuid()}
    for component in [*reversed(path.parents), path]:
        try:
            st = os.lstat(component)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise SetupError(f"{what} {path}: cannot inspect {component}: {exc.strerror}") from exc
        where = f"{what} {path}" + ("" if component == path else f": {component}")
        fix = f"remove it or choose another {what}"
        if stat.S_ISLNK(st.st_mode) and component == path:
            raise SetupError(f"{where}: a symbolic link; expected a directory, not a link to one: use the real path")
        if st.st_uid not in trusted:
            kind = "a symbolic link owned" if stat.S_ISLNK(st.st_mode) else "owned"
            raise SetupError(
                f"{where}: {kind} by uid {st.st_uid}, not by root or mpsd's user: "
                f"that user could redirect what clients connect to; {fix}"
            )
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise SetupError(
                f"{where}: writable by every user without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): "
                f"anyone could replace what is in it; chmod o-w or +t it, or choose another {what}"
            )


def ensure_dir(path: Path, mode: int, what: str = "directory") -> None:
    """Create ``path`` with ``mode`` if missing, one component at a time and each checked
    (:func:`check_path`), then make every ancestor traversable by all."""
    check_path(path, what)
    for component in [*reversed(path.parents), path]:
        if os.path.lexists(component):
            continue
        try:
            os.mkdir(component, 0o755)
        except FileExistsError:
            pass  # made meanwhile: checked below
        except OSError as exc:
            raise SetupError(f"cannot create directory {path}: {exc.strerror}") from exc
        check_path(component, what)
    check_path(path, what)
    if not path.is_dir():
        raise SetupError(f"{path} exists and is not a directory")
    try:
        current = stat.S_IMODE(path.stat().st_mode)
        if current | mode != current:
            os.chmod(path, current | mode)
            log.info("chmod path=%s mode=%o", path, current | mode)
    except OSError as exc:
        raise SetupError(f"cannot set mode {mode:o} on {path}: {exc.strerror}") from exc
    make_traversable(path.parent)


def make_traversable(path: Path) -> None:
    """Add x for group and others to ``path`` and each ancestor that lacks it."""
    for component in [path, *path.parents]:
        try:
            current = stat.S_IMODE(component.stat().st_mode)
        except OSError as exc:
            raise SetupError(f"cannot inspect {component}: {exc.strerror}") from exc
        if current & TRAVERSE == TRAVERSE:
            continue
        try:
            os.chmod(component, current | TRAVERSE)
        except OSError as exc:
            raise SetupError(
                f"{component} (mode {current:o}) is not traversable by other users and cannot be changed "
                f"({exc.strerror}); clients of other UIDs could not reach the pipe dir: "
                "chmod o+x it or choose another path"
            ) from exc
        log.warning("made traversable path=%s old_mode=%o new_mode=%o", component, current, current | TRAVERSE)


def remove_stale(pipe: Path) -> list[str]:
    """Remove what a dead daemon left; the names removed."""
    removed = []
    for name in STALE_FILES:
        target = pipe / name
        try:
            target.unlink()
        except FileNotFoundError:
            continue
        except IsADirectoryError as exc:
            raise SetupError(f"{target} is a directory; expected a socket or file left by a daemon") from exc
        except OSError as exc:
            raise SetupError(f"cannot remove stale {target}: {exc.strerror}") from exc
        removed.append(name)
    if removed:
        log.info("removed stale pipe files dir=%s files=%s", pipe, ",".join(removed))
    return removed


def client_socket_problem(pipe: Path) -> str:
    """Why clients other than root cannot connect to the daemon ("" when they can): root's
    front-end uses ``control_privileged``, so a health check run as root does not see this."""
    path = pipe / CLIENT_SOCKET
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} is missing: clients other than root cannot connect"
    except OSError as exc:
        return f"cannot inspect {path}: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket: clients other than root cannot connect"
    if st.st_mode & 0o006 != 0o006:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}: clients other than root cannot connect"
    return ""


def lock_key(resolved: str) -> str:
    """A file name for a resolved absolute path, readable and one-to-one (systemd-escape's
    rules): ``/run/mpsd-pipe`` -> ``run-mpsd\\x2dpipe``; "-" for ``/``."""
    if resolved == "/":
        return "-"
    out = []
    for i, ch in enumerate(resolved.strip("/")):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and (ch.isalnum() or ch in "_.")) and not (ch == "." and i == 0):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode())
    return "".join(out)


def lock_path(state_dir: str, pipe_dir: str, kind: str) -> Path:
    """``<stateDir>/locks/<key>.<kind>.lock``: mpsd's ``kind`` lock ("run", "holder") on the
    pipe dir, keyed by its resolved path (a symlink on the way does not make it another)."""
    return _absolute(state_dir, "state dir") / LOCKS / f"{lock_key(os.path.realpath(pipe_dir))}.{kind}.lock"


def open_lock(state_dir: str, pipe_dir: str, kind: str) -> tuple[int, Path]:
    """Create and check the locks directory (:func:`check_path`: no other user's), then open
    (creating it 0600) mpsd's ``kind`` lock file of ``pipe_dir``: its fd and path. SetupError
    (one line) when it cannot, or when it is not a regular file of root or mpsd's user."""
    path = lock_path(state_dir, pipe_dir, kind)
    ensure_dir(path.parent, 0o755, "state dir")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SetupError(f"pipe dir {pipe_dir}: cannot open {path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o077:
        os.close(fd)
        raise SetupError(f"pipe dir {pipe_dir}: {path} is not a 0600 regular file of root or mpsd's user; remove it")
    return fd, path


def hold_pipe_dir(pipe_dir: str, state_dir: str, pid_wait: float | None = None) -> int:
    """Create and check the pipe dir, then flock its run lock in ``state_dir`` for the life of
    the caller (the fd returned; :func:`release_pipe_dir` ends it, and so does the process's
    exit). PipeDirHeld naming the holder's PID when another mpsd holds it (waiting up to
    ``pid_wait``, by default LOCK_PID_WAIT, for a holder that has just taken it to write it)."""
    pipe = _absolute(pipe_dir, "pipe dir")
    ensure_dir(pipe, 0o755, "pipe dir")
    fd, path = open_lock(state_dir, str(pipe), "run")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd, LOCK_PID_WAIT if pid_wait is None else pid_wait)
            raise PipeDirHeld(
                f"pipe dir {pipe}: another mpsd run (pid {holder}) holds {path}; "
                "stop it or give this one another pipeDir",
                int(holder) if is_decimal(holder) else None,
            ) from None
        except OSError as exc:
            raise SetupError(f"pipe dir {pipe}: cannot lock {path}: {exc.strerror}") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk: the lock holds all the same, only the PID is not named
            log.warning("cannot write pid to lock file path=%s error=%s", path, exc.strerror)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_pipe_dir(fd: int) -> None:
    """Clear the PID (a later refusal must not name a process gone) and drop the lock."""
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass  # the lock goes with the close all the same
    finally:
        os.close(fd)


def _holder(fd: int, wait: float) -> str:
    """The PID the lock's holder wrote, waiting briefly for it (it writes once it holds it)."""
    deadline = time.monotonic() + wait
    while True:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if is_decimal(text) or time.monotonic() >= deadline:
            return text if is_decimal(text) else "unknown"
        time.sleep(0.01)
