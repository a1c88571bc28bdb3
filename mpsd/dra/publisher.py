"""Keeps the node's ResourceSlices on the API server equal to its GPUs (mpsd/dra/slices.py).

``publish(gpus)`` lists the node's slices of the driver and writes only when the devices
differ from what is there (quantities compared by value): every slice of the pool is then
rewritten with the next pool generation (one more than the highest seen, so consumers never
mix two versions of the pool), existing slices are updated in place, missing ones created,
surplus ones deleted last. A conflict (409: someone changed a slice between the list and the
write) is retried once from a fresh list. A failure raises KubeAPIError and caches nothing:
the next publish starts over and converges, whatever was half-written. While the devices
are unchanged, publish makes no API call at all for ``resync_interval`` seconds, then checks
again (a slice deleted behind mpsd's back is written again: the kubelet deletes a driver's slices
30 s after its plugin goes away, and all of the node's when it starts; ``invalidate()`` on a
registration checks at once).
``remove()`` deletes the node's slices on shutdown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import KubeAPIError
from .slices import GpuLike, build_devices, build_slices, comparable, node_owner

log = logging.getLogger(__name__)

DEFAULT_RESYNC_INTERVAL = 60.0  # the kubelet may wipe an unregistered driver's slices: back within a minute

Obj = dict[str, Any]


class SliceAPI(Protocol):
    def list_resource_slices(self, driver: str, node: str) -> list[Obj]: ...
    def create_resource_slice(self, obj: Obj) -> Obj: ...
    def update_resource_slice(self, obj: Obj) -> Obj: ...
    def delete_resource_slice(self, name: str) -> None: ...


class SlicePublisher:
    def __init__(self, api: SliceAPI, driver_name: str, node_name: str, mode: str, slices_per_gpu: int,
                 resync_interval: float = DEFAULT_RESYNC_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 node_uid: str | None = None) -> None:
        """``node_uid``: the Node's metadata.uid (KubeAPI.get_node_uid); with it the slices are
        owned by the Node, and the garbage collector deletes them when the node is deleted."""
        self.api, self.driver, self.node, self.node_uid = api, driver_name, node_name, node_uid
        self.mode, self.slices_per_gpu = mode, slices_per_gpu
        self.resync_interval, self._clock = resync_interval, clock
        self.generation = 0  # of the pool as last written or seen
        self._published: list[Obj] | None = None  # comparable devices known to be on the server
        self._checked = 0.0

    def publish(self, gpus: Sequence[GpuLike], driver_version: str = "") -> bool:
        """Make the server's slices match ``gpus``; True if anything was written.
        ValueError for a bad mode or GPU, KubeAPIError when the API server fails."""
        devices = build_devices(gpus, self.mode, self.slices_per_gpu, driver_version)
        want = sorted(comparable(devices), key=lambda d: d["name"])
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
        new = build_slices(devices, self.driver, self.node, self.generation + 1, self.node_uid)
        if self._current(existing, want, len(new)):
            return False
        for obj, old in zip(new, existing, strict=False):  # the shorter: updated in place
            kept = {k: v for k, v in old["metadata"].items() if k not in ("managedFields", "ownerReferences")}
            obj["metadata"] = {**kept, **{k: v for k, v in obj["metadata"].items() if k == "ownerReferences"}}
            self.api.update_resource_slice(obj)
        for obj in new[len(existing):]:
            self.api.create_resource_slice(obj)
        for old in existing[len(new):]:
            self._delete(old["metadata"]["name"])
        self.generation += 1
        log.info("resourceslices published node=%s driver=%s mode=%s generation=%d devices=%d slices=%d",
                 self.node, self.driver, self.mode, self.generation, len(devices), len(new))
        return True

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
        have = [d for s in existing for d in comparable(s["spec"].get("devices") or [])]
        return sorted(have, key=lambda d: d["name"]) == want

    def invalidate(self) -> None:
        """Check the server at the next publish (the kubelet (re-)registered the plugin: at its
        start it deletes every slice of the node, so they may be gone)."""
        self._published = None

    def remove(self) -> int:
        """Delete the node's slices of the driver (shutdown); the number deleted."""
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
