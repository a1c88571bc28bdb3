"""Preparing the pipe and log directories before the control daemon starts.

* Created if missing (mode 0755), with every ancestor made traversable (``o+x``) so that MPS
  servers, which run with the client's UID, can reach the sockets (a 0700 parent makes them
  exit at start and the client hang or fail).
* Files a crashed daemon left in the pipe dir (``control``, ``control_lock``, ...) are
  removed, unless a live daemon still holds ``control_lock``: then it is an error, because
  two daemons on one pipe dir would fight over the clients.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from .errors import SetupError

log = logging.getLogger(__name__)

STALE_FILES = ("control", "control_privileged", "log", "control_lock", "nvidia-cuda-mps-control.pid")
TRAVERSE = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH


def prepare(pipe_dir: str, log_dir: str) -> None:
    """Make both directories ready for a new daemon; SetupError (one line) when it cannot."""
    pipe = Path(pipe_dir)
    if not pipe.is_absolute():
        raise SetupError(f"pipe dir {pipe_dir!r}: expected an absolute path")
    if not Path(log_dir).is_absolute():
        raise SetupError(f"log dir {log_dir!r}: expected an absolute path")
    ensure_dir(pipe, 0o755)
    ensure_dir(Path(log_dir), 0o755)
    if daemon_holds_lock(pipe):
        raise SetupError(
            f"pipe dir {pipe_dir}: another nvidia-cuda-mps-control holds {pipe / 'control_lock'}; "
            "stop it or choose another pipeDir"
        )
    remove_stale(pipe)


def ensure_dir(path: Path, mode: int) -> None:
    """Create ``path`` (and parents) with ``mode`` and make every ancestor traversable by all."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SetupError(f"cannot create directory {path}: {exc.strerror}") from exc
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


def daemon_holds_lock(pipe: Path) -> bool:
    """True if a live process holds the POSIX lock the daemon keeps on ``control_lock``."""
    lock = pipe / "control_lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise SetupError(f"cannot open {lock}: {exc.strerror}") from exc
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise SetupError(f"cannot test the lock on {lock}: {exc.strerror}") from exc
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


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
