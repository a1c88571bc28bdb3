"""Prepare and Unprepare: the one place that changes the prepared claims of this node.

Each claim has one record in the device plugin's journaled store (mpsd.alloc.state.StateStore,
its own file ``dra-state.json`` in stateDir), one allocation directory in regionDir (fresh, mode
0777, shared by all containers of the claim: one region, one cap) and one CDI spec in cdiDir.
The steps of a Prepare:

1. the directory (mpsd.alloc.allocdir.fresh_dir, as Allocate makes its own:
   ``claim-<uid>-<random>``);
2. the CDI spec (temporary file, fsync, rename);
3. the record, one journal line fdatasync'd; only then the answer.

The record is the truth. A crash before it leaves a directory and maybe a spec that no record
names: the next start removes them (the kubelet asks again and gets a fresh preparation). A
recorded claim is kept, and its directory or spec re-created if missing or changed (a reboot
empties /var/run/cdi and a tmpfs regionDir), so neither needs a directory fsync of its own. Prepare of a prepared claim
answers the same CDI device again (the kubelet retries); Unprepare removes spec, directory,
then record, and a claim it does not know is already unprepared.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

from ..errors import DraError, MpsdError, one_line
from ..alloc.container import HostPaths
from ..alloc.shimfile import LEGACY_SHIM_NAME, SHIM_NAME, shim_name
from ..alloc.allocdir import fresh_dir, restore_region_dir
from ..alloc.slicing import GpuLike, GpuShare, Plan
from ..alloc.state import StateStore
from ..sharing import Backend, SliceRequest
from ..sharing.v2 import V2Backend
from ..inventory.mig import MigDevice
from ..trees import remove_tree
from . import cdi, migdevices
from .claims import ClaimPlan, ClaimRef, Result, plan_claim
from .nvidiacdi import NvidiaSpecs, SpecView, brought_nodes

log = logging.getLogger(__name__)

PREPARED = "prepared"  # the only phase written; a record of another is rolled back at start
GetClaim = Callable[[str, str], Any]  # (namespace, name) -> the ResourceClaim as a dict


def claim_key(uid: str) -> str:
    return f"claim-{uid}"


@dataclass(frozen=True)
class RequestShare:
    """One request of a prepared claim: its GPUs (ordinals as its containers see them), its
    thread percentage; its CDI device is ``<uid>_<name>``, its region file ``region-<name>``."""

    name: str
    gpus: tuple[GpuShare, ...]
    active_thread_percentage: float


def _shares(items) -> tuple[GpuShare, ...]:
    return tuple(GpuShare(int(g["ordinal"]), int(g["index"]), str(g["uuid"]), tuple(int(k) for k in g["slices"]),
                          int(g["memory_limit"])) for g in items)


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    results: tuple[Result, ...]
    gpus: tuple[GpuShare, ...]
    active_thread_percentage: float
    client_priority: int | None
    region_dir: str
    spec_name: str
    phase: str
    created: float
    pods: tuple[str, ...] = ()
    pod_uids: tuple[str, ...] = ()
    memory_limit: int | None = None  # ClaimConfig memoryLimit: hard bytes per GPU (burst)
    requests: tuple[RequestShare, ...] = ()  # empty: prepared with one CDI device for the whole claim
    shim: str = LEGACY_SHIM_NAME  # the shim file its containers preload; a record without one: before layouts

    @property
    def allocation_id(self) -> str:
        """The store's key and its directory's prefix (``claim-<uid>-<random>``), as an
        allocation's ID is for the device plugin."""
        return claim_key(self.uid)

    @property
    def ref(self) -> ClaimRef:
        return ClaimRef(self.namespace, self.name, self.uid)

    @property
    def plan(self) -> Plan:
        return Plan(tuple(sorted(f"{r.pool}/{r.device}" for r in self.results)), self.gpus,
                    self.active_thread_percentage)

    @property
    def memory_limits(self) -> dict[int, int]:
        return self.plan.memory_limits

    def request_plans(self) -> list[tuple[str | None, Plan]]:
        """(request, what its containers get) per CDI device; (None, the claim's plan) for a claim
        prepared with one device."""
        if not self.requests:
            return [(None, self.plan)]
        return [(q.name, Plan(tuple(sorted(f"{r.pool}/{r.device}" for r in self.results if r.request == q.name)),
                              q.gpus, q.active_thread_percentage)) for q in self.requests]

    def to_json(self) -> dict:
        data = asdict(self)
        data["results"] = [asdict(r) for r in self.results]
        data["gpus"] = [asdict(g) for g in self.gpus]
        data["pods"] = list(self.pods)
        data["pod_uids"] = list(self.pod_uids)
        data["requests"] = [{**asdict(q), "gpus": [asdict(g) for g in q.gpus]} for q in self.requests]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "PreparedClaim":
        return cls(
            uid=cdi.check_uid(str(data["uid"])),
            namespace=str(data["namespace"]),
            name=str(data["name"]),
            results=tuple(Result(str(r["request"]), str(r["pool"]), str(r["device"]), str(r.get("share_id") or ""))
                          for r in data["results"]),
            gpus=_shares(data["gpus"]),
            active_thread_percentage=float(data["active_thread_percentage"]),
            client_priority=None if data.get("client_priority") is None else int(data["client_priority"]),
            region_dir=str(data["region_dir"]),
            spec_name=str(data["spec_name"]),
            phase=str(data["phase"]),
            created=float(data["created"]),
            pods=tuple(str(p) for p in data.get("pods", ())),
            pod_uids=tuple(str(p) for p in data.get("pod_uids", ())),
            memory_limit=None if data.get("memory_limit") is None else int(data["memory_limit"]),
            requests=tuple(RequestShare(str(q["name"]), _shares(q["gpus"]), float(q["active_thread_percentage"]))
                           for q in data.get("requests", ())),
            shim=shim_name(data.get("shim")),
        )


class Preparer:
    def __init__(
        self,
        *,
        driver: str,
        node: str,
        pool: str,
        gpus: Sequence[GpuLike],
        slices_per_gpu: int,
        paths: HostPaths,
        cdi_dir: cdi.CdiDir,
        store: StateStore,
        get_claim: GetClaim,
        dev_dir: str = "/dev",
        backend: Backend | None = None,
        nvidia: NvidiaSpecs | None = None,
        dev_root: str = "/",
    ) -> None:
        """``nvidia``: NVIDIA's CDI specs on the node, whose device IDs are answered beside mpsd's;
        ``dev_dir``: where mpsd sees the driver's device nodes; ``dev_root``: the host directory
        whose ``dev/`` holds them (cdi.device_nodes)."""
        self.driver, self.node, self.pool = driver, node, pool
        self.backend = backend or V2Backend(paths)  # what a claim becomes on this node (mpsd/sharing)
        self.gpus: Sequence[GpuLike] = list(gpus)  # replaced whole when NVML lists other GPUs
        self.slices_per_gpu = slices_per_gpu
        self.paths = paths
        self.cdi = cdi_dir
        self.store = store
        self.get_claim = get_claim
        self.dev_dir = dev_dir
        self.dev_root = dev_root
        self.nvidia = nvidia
        self.lock = threading.Lock()  # one claim changes at a time; the API server is asked outside it
        self.step: Callable[[str], None] = lambda name: None  # fault injection in tests: called at each step

    # -- start ------------------------------------------------------------------------------

    def recover(self) -> None:
        """Converge after a restart: re-create what a prepared claim lost, and remove specs and claim
        directories of ours that no record names (a crash before the record was written)."""
        with self.lock:
            self.backend.adopt([q for rec in self.prepared() for q in self.slices(rec)])  # before the specs
            for rec in self.store.all():
                if rec.phase != PREPARED:
                    log.warning("claim record of phase %r rolled back claim=%s uid=%s", rec.phase, rec.ref, rec.uid)
                    self._remove(rec)
                    continue
                try:
                    self._ensure(rec)
                except DraError as exc:  # answered again at the kubelet's next Prepare
                    log.error("prepared claim not restored claim=%s error=%s", rec.ref, exc)
            named = {rec.spec_name for rec in self.store.all()}
            for name in self.cdi.ours():
                if name not in named:
                    log.warning("CDI spec of no prepared claim removed path=%s", os.path.join(self.cdi.path, name))
                    self.cdi.remove(name)
            dirs = {os.path.basename(rec.region_dir) for rec in self.store.all()}
            for name in _claim_dirs(self.paths.region_dir):
                if name not in dirs:
                    log.warning("claim directory of no prepared claim removed name=%s", name)
                    try:
                        self._remove_dir(os.path.join(self.paths.region_dir, name))
                    except DraError as exc:  # tried again at the next start
                        log.error("%s", exc)

    # -- the kubelet's calls ----------------------------------------------------------------

    def prepare(self, ref: ClaimRef) -> PreparedClaim:
        """One claim; DraError with its one line."""
        outcome = self.prepare_many([ref])[ref.uid]
        if isinstance(outcome, str):
            raise DraError(outcome)
        return outcome

    def prepare_many(self, refs: Sequence[ClaimRef], map_fn: Callable = map) -> dict[str, PreparedClaim | str]:
        """The claims of one NodePrepareResources: each prepared, or its one-line error. The claims
        are read from the API server through ``map_fn`` (a thread pool's map reads them at once),
        then written under the lock, and all their records go in one journal line."""
        outcomes: dict[str, PreparedClaim | str] = {}
        todo: list[ClaimRef] = []
        refs = list({ref.uid: ref for ref in refs}.values())  # one claim named twice is prepared once
        with self.lock:
            for ref in refs:
                try:
                    cdi.check_uid(ref.uid)
                    done = self.store.get(claim_key(ref.uid))
                    if done is not None and done.phase == PREPARED:
                        self._ensure(done)
                        log.info("claim already prepared claim=%s uid=%s", ref, ref.uid)
                        outcomes[ref.uid] = done
                    else:
                        todo.append(ref)
                except MpsdError as exc:
                    outcomes[ref.uid] = one_line(exc)
        planned = list(map_fn(self._plan, todo))
        with self.lock:
            made = []
            for ref, plan in zip(todo, planned, strict=True):
                if isinstance(plan, str):
                    outcomes[ref.uid] = plan
                    continue
                try:
                    rec, new = self._make(ref, plan)
                except MpsdError as exc:
                    outcomes[ref.uid] = one_line(exc)
                    continue
                if new:
                    made.append(rec)
                outcomes[ref.uid] = rec
            outcomes.update(self._record(made))
        return outcomes

    def _plan(self, ref: ClaimRef) -> ClaimPlan | str:
        """The claim from the API server, checked and turned into limits; or why not, in one line."""
        try:
            claim = self.get_claim(ref.namespace, ref.name)
        except MpsdError as exc:
            return f"claim {ref}: {one_line(exc)}"
        except Exception as exc:  # noqa: BLE001 - a client library's own error: one line, the kubelet retries
            return f"claim {ref}: API server: {type(exc).__name__}: {one_line(exc)[:300]}"
        try:
            return plan_claim(claim, ref, driver=self.driver, node=self.node, pool=self.pool, gpus=self.gpus,
                              slices_per_gpu=self.slices_per_gpu)
        except MpsdError as exc:
            return one_line(exc)

    def _make(self, ref: ClaimRef, planned: ClaimPlan) -> tuple[PreparedClaim, bool]:
        """Directory and spec of a claim (under the lock), and whether they are new; the record
        is written by _record."""
        done = self.store.get(claim_key(ref.uid))
        if done is not None and done.phase == PREPARED:  # prepared meanwhile by a concurrent call
            return done, False
        if done is not None:
            self._remove(done)  # a record of another phase: rolled back first
        self.cdi.check()  # refused before anything is written
        rec = PreparedClaim(
            uid=ref.uid, namespace=ref.namespace, name=ref.name, results=planned.results,
            gpus=planned.plan.gpus, active_thread_percentage=planned.plan.active_thread_percentage,
            client_priority=planned.client_priority, region_dir="", spec_name=cdi.spec_file_name(ref.uid),
            phase=PREPARED, created=time.time(), pods=planned.pods, pod_uids=planned.pod_uids,
            memory_limit=planned.memory_limit, shim=SHIM_NAME,
            requests=tuple(RequestShare(q.name, q.plan.gpus, q.plan.active_thread_percentage)
                           for q in planned.requests),
        )
        try:
            directory = fresh_dir(self.paths.region_dir, rec.allocation_id)
        except MpsdError as exc:
            raise DraError(f"claim {rec.ref}: {one_line(exc)}") from exc
        self.step("directory")
        rec = replace(rec, region_dir=directory)
        try:
            for req in self.slices(rec):
                self.backend.grant(req)
            self._write_spec(rec)
        except MpsdError as exc:
            self._rollback(rec)
            raise DraError(f"claim {rec.ref}: {one_line(exc)}") from exc
        self.step("spec")
        return rec, True

    def _record(self, made: list[PreparedClaim]) -> dict[str, PreparedClaim | str]:
        """One journal line for all claims made; on failure all of them rolled back."""
        if not made:
            return {}
        try:
            self.store.put_many(made)
        except MpsdError as exc:
            for rec in made:
                self._rollback(rec)
            return {rec.uid: f"claim {rec.ref}: {one_line(exc)}" for rec in made}
        self.step("prepared")
        for rec in made:
            log.info(
                "claim prepared claim=%s uid=%s devices=%s memory_limits=%s thread_percentage=%s region=%s",
                rec.ref, rec.uid, ",".join(f"{r.pool}/{r.device}" for r in rec.results), rec.memory_limits,
                rec.active_thread_percentage, os.path.basename(rec.region_dir),
            )
        return {rec.uid: rec for rec in made}

    def unprepare(self, ref: ClaimRef) -> None:
        """One claim; DraError with its one line."""
        outcome = self.unprepare_many([ref])[ref.uid]
        if outcome:
            raise DraError(outcome)

    def unprepare_many(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """The claims of one NodeUnprepareResources: "" when gone (or never here), else why not.
        Specs and directories first, then one journal line for the records of those removed."""
        outcomes: dict[str, str] = {}
        gone = []
        with self.lock:
            for ref in refs:
                outcomes[ref.uid] = ""
                try:
                    cdi.check_uid(ref.uid)
                    rec = self.store.get(claim_key(ref.uid))
                    if rec is None:
                        log.info("claim not prepared here, nothing to undo claim=%s uid=%s", ref, ref.uid)
                        continue
                    self._remove_files(rec)
                    gone.append(rec)
                except MpsdError as exc:
                    outcomes[ref.uid] = one_line(exc)
            try:
                self.store.remove([rec.allocation_id for rec in gone])
            except MpsdError as exc:  # the records stay: the kubelet's retry removes them
                outcomes.update({rec.uid: f"claim {rec.ref}: {one_line(exc)}" for rec in gone})
                return outcomes
        for rec in gone:
            log.info("claim unprepared claim=%s uid=%s", rec.ref, rec.uid)
        return outcomes

    def nvidia_ids(self, rec: PreparedClaim, view: SpecView | None = None) -> dict[int, str]:
        """GPU index -> NVIDIA's CDI device ID for the claim's GPUs that NVIDIA's specs name."""
        return self.nvidia.ids(((g.uuid, g.index) for g in rec.gpus), view) if self.nvidia is not None else {}

    def prepared(self) -> list[PreparedClaim]:
        return [r for r in self.store.all() if r.phase == PREPARED]

    # -- steps ------------------------------------------------------------------------------

    def _rollback(self, rec: PreparedClaim) -> None:
        try:
            self._remove(rec)
        except (MpsdError, OSError) as exc:  # no record names them: removed at the next start
            log.error("rollback incomplete claim=%s error=%s", rec.ref, one_line(exc))

    def _remove(self, rec: PreparedClaim) -> None:
        """Spec, directory, then record: a crash in between leaves a record to finish it with."""
        self._remove_files(rec)
        self.store.remove([rec.allocation_id])

    def _remove_files(self, rec: PreparedClaim) -> None:
        self.cdi.remove(rec.spec_name)
        self.step("spec removed")
        if rec.region_dir:
            self._remove_dir(rec.region_dir)
        self.step("directory removed")
        for req in self.slices(rec):
            self.backend.release(req.key)

    def _ensure(self, rec: PreparedClaim) -> None:
        """A prepared claim's directory and spec exist and the spec is what the record says; DraError
        when a MIG instance it was prepared onto is gone: GPU and compute instance IDs, and so device
        names, are taken again by new instances, whose UUID is new (NVML), so the UUID decides."""
        served = {g.uuid for g in self.gpus if isinstance(g, MigDevice)}
        gone = sorted({s.uuid for s in rec.plan.gpus if s.uuid.startswith("MIG-") and s.uuid not in served})
        if gone:
            raise DraError(f"claim {rec.ref}: MIG instance {', '.join(gone)} it was prepared onto is gone (the MIG "
                           "layout changed; a device of the same name now is another instance): delete the pod")
        if not restore_region_dir(rec, self.paths.region_dir):  # as the device plugin's start does
            raise DraError(f"claim {rec.ref}: region directory {rec.region_dir} cannot be restored")
        if self.cdi.read(rec.spec_name) != self._spec(rec):
            log.warning("CDI spec of a prepared claim missing or changed, written again claim=%s", rec.ref)
            self._write_spec(rec)

    def requests(self, rec: PreparedClaim) -> list[tuple[str | None, SliceRequest]]:
        """What the claim asks of the node's sharing backend: a slice per request of the claim
        (key ``<allocation id>/<request>``; one keyed by the allocation ID for a claim prepared
        with one device), each with its own GPUs and limits."""
        out = []
        for name, plan in rec.request_plans():
            hard = {} if rec.memory_limit is None else {g.ordinal: rec.memory_limit for g in plan.gpus}
            key = rec.allocation_id if name is None else f"{rec.allocation_id}/{name}"
            out.append((name, SliceRequest(key, plan, rec.region_dir, client_priority=rec.client_priority,
                                           pod_uids=rec.pod_uids, memory_hard=hard, shim=rec.shim)))
        return out

    def slices(self, rec: PreparedClaim) -> list[SliceRequest]:
        return [req for _, req in self.requests(rec)]

    def _spec(self, rec: PreparedClaim) -> dict:
        """A CDI device per request (one for the whole claim in a record written before that), each
        what the node's sharing backend gives that request's slice, and the device nodes that
        NVIDIA's devices answered beside it (kubeletplugin) do not bring."""
        view = self.nvidia.view() if self.nvidia is not None else SpecView()
        ids = self.nvidia_ids(rec, view)
        return cdi.spec([
            cdi.device(cdi.device_name(rec.uid, name), req.plan, self.paths, rec.region_dir,
                       client_priority=rec.client_priority, region=cdi.region_file(name),
                       nodes=self._nodes(req.plan.gpus, view, brought_nodes(rec.results, name, ids, view)),
                       grant=self.backend.edits(req))
            for name, req in self.requests(rec)
        ])

    def _nodes(self, shares: Sequence[GpuShare], view: SpecView, brought: frozenset[str]) -> list[dict]:
        """The device nodes of these GPUs (by NVML's minor numbers) and, for MIG instances, their
        /dev/nvidia-caps nodes, less those ``brought`` by NVIDIA's devices, at their host paths."""
        names = cdi.node_names(self._minors(shares)) + migdevices.caps_nodes(self.gpus, [g.uuid for g in shares])
        return cdi.device_nodes(names, self.dev_dir, brought=brought, hosts=view.hosts, dev_root=self.dev_root)

    def _minors(self, shares: Sequence[GpuShare]) -> list[int]:
        """The minor numbers NVML gives these GPUs (by UUID); a GPU it gives none (or no longer
        lists) gets no /dev/nvidia<N> node from mpsd: a node named by a guess could be another
        GPU's. A MIG instance is reached through its parent GPU's node."""
        minors = {g.uuid: getattr(g, "minor_number", None) for g in self.gpus}
        for g in self.gpus:  # an instance: its parent's node (the parent is not always listed)
            if isinstance(g, MigDevice):
                minors[g.uuid] = minors.get(g.parent_uuid, g.parent_minor)
        return sorted({m for m in (minors.get(s.uuid) for s in shares) if m is not None})

    def _write_spec(self, rec: PreparedClaim) -> None:
        self.cdi.write(rec.spec_name, self._spec(rec))

    def _remove_dir(self, directory: str) -> None:
        """Remove a claim's directory (a pod's tree: any shape, symlinks never followed); DraError
        when something is left, so that the record stays and the kubelet's retry goes on."""
        if os.path.dirname(os.path.abspath(directory)) != os.path.abspath(self.paths.region_dir):
            log.warning("region directory outside regionDir left alone path=%s", directory)
            return
        removal = remove_tree(directory)
        if not removal.complete:
            raise DraError(f"region directory {directory} not fully removed: {removal.error}")


_CLAIM_DIR = re.compile(r"claim-[A-Za-z0-9_.-]{1,128}-[0-9a-f]{12}")


def _claim_dirs(region_dir: str) -> list[str]:
    """Directories in regionDir named as Prepare names them (``claim-<uid>-<random>``)."""
    try:
        return sorted(n for n in os.listdir(region_dir) if _CLAIM_DIR.fullmatch(n))
    except OSError:
        return []
