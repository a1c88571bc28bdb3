"""Per-pod bookkeeping: who holds each allocation (pod-resources API), stale allocations
garbage-collected, and per-allocation memory use and limit for the metrics.

The pure part (``reconcile``, ``usage_rows``) decides; ``UsageTracker`` does the I/O.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol

from ..errors import MpsdError, PluginError
from ..logs import OncePerKey
from .metrics import AllocationUsage
from ..trees import remove_tree
from .kubelet import Holder, list_holders
from ..alloc.slicing import allocation_id
from ..alloc.state import Allocation, StateStore
from ..alloc.usage import UsageReader, shim_usage

log = logging.getLogger(__name__)

_DIR_NAME = re.compile(r"(alloc-[0-9a-f]{16})(?:-[0-9a-f]{1,32})?")  # an allocation's directory: ID-random


@dataclass(frozen=True)
class Reconciled:
    keep: list[Allocation]  # with labels from the pod-resources API where known
    stale: list[Allocation]
    missing_since: dict[str, float]  # allocation ID -> first time in a row no container held it


def reconcile(
    allocations: Iterable[Allocation],
    holders: Mapping[frozenset[str], Holder] | None,
    now: float,
    grace: float,
    missing_since: Mapping[str, float] | None = None,
) -> Reconciled:
    """Label allocations with their container; an allocation whose device IDs no container
    holds any more is stale once it has been missing from the list for ``grace`` seconds in
    a row (``missing_since`` carries that over from the previous rounds) and was not
    allocated in the last ``grace`` seconds either. One empty answer is never enough: a
    restarting kubelet lists no pods until it has synced them, and the kubelet lists a
    container only after Allocate returned (the same devices may go to a new container
    before the old one's allocation was collected). Without the API (``holders`` None)
    nothing is stale, labels stay as they were and the missing times are carried over."""
    missing_since = dict(missing_since or {})
    keep: list[Allocation] = []
    stale: list[Allocation] = []
    missing: dict[str, float] = {}
    for a in allocations:
        if holders is None:
            keep.append(a)
            if a.allocation_id in missing_since:
                missing[a.allocation_id] = missing_since[a.allocation_id]
            continue
        holder = holders.get(frozenset(a.device_ids))
        if holder is not None:
            keep.append(a.labelled(holder.pod, holder.namespace, holder.container))
            continue
        since = min(missing_since.get(a.allocation_id, now), now)
        if now - max(since, a.last_allocated) < grace:
            keep.append(a)
            missing[a.allocation_id] = since
        else:
            stale.append(a)
    return Reconciled(keep, stale, missing)


def usage_rows(
    allocations: Iterable[Allocation], used: Mapping[str, Mapping[int, int]], gpu_index: Mapping[str, int]
) -> list[AllocationUsage]:
    """One row per allocation and GPU (labelled by host index, as the other GPU metrics are);
    ``used`` maps allocation ID -> bytes per ordinal the container sees."""
    rows = []
    for a in allocations:
        per_ordinal = used.get(a.allocation_id, {})
        for ordinal, uuid in enumerate(a.gpus):
            rows.append(
                AllocationUsage(
                    allocation_id=a.allocation_id,
                    pod=a.pod,
                    namespace=a.namespace,
                    container=a.container,
                    gpu=gpu_index.get(uuid, uuid),
                    limit_bytes=a.memory_limits.get(ordinal, 0),
                    used_bytes=int(per_ordinal.get(ordinal, 0)),
                )
            )
    return rows


class UsageMetrics(Protocol):
    """What a round pushes to (mpsd.registry.Metrics)."""

    def set_allocations(self, rows: Iterable[AllocationUsage]) -> None: ...
    def region_refused(self, kind: str, error: BaseException) -> bool: ...


class UsageTracker:
    def __init__(
        self,
        *,
        store: StateStore,
        region_root: str,
        resource_name: str,
        gpu_index: Mapping[str, int],
        pod_resources_socket: str | None,
        metrics: UsageMetrics | None,
        usage_reader: UsageReader = shim_usage,
        region_name: str = "region",
        gc_grace: float = 60.0,
        on_release: Callable[[str], None] = lambda allocation_id: None,
    ) -> None:
        self.store = store
        self.on_release = on_release  # the sharing backend's release (mpsd/sharing)
        self.region_root = os.path.abspath(region_root)
        self.resource_name = resource_name
        self.gpu_index = dict(gpu_index)
        self.pod_resources_socket = pod_resources_socket
        self.metrics = metrics
        self.usage_reader = usage_reader
        self.region_name = region_name
        self.gc_grace = gc_grace
        self._warned = OncePerKey()
        self._missing_since: dict[str, float] = {}
        self._unnamed_since: dict[str, float] = {}  # directory name -> first round no allocation named it

    def tick(self, now: float | None = None) -> list[AllocationUsage]:
        """One round: labels, garbage collection, metrics. Returns the rows pushed."""
        now = time.time() if now is None else now
        holders = None
        if self.pod_resources_socket:
            try:
                holders = list_holders(self.pod_resources_socket, self.resource_name)
            except MpsdError as exc:
                self._warn_once("podresources", "pod-resources unavailable, keeping allocations error=%s", exc)
        previous = self._missing_since
        result = reconcile(self.store.all(), holders, now, self.gc_grace, previous)
        self._missing_since = result.missing_since
        try:  # a state that cannot be written (a full disk) holds up labels and GC, not usage
            self._label(result.keep)
            if result.stale:
                self.collect(result.stale)  # nothing is released that the state still names
        except PluginError as exc:
            self._warn_once(f"state:{exc}", "state not writable, labels and garbage collection wait error=%s", exc)
            for a in result.stale:  # still stale: collected as soon as the state can be written
                self._missing_since[a.allocation_id] = previous.get(a.allocation_id, now)
        self.sweep(holders, now)
        used = {a.allocation_id: self._read(a) for a in result.keep}
        rows = usage_rows(result.keep, used, self.gpu_index)
        if self.metrics is not None:
            self.metrics.set_allocations(rows)
        if self.store.journal_lines:
            try:
                self.store.compact()  # here, off Allocate's path
            except PluginError as exc:
                self._warn_once(f"state:{exc}", "state compaction failed, tried again next round error=%s", exc)
        return rows

    def _label(self, labelled: list[Allocation]) -> None:
        """Write the labels onto the stored allocations as they are now (an Allocate since
        the snapshot may have moved their time on: that is kept)."""
        with self.store.lock:
            changed = []
            for a in labelled:
                current = self.store.get(a.allocation_id)
                if current is not None:
                    updated = current.labelled(a.pod, a.namespace, a.container)
                    if updated != current:
                        changed.append(updated)
            if changed:
                self.store.put_many(changed)

    def collect(self, stale: list[Allocation]) -> None:
        """Forget ``stale`` allocations and delete their region directories, except those
        stored differently by now (handed out again since the snapshot) or gone already.
        Under the store's lock, which Allocate holds while it records: an allocation is
        never released between Allocate creating its directory and recording it."""
        with self.store.lock:
            stale = [a for a in stale if self.store.get(a.allocation_id) == a]
            self.store.remove(a.allocation_id for a in stale)
        for a in stale:  # outside the lock: a pod's many files never hold up Allocate, and
            self._release(a)  # a directory name is never handed out again once created

    def sweep(self, holders: Mapping[frozenset[str], Holder] | None, now: float) -> list[str]:
        """Remove the directories in regionDir that no stored allocation names any more, once
        unnamed for the grace period: those of allocations given to a new pod since (the same
        device IDs, a fresh directory), and, when the pod-resources API answers, those of
        device sets no container holds (left by a crash between mkdir and the state write).
        A directory whose device set a container holds but the state does not know (a state
        file lost) is kept. Names not of the form ``alloc-<hex>-<hex>`` are not ours: kept.
        Returns the paths removed."""
        with self.store.lock:  # Allocate creates and records under it: no half-made entry
            current = self.store.all()
            try:
                names = os.listdir(self.region_root)
            except OSError:
                return []
        named = {os.path.basename(a.region_dir) for a in current}
        stored = {a.allocation_id for a in current}
        held = None if holders is None else {allocation_id(ids) for ids in holders}
        since: dict[str, float] = {}
        removed = []
        for name in names:
            match = _DIR_NAME.fullmatch(name)
            if name in named or match is None:
                continue
            owner = match.group(1)
            if owner not in stored and (held is None or owner in held):
                continue
            since[name] = first = min(self._unnamed_since.get(name, now), now)
            if now - first >= self.gc_grace:
                path = os.path.join(self.region_root, name)
                if self._remove(path, "no allocation names it"):
                    removed.append(path)
                    del since[name]
        self._unnamed_since = since
        return removed

    def _release(self, a: Allocation) -> None:
        log.info("allocation released allocation=%s devices=%s", a.allocation_id, ",".join(a.device_ids))
        try:
            self.on_release(a.allocation_id)
        except MpsdError as exc:  # e.g. a namespace the daemon would not delete: its next start drops it
            log.warning("backend release failed allocation=%s error=%s", a.allocation_id, exc)
        if os.path.dirname(os.path.abspath(a.region_dir)) == self.region_root:
            self._remove(a.region_dir, f"allocation {a.allocation_id} released")  # else swept later
        else:  # never delete outside regionDir, whatever the state file says
            log.warning("region directory outside regionDir left alone path=%s", a.region_dir)

    def _remove(self, path: str, why: str) -> bool:
        """Remove a pod's directory, whatever it holds; one line when it cannot (the next
        round tries again), and never an exception: one directory never stops a round."""
        try:
            result = remove_tree(path)
        except Exception as exc:  # noqa: BLE001 - e.g. MemoryError: the other directories go on
            error, removed = f"{type(exc).__name__}: {exc}", 0
        else:
            error, removed = result.error, result.removed
        if not error:
            log.info("region directory removed path=%s (%s) entries=%d", path, why, removed)
            return True
        self._warn_once(f"remove:{path}:{error}", "region directory not removed path=%s (%s) error=%s "
                        "(tried again next round)", path, why, error)
        return False

    def _read(self, a: Allocation) -> Mapping[int, int]:
        path = os.path.join(a.region_dir, self.region_name)
        try:
            return self.usage_reader(path)
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign region must not stop the others
            if self.metrics is not None:
                self.metrics.region_refused("allocation", exc)  # every round: the alert sees it go on
            # once per directory: a new pod on the same slices has a directory of its own
            self._warn_once(path, "cannot read usage allocation=%s path=%s error=%s", a.allocation_id, path, exc)
            return {}

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if self._warned.first(key):
            log.warning(msg, *args)

