"""Keeps the node's ResourceSlices on the API server equal to its GPUs (mpsd/dra/slices.py).

``publish(gpus, driver_version, taints)`` lists the node's slices of the driver and writes only
when the devices differ from what is there (quantities compared by value, a taint's server-set
``timeAdded`` aside): every slice of the pool is then rewritten with the next pool generation
(one more than the highest seen, so consumers never mix two versions of the pool), existing
slices are updated in place, missing ones created, surplus ones deleted last. A conflict (409:
someone changed a slice between the list and the write) is retried once from a fresh list. A
failure raises KubeAPIError and caches nothing: the next publish starts over and converges,
whatever was half-written. While the devices are unchanged, publish makes no API call at all
for ``resync_interval`` seconds, then checks again; ``invalidate()`` checks at the next publish
(a watch saw the node's slices change, the kubelet registered the plugin: at its start it
deletes every slice of the node).

Dropped fields. An API server with a feature gate off silently drops the fields it governs
(``allowMultipleAllocations`` and ``capacity.*.requestPolicy``: DRAConsumableCapacity, off by
default in 1.34 and 1.35; ``taints``: DRADeviceTaints): every slice written is compared with
what the server answered, as the DRA helper's resourceslice controller does (DroppedFieldsError
in k8s.io/dynamic-resource-allocation/resourceslice). A difference is logged once, in one line
naming the gate and what to do, ``dropped`` holds it (the ``mpsd_dra_slice_fields_dropped``
gauge), and what the server kept counts as current for the same devices: no rewrite of the same
content at every resync (which would bump the pool generation forever). A restart of mpsd tries
the full content once again (e.g. after the gate was turned on).

Slices are never deleted on shutdown: the node's GPUs must not vanish for the scheduler while
mpsd restarts or is upgraded. ``remove()`` (``mpsd dra remove-slices``) deletes them when DRA
is turned off or mpsd uninstalled; the kubelet also deletes a driver's slices 30 s after its
last plugin instance is gone (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, wipeResourceSlices),
and the garbage collector with their Node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..errors import KubeAPIError
from .slices import GpuLike, build_devices, build_slices, comparable, dropped_fields, node_owner

log = logging.getLogger(__name__)

DEFAULT_RESYNC_INTERVAL = 300.0  # a watch tells of changes at once; the resync only backs it up
OWN_VERSIONS = 64  # resourceVersions of mpsd's latest writes that a watch's echoes are matched with
GATE_ADVICE = {
    "DRAConsumableCapacity": "capacity mode needs it (beta and on by default from 1.36): set dra.mode: slices "
                             "on this cluster, or turn the gate on in kube-apiserver and kube-scheduler",
    "DRADeviceTaints": "unhealthy GPUs are not tainted (the kubelet's device health still shows them): turn the "
                       "gate on (GA in 1.37), or set dra.taintEffect: none",
    "unknown": "mpsd does not know why",
}

Obj = dict[str, Any]


class SliceAPI(Protocol):
    def list_resource_slices(self, driver: str, node: str) -> list[Obj]: ...
    def create_resource_slice(self, obj: Obj) -> Obj: ...
    def update_resource_slice(self, obj: Obj) -> Obj: ...
    def delete_resource_slice(self, name: str) -> None: ...


class SlicePublisher:
    def __init__(self, api: SliceAPI, driver_name: str, node_name: str, mode: str, slices_per_gpu: int,
                 resync_interval: float = DEFAULT_RESYNC_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 node_uid: str | None = None, metrics: Any = None) -> None:
        """``node_uid``: the Node's metadata.uid (KubeAPI.get_node_uid); with it the slices are
        owned by the Node, and the garbage collector deletes them when the node is deleted.
        ``metrics``: mpsd.registry.Metrics or None (slice writes, dropped fields)."""
        self.api, self.driver, self.node, self.node_uid = api, driver_name, node_name, node_uid
        self.mode, self.slices_per_gpu = mode, slices_per_gpu
        self.resync_interval, self._clock, self.metrics = resync_interval, clock, metrics
        self.generation = 0  # of the pool as last written or seen
        self.dropped: dict[str, list[str]] = {}  # gate -> fields the API server dropped from our slices
        self._published: list[Obj] | None = None  # comparable devices known to be on the server
        self._kept: tuple[list[Obj], list[Obj]] | None = None  # (wanted, what the server kept of it)
        self._checked = 0.0
        self._logged: set[str] = set()
        self.own_versions: deque[str] = deque(maxlen=OWN_VERSIONS)  # of our latest writes (a watch skips them)
        self._lock = threading.Lock()  # held while publishing: ``is_own`` waits for the write to end

    def publish(self, gpus: Sequence[GpuLike], driver_version: str = "",
                taints: Mapping[int, Sequence[Obj]] | None = None) -> bool:
        """Make the server's slices match ``gpus`` (with ``taints`` by GPU index); True if
        anything was written. ValueError for a bad mode or GPU, KubeAPIError when the API server fails."""
        with self._lock:
            return self._publish(gpus, driver_version, taints)

    def is_own(self, obj: Obj) -> bool:
        """A watched slice is the echo of one of mpsd's writes. Decided once a publish under way
        has ended: the API server may send the watch event before the write's own answer is read
        (seen on a real node), and only then is its resourceVersion known here."""
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        with self._lock:
            return bool(version) and version in self.own_versions

    def _publish(self, gpus: Sequence[GpuLike], driver_version: str,
                 taints: Mapping[int, Sequence[Obj]] | None) -> bool:
        devices = build_devices(gpus, self.mode, self.slices_per_gpu, driver_version, taints)
        want = _sorted(comparable(devices))
        if want == self._published and self._clock() - self._checked < self.resync_interval:
            return False
        self._published = None
        try:
            wrote = self._sync(devices, want)
        except KubeAPIError as e:
            if e.status != 409:
                raise
            log.info("resourceslice conflict, retrying from a fresh list node=%s error=%r", self.node, str(e))
            wrote = self._sync(devices, want)
        self._published, self._checked = want, self._clock()
        return wrote

    def _sync(self, devices: list[Obj], want: list[Obj]) -> bool:
        existing = sorted(self.api.list_resource_slices(self.driver, self.node), key=lambda s: s["metadata"]["name"])
        generations = [s["spec"]["pool"]["generation"] for s in existing]
        self.generation = max([self.generation, *generations])
        _keep_times(devices, existing)
        new = build_slices(devices, self.driver, self.node, self.generation + 1, self.node_uid)
        expected = self._kept[1] if self._kept is not None and self._kept[0] == want else want
        if self._current(existing, expected, len(new)):
            self._own(existing)  # a watch's first ADDED of them (written before mpsd started) is no news
            return False
        stored: list[Obj] = []
        pairs, surplus = _pair(new, existing)
        for obj, old in pairs:
            if old is None:
                stored.append(self._own([self.api.create_resource_slice(obj)])[0])
                continue
            kept = {k: v for k, v in old["metadata"].items() if k not in ("managedFields", "ownerReferences")}
            obj["metadata"] = {**kept, **{k: v for k, v in obj["metadata"].items() if k == "ownerReferences"}}
            stored.append(self._own([self.api.update_resource_slice(obj)])[0])
        for old in surplus:
            self._delete(old["metadata"]["name"])
        self.generation += 1
        if self.metrics is not None:
            self.metrics.slices_written(len(new))
        log.info("resourceslices published node=%s driver=%s mode=%s generation=%d devices=%d slices=%d",
                 self.node, self.driver, self.mode, self.generation, len(devices), len(new))
        self._check_dropped(devices, [d for s in stored for d in (s.get("spec") or {}).get("devices") or []], want)
        return True

    def _own(self, slices: list[Obj]) -> list[Obj]:
        """Remember the resourceVersions of ``slices`` (written or found current) as mpsd's own."""
        for s in slices:
            version = (s.get("metadata") or {}).get("resourceVersion")
            if version and str(version) not in self.own_versions:
                self.own_versions.append(str(version))
        return slices

    def _check_dropped(self, sent: list[Obj], stored: list[Obj], want: list[Obj]) -> None:
        """Compare what was written with what the server stored (see the module docstring)."""
        dropped = dropped_fields(sent, stored)
        self._kept = (want, _sorted(comparable(stored))) if dropped else None
        for gate, fields in dropped.items():
            if gate not in self._logged:
                self._logged.add(gate)
                log.error("the API server dropped %s from ResourceSlices of node %s: feature gate %s is off there; "
                          "%s (not written again until the GPUs change or mpsd restarts)",
                          ", ".join(fields), self.node, gate, GATE_ADVICE.get(gate, GATE_ADVICE["unknown"]))
        if dropped != self.dropped and self.metrics is not None:
            self.metrics.set_slice_fields_dropped(sorted(dropped))
        self.dropped = dropped

    def _current(self, existing: list[Obj], want: list[Obj], count: int) -> bool:
        """The server's slices are one complete pool generation holding exactly ``want``."""
        if len(existing) != count:
            return False
        pools = {(s["spec"]["pool"]["name"], s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
                 for s in existing}
        if pools != {(self.node, self.generation, count)}:
            return False
        owners = node_owner(self.node, self.node_uid) if self.node_uid else None
        if owners and any(s["metadata"].get("ownerReferences") != owners for s in existing):
            return False
        return _sorted(comparable([d for s in existing for d in s["spec"].get("devices") or []])) == want

    def invalidate(self) -> None:
        """Check the server at the next publish (a watch saw a change; the kubelet (re-)registered
        the plugin: at its start it deletes every slice of the node, so they may be gone)."""
        self._published = None

    def remove(self) -> int:
        """Delete the node's slices of the driver (DRA turned off, mpsd uninstalled); the number deleted."""
        with self._lock:
            return self._remove()

    def _remove(self) -> int:
        self._published = None
        names = [s["metadata"]["name"] for s in self.api.list_resource_slices(self.driver, self.node)]
        for name in names:
            self._delete(name)
        log.info("resourceslices removed node=%s driver=%s slices=%d", self.node, self.driver, len(names))
        return len(names)

    def _delete(self, name: str) -> None:
        try:
            self.api.delete_resource_slice(name)
        except KubeAPIError as e:
            if e.status != 404:  # already gone is what we wanted
                raise


def _pair(new: list[Obj], existing: list[Obj]) -> tuple[list[tuple[Obj, Obj | None]], list[Obj]]:
    """Each new slice with the existing slice it replaces (None: created), and the existing
    ones left over (deleted). A slice keeps its GPU (the same first device) where it can, so a
    rewrite never shows a device in two slices or in none; the rest are reused in name order."""
    def first(s: Obj) -> str | None:
        devices = s["spec"].get("devices") or []
        return devices[0].get("name") if devices else None

    free = {first(s): s for s in reversed(existing)}  # by first device; the first of duplicates wins
    chosen = [free.pop(first(s), None) if first(s) is not None else None for s in new]
    used = {id(s) for s in chosen if s is not None}
    rest = [s for s in existing if id(s) not in used]
    pairs = []
    for obj, old in zip(new, chosen, strict=True):
        if old is None and rest:
            old = rest.pop(0)
        pairs.append((obj, old))
    return pairs, rest


def _sorted(devices: list[Obj]) -> list[Obj]:
    return sorted(devices, key=lambda d: d["name"])


def _keep_times(devices: list[Obj], existing: list[Obj]) -> None:
    """Give each taint of ``devices`` the ``timeAdded`` of the same taint (key, value, effect)
    already on the server, so that a rewrite does not move when it was added (a NoExecute
    taint's tolerationSeconds count from it); a new taint keeps the time it was made with."""
    times = {(d.get("name"), t.get("key"), t.get("value"), t.get("effect")): t["timeAdded"]
             for s in existing for d in s["spec"].get("devices") or [] for t in d.get("taints") or []
             if t.get("timeAdded")}
    for device in devices:
        for taint in device.get("taints") or []:
            known = times.get((device["name"], taint.get("key"), taint.get("value"), taint.get("effect")))
            if known:
                taint["timeAdded"] = known
