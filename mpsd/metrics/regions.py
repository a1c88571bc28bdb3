"""The shim accounting of the regions `mpsd exec` hands out, for the metrics of `mpsd run`.

`mpsd exec` gives each command a region file ``<stateDir>/exec/<name>/region``: a directory
of its own, or one given with ``--region`` so that several commands share one cap. Outside
Kubernetes that is the only place mpsd can see what each client holds against its cap
(NVML sees an MPS client's memory, not its cap). :class:`ExecRegions` reads them, one level
deep, through the shim's reader; the device plugin's regions are reported per allocation
instead (mpsd.plugin.usage).

The files are written by the clients: only regular files reached without a symlink are read
(a private copy of each, never a mapping), at most MAX_REGIONS of them per round, and a region
that cannot be read is skipped with one warning.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..logs import OncePerKey

log = logging.getLogger(__name__)

MAX_REGIONS = 256  # regions read per round; the rest wait for the directory to shrink
REGION_NAME = "region"


@dataclass(frozen=True)
class RegionUsage:
    """One device of one region: its cap, what its processes hold, and each live process."""

    region: str  # the directory name under <stateDir>/exec
    device: int  # CUDA ordinal as the region's processes see it
    cap_bytes: int  # 0: no cap on this device
    used_bytes: int
    processes: tuple[tuple[int, int], ...]  # (pid, bytes) of the live processes holding memory


def region_files(root: str, limit: int = MAX_REGIONS) -> list[tuple[str, str]]:
    """(name, path) of each ``root/<name>/region`` that is a regular file reached without a
    symlink, sorted by name, at most ``limit``; [] when ``root`` does not exist. Names that
    are not printable UTF-8 are skipped."""
    try:
        with os.scandir(root) as it:
            dirs = sorted((e for e in it if e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for entry in dirs:
        if not entry.name.isprintable() or _surrogates(entry.name):
            continue  # a label value must be text: a name that is not would break every scrape
        path = os.path.join(entry.path, REGION_NAME)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                found.append((entry.name, path))
        except OSError:
            continue
        if len(found) == limit:
            break
    return found


def _surrogates(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 (os.fsdecode's surrogateescape)
        return True
    return False


def rows_for(name: str, devices: Sequence) -> list[RegionUsage]:
    """shim.DeviceUsage list of one region -> rows (live processes only)."""
    return [
        RegionUsage(
            region=name,
            device=int(d.device),
            cap_bytes=int(d.cap),
            used_bytes=int(d.used),
            processes=tuple((int(p.pid), int(p.used)) for p in d.processes if p.alive),
        )
        for d in devices
    ]


class ExecRegions:
    """Callable: the rows of every region under ``root`` now. ``library`` gives the path of
    libmpsshim.so (called once, on first use; an error disables the reading, logged once).
    ``refused`` is called with the error of each region that cannot be read (the metrics
    count the refusals: Metrics.region_refused)."""

    def __init__(
        self, root: str, library: Callable[[], str], refused: Callable[[Exception], object] | None = None
    ) -> None:
        self.root = root
        self._library = library
        self._refused = refused
        self._path: str | None = None
        self._broken = False
        self._warned = OncePerKey()

    def __call__(self) -> list[RegionUsage]:
        found = region_files(self.root)
        if not found or self._broken:
            return []
        try:
            import shim

            if self._path is None:
                self._path = self._library()
        except Exception as exc:  # noqa: BLE001 - no shim library: the other metrics go on
            self._broken = True
            log.warning("cannot read the regions of mpsd exec under %s: %s", self.root, exc)
            return []
        rows: list[RegionUsage] = []
        for name, path in found:
            try:
                # a copy: a client truncating its region while a mapping of it is read would
                # kill mpsd with SIGBUS
                rows.extend(rows_for(name, shim.usage(path, library=self._path, copy=True)))
            except Exception as exc:  # noqa: BLE001 - a damaged or foreign region must not stop the others
                if self._refused is not None:
                    self._refused(exc)
                if self._warned.first(path):
                    log.warning("cannot read region path=%s error=%s", path, exc)
        return rows
