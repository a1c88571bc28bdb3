"""The MPS v3 backend (driver R615+): one server per GPU, one namespace per slice.

A slice's namespace carries its memory (``pinned_memory_limit``: the hard limit), compute
(``active_thread_percentage``) and priority; the client reaches it through its socket
(``CUDA_MPS_PIPE_DIRECTORY=<pipe>/<server>/<ns>``, NVIDIA's "MPS v3 Namespaces": routed by the
socket it connects to). The pipe directory is mounted read-only as for v2: a namespace's own
directory would be a new inode after each daemon restart, which a running container's bind
mount would never see again.

The backend keeps the live slices in memory (``wanted``): the faces give them (grant, adopt
from their journals at start) and take them back (release). The daemon is made to hold them
three ways: the TOML it starts with lists them (mpsd/sharing/toml3.py), grant and adopt create
them at once when the daemon runs, and every health round reads them back and puts back what
is missing or changed (``reconcile``, called by mpsd/lifecycle/v3.py): CLI changes are not
saved by the daemon, so a restart, an operator or a pod with root's control socket would
otherwise lose or change them. How a namespace is made, read back and removed is
mpsd/sharing/namespaces3.py; which ones mpsd made (the only ones it deletes), owned3.py.

A grant returns only once its namespace exists with its limits read back; with no daemon, or
any step refused, it fails in one line and the kubelet retries (a container pointed at a socket
that does not exist, or at a namespace without limits, would run without MPS's limits).

A client reaches one server: a slice spans one GPU here (a claim or container with several
GPUs is refused in one line). Memory above the namespace's limit is the driver's to refuse
(mpsd/sharing/memory.py where it partitions memory by cgroup), the shim's where it cannot.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable, Sequence

from ..daemon.control3 import Control3, Limits3, Server3
from ..errors import BackendError, ControlError, DaemonNotRunning
from ..alloc.container import CONTAINER_REGION, CONTAINER_REGION_DIR, CONTAINER_SHIM_DIR, DEV_NULL, LOG_FIFO, HostPaths
from ..alloc.shimfile import container_shim
from ..daemon import dirs
from ..alloc.slicing import GpuLike, GpuShare
from ..units import format_limits, format_size_mps_control
from . import Grant, SliceRequest
from ..alloc.container import Mount
from .memory import CgroupLimits, cgroup_of, find_pod_cgroup
from .namespaces3 import Round, make, reconcile, remove
from .owned3 import Owned
from .toml3 import ServerSpec, limits, namespace_dir, namespace_name, render, server_name, socket_problem

log = logging.getLogger(__name__)

NAME = "mps-v3"


class V3Backend:
    name = NAME

    def __init__(
        self,
        *,
        paths: HostPaths,
        control: Callable[[], Control3],
        gpus: Callable[[], Sequence[GpuLike]],
        defaults: Limits3 | None = None,
        uid: int | None = None,
        shim: str = "auto",
        memory: CgroupLimits | None = None,
        memory_problem: str = "memory partitioning not checked",
        owned: Owned | None = None,
    ) -> None:
        self.paths = paths
        self.control = control  # a front-end bounded by healthTimeout
        self.gpus = gpus  # the managed GPUs (NVML), for the servers of the TOML
        self.defaults = defaults or Limits3()  # each server's own limits (its default namespace)
        self.uid = uid  # None: a multi-user daemon (-m)
        self.shim_mode = shim  # mps.shim: auto | on | off
        self.memory = memory  # the driver's limits per cgroup; None where it has none
        self.memory_problem = "" if memory is not None else memory_problem  # why not, for refusals and status
        self.owned = owned or Owned(None)  # the namespaces mpsd made (journal in stateDir)
        self._lock = threading.Lock()
        self._ns_lock = threading.Lock()  # one namespace change at a time: grant, release, a round
        self._live: dict[str, SliceRequest] = {}
        self._leftover: dict[str, SliceRequest] = {}  # released, but the delete was refused: tried again
        self._enforced: set[str] = set()  # slices whose one pod's cgroup the driver limits since grant
        self._found: dict[str, set[str]] = {}  # device-plugin slices: cgroups found through their clients

    # -- what a slice is -------------------------------------------------------------------

    @staticmethod
    def share(request: SliceRequest) -> GpuShare:
        """The slice's one device (the first, for a request a v3 node never granted)."""
        return request.plan.gpus[0]

    def place(self, request: SliceRequest) -> tuple[str, str]:
        """(server, namespace) of a slice."""
        return server_name(self.share(request).index), namespace_name(request.key)

    def namespace_limits(self, request: SliceRequest) -> Limits3:
        share = self.share(request)
        return limits(request.hard_limit(share.ordinal), request.plan.active_thread_percentage, request.client_priority)

    def edits(self, request: SliceRequest) -> Grant:
        server, ns = self.place(request)
        share = self.share(request)
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": namespace_dir(self.paths.pipe_dir, server, ns),
            # the namespace carries the limits for MPS; the variable is the shim's (one GPU: ordinal 0)
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": format_limits({0: request.hard_limit(share.ordinal)}),
            "NVIDIA_VISIBLE_DEVICES": share.uuid,
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        }
        mounts = [Mount(self.paths.pipe_dir, self.paths.pipe_dir, True),  # read-only: see mpsd/alloc/container.py
                  # /dev/null over `log`, as under v2: writes into a FIFO pass a read-only mount
                  Mount(DEV_NULL, os.path.join(self.paths.pipe_dir, LOG_FIFO), True)]
        if self.shim(request):
            env["LD_PRELOAD"] = container_shim(request.shim)
            env["MPSSHIM_REGION"] = CONTAINER_REGION
            mounts += [Mount(request.region_dir, CONTAINER_REGION_DIR, False),
                       Mount(self.paths.shim_host_dir, CONTAINER_SHIM_DIR, True)]
        if self.paths.ipc_mode == "tmpfs":
            mounts.append(Mount(self.paths.shm_dir, "/dev/shm", False))
        return Grant(env, tuple(mounts))

    def burst_problem(self) -> str:
        """"" where a hard limit above the guarantee can be enforced (the driver's soft limit)."""
        return self.memory_problem

    def shim(self, request: SliceRequest) -> bool:
        """Whether a slice keeps the shim: ``auto`` drops it only where the driver limits the
        memory of the slice's one pod (its cgroup set at grant), as the shim would."""
        if self.shim_mode != "auto":
            return self.shim_mode == "on"
        return request.key not in self._enforced

    def enforcement(self, request: SliceRequest) -> str:
        if request.key in self._enforced:
            driver = "the driver per pod cgroup (soft = guarantee, hard = limit)"
        elif self.memory is not None:
            driver = "the driver per container cgroup once a client connects"
        else:
            driver = f"not the driver ({self.memory_problem})"
        shim = "; the shim per container" if self.shim(request) else ""
        return f"memory: namespace limit (MPS v3), {driver}{shim}; compute and priority: the namespace"

    # -- the faces' calls --------------------------------------------------------------------

    def check(self, request: SliceRequest) -> None:
        """BackendError (one line) for a slice this backend cannot give."""
        if len(request.plan.gpus) != 1:
            uuids = ",".join(g.uuid for g in request.plan.gpus)
            raise BackendError(f"{request.key}: spans GPUs {uuids}: under MPS v3 a client reaches one server and "
                               "mpsd runs one per GPU; expected one GPU per container or claim")
        server, ns = self.place(request)
        problem = socket_problem(self.paths.pipe_dir, server, ns)
        if problem:
            raise BackendError(f"{request.key}: {problem}")
        share = self.share(request)
        hard = request.memory_hard.get(share.ordinal)
        if hard is None:
            return
        total = next((g.memory_total for g in self.gpus() if g.uuid == share.uuid), None)
        shown = f"{request.key}: memory limit {format_size_mps_control(hard)}"
        if hard < share.memory_limit:
            raise BackendError(f"{shown} is below the guarantee {format_size_mps_control(share.memory_limit)}: "
                               "expected at least the memory consumed")
        if total is not None and hard > total:
            raise BackendError(f"{shown} is above GPU {share.index}'s {format_size_mps_control(total)}")
        if hard > share.memory_limit and self.memory is None:
            raise BackendError(f"{shown} above the guarantee cannot be enforced on this node: {self.memory_problem}")

    def grant(self, request: SliceRequest) -> Grant:
        """The slice's namespace made and read back (mpsd/sharing/namespaces3.py), then the
        driver's limits on its pods; BackendError in one line otherwise, nothing left behind."""
        self.check(request)
        server, ns = self.place(request)
        with self._ns_lock:
            with self._lock:
                self._live[request.key] = request  # from now on a health round keeps it
            try:
                for note in make(self.control(), server, ns, self.namespace_limits(request), self.owned):
                    log.warning("key=%s %s", request.key, note)
            except ControlError as exc:
                with self._lock:
                    self._live.pop(request.key, None)
                raise BackendError(f"{request.key}: namespace {server}/{ns} not ready: {exc}") from exc
        log.info("namespace ready key=%s server=%s namespace=%s limits=%s", request.key, server, ns,
                 self.namespace_limits(request))
        try:
            self._limit_pods(request)
        except BackendError:
            self.release(request.key)  # the driver refused the limits: nothing of the slice stays
            raise
        dirs.keep_log_target(self.paths.pipe_dir)  # the mount over `log` needs its target
        return self.edits(request)

    def _limit_pods(self, request: SliceRequest) -> None:
        """The driver's limits on the pods' cgroups, where the request names its pods (DRA)."""
        if self.memory is None or not request.pod_uids:
            return
        cgroups = [c for c in (find_pod_cgroup(self.memory.root, uid) for uid in request.pod_uids) if c]
        for note in self.memory.apply(request.key, self.targets(request, cgroups)):
            log.info("memory limits key=%s %s", request.key, note)
        if len(cgroups) == len(request.pod_uids) == 1:
            self._enforced.add(request.key)
        else:
            self._enforced.discard(request.key)
            log.warning("memory of key=%s not limited per pod by the driver at grant: %d pod(s), %d cgroup(s) found "
                        "under %s (the shim stays)", request.key, len(request.pod_uids), len(cgroups), self.memory.root)

    def targets(self, request: SliceRequest, cgroups: Iterable[str]) -> list[tuple[str, int, int, int]]:
        """(cgroup, GPU index, soft = the guarantee, hard = the limit) for each cgroup."""
        share = self.share(request)
        return [(c, share.index, share.memory_limit, request.hard_limit(share.ordinal)) for c in sorted(set(cgroups))]

    def memory_round(self) -> list[str]:
        """One round of the driver's limits (its own thread: NVML may block): the device-plugin
        slices' cgroups found through their namespaces' clients, every limit read back and
        restored; notes of what changed."""
        if self.memory is None:
            return []
        with self._lock:
            live = list(self._live.values())
        try:
            clients = self.control().client_list()
        except ControlError as exc:
            log.info("memory round without the client list error=%s", exc)
            clients = []
        pids: dict[tuple[str, str], list[int]] = {}
        for c in clients:
            pids.setdefault((c.server, c.namespace), []).append(c.pid)
        notes = []
        for request in live:
            if request.pod_uids:
                cgroups = {c for c in (find_pod_cgroup(self.memory.root, u) for u in request.pod_uids) if c}
            else:
                found = {cgroup_of(pid, self.memory.root) for pid in pids.get(self.place(request), [])} - {None}
                kept = {c for c in self._found.get(request.key, set()) if os.path.isdir(c)}
                cgroups = self._found[request.key] = kept | found  # type: ignore[operator]
            try:
                notes += [f"{request.key}: {n}" for n in self.memory.apply(request.key, self.targets(request, cgroups))]
            except BackendError as exc:
                notes.append(str(exc))
        for note in notes:
            level = logging.ERROR if "restored" in note or "refused" in note else logging.INFO
            log.log(level, "memory limits: %s", note)
        return notes

    def release(self, key: str) -> None:
        """The slice's namespace gone, its clients ended first (they are the released slice's);
        BackendError naming the namespace when the daemon refuses (tried again at the next call)."""
        with self._lock:
            request = self._live.pop(key, None) or self._leftover.pop(key, None)
        self._enforced.discard(key)
        self._found.pop(key, None)
        if self.memory is not None:
            self.memory.release(key)
        if request is None:
            return
        server, ns = self.place(request)
        try:
            with self._ns_lock:
                done = remove(self.control(), server, ns, self.owned)
            log.info("namespace released key=%s server=%s namespace=%s: %s", key, server, ns, done)
        except DaemonNotRunning as exc:  # gone with the daemon; its next start's file has no such namespace
            self.owned.discard(server, ns)
            log.info("namespace gone with the daemon key=%s server=%s namespace=%s (%s)", key, server, ns, exc)
        except ControlError as exc:
            with self._lock:
                self._leftover[key] = request
            raise BackendError(f"{key}: namespace {server}/{ns} not deleted: {exc}") from exc

    def adopt(self, requests: Iterable[SliceRequest]) -> None:
        adopted = []
        for request in requests:
            try:
                self.check(request)
            except BackendError as exc:
                log.error("slice not adopted (granted by another backend?) error=%s", exc)
                continue
            adopted.append(request)
        with self._lock:
            self._live.update((r.key, r) for r in adopted)
        for request in adopted:
            try:
                self._limit_pods(request)
            except BackendError as exc:  # tried again each memory round
                log.error("memory limits of an adopted slice not set: %s", exc)
        if adopted:
            log.info("slices adopted count=%d: their namespaces are (re-)created", len(adopted))
            try:
                self.reconcile(self.control())
            except ControlError as exc:  # the daemon's next start or health round does it
                log.info("namespaces of adopted slices wait for the daemon error=%s", exc)

    # -- the daemon's side (mpsd/lifecycle/v3.py) ----------------------------------------

    def wanted(self) -> dict[str, dict[str, Limits3]]:
        """{server: {namespace: limits}} of the live slices."""
        out: dict[str, dict[str, Limits3]] = {}
        with self._lock:
            live = list(self._live.values())
        for request in live:
            server, ns = self.place(request)
            out.setdefault(server, {})[ns] = self.namespace_limits(request)
        return out

    def toml(self) -> str:
        """The daemon's startup file: a server per managed GPU, the live slices' namespaces."""
        wanted = self.wanted()
        for server, namespaces in wanted.items():  # the daemon makes them from the file: mpsd's
            for ns in namespaces:
                self.owned.add(server, ns)
        specs = [ServerSpec(server_name(g.index), g.uuid, self.uid, self.defaults, wanted.get(server_name(g.index), {}))
                 for g in self.gpus()]
        missing = sorted(set(wanted) - {s.name for s in specs})
        if missing:
            log.error("live slices on servers of GPUs NVML does not list servers=%s: not in the daemon's file", missing)
        return render(specs)

    def reconcile(self, control: Control3, servers: list[Server3] | None = None) -> Round:
        """Every managed server's namespaces read back and made the live slices'
        (mpsd/sharing/namespaces3.py): what was put back, refused, or could not be read. A
        refusal is never a reason to restart the daemon (a restart is what tampering would want)."""
        servers = control.server_list() if servers is None else servers
        with self._ns_lock:
            return reconcile(control, servers, self.wanted(), self.defaults, self.owned)

    def namespace_sockets(self) -> tuple[str, ...]:
        """The live namespaces' sockets, relative to the pipe dir (whom they are served by is checked)."""
        return tuple(os.path.join(server, ns, "control") for server, nss in self.wanted().items() for ns in nss)
