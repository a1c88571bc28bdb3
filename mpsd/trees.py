"""Removing a directory tree that someone else can write: a pod's allocation directory in
regionDir, the region directory of ``mpsd exec``. Every place mpsd removes such a tree calls
:func:`remove_tree`.

The writer chooses the tree's shape, so the removal must survive any of them: thousands of
nested directories (``shutil.rmtree`` recurses and raises RecursionError past ~1000 levels,
which ``ignore_errors`` does not cover), symlinks to host files and directories, FIFOs, names
swapped while it runs, a writer adding entries as fast as they go. So:

* nothing is looked up by a path below the top: every step is relative to a directory
  descriptor (``unlink``/``rmdir``/``rename`` with ``dir_fd``), and a directory is opened
  with ``O_DIRECTORY | O_NOFOLLOW``: a symlink is unlinked, never followed;
* no recursion and at most two directories open at once: a directory found inside a
  subdirectory is moved up into the top directory (a rename between the two descriptors) and
  emptied there in a later pass, so any depth costs the same as a flat tree;
* bounded work: at most ``max_steps`` entries handled per call; what is left is reported and
  removed by a later call;
* no exception for anything found in the tree: the result says what was not removed, in one
  line, for the caller to log.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

MAX_STEPS = 1 << 20  # entries handled per call (a regionDir tmpfs holds far fewer inodes)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MOVED = ".mpsd-removing-"  # the names of directories moved up into the top one


@dataclass(frozen=True)
class Removal:
    path: str
    removed: int  # entries unlinked or removed (directories included)
    error: str = ""  # one line: why the tree is not gone ("" when it is)

    @property
    def complete(self) -> bool:
        return not self.error


class _Budget:
    def __init__(self, max_steps: int) -> None:
        self.left = max_steps
        self.removed = 0
        self.moved = 0
        self.error = ""

    def take(self) -> bool:
        self.left -= 1
        return self.left >= 0


def remove_tree(path: str, max_steps: int = MAX_STEPS) -> Removal:
    """Remove ``path`` and everything below it without following a symlink (``path`` itself
    a symlink or a file: unlinked). Its parent is trusted (mpsd's own directory). Never raises
    for what is in the tree; a tree already gone is a complete removal."""
    parent, name = os.path.split(os.path.abspath(path))
    budget = _Budget(max_steps)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Removal(path, 0)
    except OSError as exc:
        return Removal(path, 0, f"cannot open {parent}: {exc.strerror or exc}")
    try:
        _remove_entry(parent_fd, name, parent_fd, budget, top=True)
    finally:
        os.close(parent_fd)
    if not budget.error and _exists(path):
        budget.error = "entries were added while it was removed"
    return Removal(path, budget.removed, budget.error)


def _exists(path: str) -> bool:
    return os.path.lexists(path)


def _remove_entry(dir_fd: int, name: str, top_fd: int, budget: _Budget, top: bool = False) -> None:
    """Unlink ``name`` in ``dir_fd``; a directory is emptied first: when ``top``, completely
    (pass after pass), else one level, its subdirectories moved up into ``top_fd``."""
    if not budget.take():
        budget.error = budget.error or "too many entries for one call (the rest goes in a later one)"
        return
    if not _unlink_is_dir(dir_fd, name, budget):
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:  # ELOOP, ENOTDIR: swapped for a symlink or a file since: a later pass
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            budget.error = f"cannot open directory {name!r}: {exc.strerror or exc}"
        return
    try:
        if top:
            _empty(fd, budget)
        else:
            _empty_one_level(fd, top_fd, budget)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
        budget.removed += 1
    except FileNotFoundError:
        pass
    except OSError as exc:
        if not top and exc.errno == errno.ENOTEMPTY:
            return  # filled again meanwhile: the next pass over the top directory
        budget.error = budget.error or f"cannot remove directory {name!r}: {exc.strerror or exc}"


def _empty(top_fd: int, budget: _Budget) -> None:
    """Pass over the top directory until it is empty, the budget is spent, or a pass makes no
    progress (an entry that cannot be removed: its error is kept)."""
    while budget.left > 0:
        before = (budget.removed, budget.moved)
        names = _names(top_fd, budget)
        if not names:
            return
        budget.error = ""  # an error counts only if it survives a whole pass
        for name in names:
            _remove_entry(top_fd, name, top_fd, budget)
            if budget.left <= 0:
                return
        if (budget.removed, budget.moved) == before:
            budget.error = budget.error or "no progress"
            return


def _empty_one_level(fd: int, top_fd: int, budget: _Budget) -> None:
    for name in _names(fd, budget):
        if not budget.take():
            return
        if _unlink_is_dir(fd, name, budget):
            _move_up(fd, name, top_fd, budget)


def _unlink_is_dir(dir_fd: int, name: str, budget: _Budget) -> bool:
    """Unlink ``name`` (whatever it is but a directory: a symlink goes, its target stays);
    True when it is a directory, which unlink cannot remove."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        budget.removed += 1
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        return True
    except OSError as exc:
        budget.error = f"cannot remove {name!r}: {exc.strerror or exc}"
    return False


def _move_up(fd: int, name: str, top_fd: int, budget: _Budget) -> None:
    """Rename the directory ``name`` of ``fd`` into the top directory under a name of ours.
    A name the writer took already: another one (rename replaces only an empty directory,
    which was to go anyway)."""
    for _ in range(8):
        budget.moved += 1
        try:
            os.rename(name, f"{_MOVED}{budget.moved}", src_dir_fd=fd, dst_dir_fd=top_fd)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                budget.error = f"cannot move directory {name!r}: {exc.strerror or exc}"
                return
    budget.error = f"cannot move directory {name!r}: every name tried is taken"


def _names(fd: int, budget: _Budget) -> list[str]:
    """The names in the directory ``fd`` (at most what the budget has left)."""
    names: list[str] = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                names.append(entry.name)
                if len(names) >= budget.left:
                    break
    except OSError as exc:
        budget.error = f"cannot list a directory: {exc.strerror or exc}"
    return names
