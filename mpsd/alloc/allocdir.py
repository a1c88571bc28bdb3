"""Allocation directories in regionDir: one fresh directory per allocation (the device plugin's
Allocate) or prepared claim (DRA's Prepare), and a stored one re-created at start."""

from __future__ import annotations

import logging
import os
import secrets
import stat
from typing import Protocol

from ..errors import PluginError

log = logging.getLogger(__name__)


def fresh_dir(region_dir: str, prefix: str) -> str:
    """A new directory ``<prefix>-<random>`` in ``region_dir`` that did not exist before (mkdir,
    not makedirs: an existing name is never reused), mode 0777 so that any container UID
    creates its region there. Allocate (prefix: the allocation ID) and DRA's Prepare (prefix:
    ``claim-<uid>``) both make their directories here."""
    for _ in range(4):
        directory = os.path.join(region_dir, f"{prefix}-{secrets.token_hex(6)}")
        try:
            try:
                os.mkdir(directory, 0o700)
            except FileNotFoundError:  # regionDir itself is gone: re-created, root's
                os.makedirs(region_dir, mode=0o755, exist_ok=True)
                os.mkdir(directory, 0o700)
            os.chmod(directory, 0o777)  # not in mkdir: the umask would take bits off
            return directory
        except FileExistsError:
            continue
        except OSError as exc:
            raise PluginError(f"cannot create region directory {directory}: {exc.strerror or exc}") from exc
    raise PluginError(f"cannot create a new region directory in {region_dir}: names taken")


class _Stored(Protocol):
    """A stored record with a region directory: the device plugin's Allocation, DRA's PreparedClaim."""

    @property
    def allocation_id(self) -> str: ...
    @property
    def region_dir(self) -> str: ...


def restore_region_dir(allocation: _Stored, region_root: str) -> bool:
    """At start: re-create the directory of a stored allocation that is missing (mode 0777, as
    Allocate made it). Only a directory of ours is made: directly in ``region_root``, named
    ``<allocation ID>-...``. Anything else (a record naming a place outside regionDir, a file
    or a link standing where the directory should be) is left alone with one line: the plugin
    starts all the same, and garbage collection deals with the record. True when it is there."""
    path = allocation.region_dir
    if (os.path.dirname(os.path.abspath(path)) != os.path.abspath(region_root)
            or not os.path.basename(path).startswith(allocation.allocation_id + "-")):
        why = f"not a directory of ours in regionDir {region_root}"
    else:
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                return True
            why = "a file or a link stands there"
        except FileNotFoundError:
            try:
                os.mkdir(path, 0o700)
                os.chmod(path, 0o777)  # not in mkdir: the umask would take bits off
                log.warning("region directory missing, re-created allocation=%s path=%s",
                            allocation.allocation_id, path)
                return True
            except OSError as exc:
                why = f"cannot create it: {exc.strerror or exc}"
        except OSError as exc:
            why = f"cannot inspect it: {exc.strerror or exc}"
    log.warning("region directory of a stored allocation not re-created allocation=%s path=%s (%s)",
                allocation.allocation_id, path, why)
    return False
