"""The DevicePlugin gRPC service the kubelet calls: options, device list, preferred allocation,
Allocate. Pure work is delegated to slicing and response; this module translates PluginError
into gRPC status codes and records allocations."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Sequence

import grpc

from ..errors import BackendError, PluginError
from ..lifecycle.health import HealthBoard, HealthState
from ..sharing import Backend, Grant, SliceRequest
from ..sharing.v2 import V2Backend
from . import api_pb2, api_pb2_grpc
from ..alloc.container import HostPaths
from ..alloc.slicing import GpuLike, Plan, plan_allocation, preferred_allocation, slice_id
from ..alloc.state import Allocation, StateStore
from ..alloc.allocdir import fresh_dir

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_STREAMS = 8  # ListAndWatch streams served at once
UNARY_WORKERS = 8  # server threads left for the short calls (Allocate, ...) when all streams are open


def device_list(gpus: Sequence[GpuLike], slices_per_gpu: int, state: HealthState) -> list[tuple[str, str]]:
    """(device ID, health) for every slice: a slice is as healthy as its GPU on the board."""
    return [
        (slice_id(g.uuid, k), HEALTHY if state.device_healthy(g) else UNHEALTHY)
        for g in sorted(gpus, key=lambda g: g.index)
        for k in range(slices_per_gpu)
    ]


class Servicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(
        self,
        *,
        gpus: Sequence[GpuLike],
        slices_per_gpu: int,
        board: HealthBoard,
        paths: HostPaths,
        store: StateStore,
        stop: threading.Event,
        wake_interval: float = 0.5,
        max_streams: int = MAX_STREAMS,
        backend: Backend | None = None,
        request_for: Callable[[Plan, str], SliceRequest] | None = None,
        gpu_source: Callable[[], Sequence[GpuLike]] | None = None,
    ) -> None:
        fixed = sorted(gpus, key=lambda g: g.index)
        self._gpu_source = gpu_source or (lambda: fixed)  # MIG: the instances served now (mpsd/mig/plugin.py)
        self.backend = backend or V2Backend(paths)  # what a slice becomes on this node (mpsd/sharing)
        self.request_for = request_for or (lambda plan, region_dir: SliceRequest(plan.allocation_id, plan, region_dir))
        self.max_streams = max_streams
        self._streams = 0
        self._streams_lock = threading.Condition()  # notified as each stream ends
        self.slices_per_gpu = slices_per_gpu
        self.board = board
        self.paths = paths
        self.store = store
        self.stop = stop
        self.wake_interval = wake_interval

    @property
    def gpus(self) -> list[GpuLike]:
        return sorted(self._gpu_source(), key=lambda g: g.index)

    def GetDevicePluginOptions(self, request, context):
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request, context):
        """The full list at once, then again whenever a slice's health changes; ends on stop.

        Each open stream holds a server thread: at most ``max_streams`` at once (the kubelet
        keeps one), the rest refused with RESOURCE_EXHAUSTED, so that Allocate always finds a
        free thread however many streams a client opens."""
        with self._streams_lock:
            admitted = self._streams < self.max_streams
            if admitted:
                self._streams += 1
        if not admitted:
            log.warning("ListAndWatch refused: %d streams open already (the most served at once)", self.max_streams)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many ListAndWatch streams: {self.max_streams} open already (the kubelet needs one)",
            )
        try:
            yield from self._list_and_watch(context)
        finally:
            with self._streams_lock:
                self._streams -= 1
                self._streams_lock.notify_all()

    def streams_ended(self, timeout: float) -> bool:
        """Wait until no ListAndWatch stream is open (after ``stop`` each ends within wake_interval)."""
        with self._streams_lock:
            return self._streams_lock.wait_for(lambda: self._streams == 0, timeout)

    def _list_and_watch(self, context):
        state = self.board.current()
        last = None
        while True:
            devices = device_list(self.gpus, self.slices_per_gpu, state)
            if devices != last:
                unhealthy = sum(1 for _, h in devices if h == UNHEALTHY)
                log.info("ListAndWatch send devices=%d unhealthy=%d generation=%d", len(devices), unhealthy,
                         state.generation)
                yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=i, health=h) for i, h in devices])
                last = devices
            # Wakes on a board change; the timeout only lets a stop or a cancelled stream end.
            while not self.stop.is_set() and context.is_active():
                newer = self.board.wait_change(state.generation, timeout=self.wake_interval)
                if newer.generation != state.generation:
                    state = newer
                    break
            else:
                log.info("ListAndWatch stream ends stop=%s active=%s", self.stop.is_set(), context.is_active())
                return

    def GetPreferredAllocation(self, request, context):
        response = api_pb2.PreferredAllocationResponse()
        for creq in request.container_requests:
            try:
                chosen = preferred_allocation(
                    list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), creq.allocation_size,
                    [g.uuid for g in self.gpus],
                )
            except PluginError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            log.debug("preferred allocation size=%d chosen=%s", creq.allocation_size, ",".join(chosen))
            response.container_responses.add(deviceIDs=chosen)
        return response

    def Allocate(self, request, context):
        response = api_pb2.AllocateResponse()
        try:
            plans = [plan_allocation(list(c.devices_ids), self.gpus, self.slices_per_gpu)
                     for c in request.container_requests]
        except PluginError as exc:
            log.error("Allocate refused error=%s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            allocations = self.record_all(plans)
            for plan, allocation in zip(plans, allocations, strict=True):
                grant = self.backend.grant(self.request_for(plan, allocation.region_dir))
                response.container_responses.append(allocate_response(grant))
        except BackendError as exc:  # refused by the node's backend (a limit it cannot enforce, a namespace)
            log.error("Allocate refused by the %s backend error=%s", self.backend.name, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PluginError as exc:  # the node's side: regionDir full, the state not writable
            log.error("Allocate failed error=%s", exc)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return response

    def PreStartContainer(self, request, context):
        return api_pb2.PreStartContainerResponse()

    def record(self, plan: Plan) -> Allocation:
        """``record_all`` of one plan."""
        return self.record_all([plan])[0]

    def record_all(self, plans: Sequence[Plan]) -> list[Allocation]:
        """Create a fresh region directory for each plan (mode 0777) and remember them all
        in one journal line: all or nothing. When anything fails (regionDir full, the state
        disk full) the new directories are removed and the state is exactly as before (the
        journal, memory, and earlier allocations of the same device IDs still named): the
        caller's request failed, so nothing of it may stay.

        Under the store's lock from the directories to the state, so that garbage collection
        (which decides under the same lock) never takes a directory being recorded. The same
        device IDs again (a new pod on the same slices) get a new directory too: the previous
        tenant's files (a region whose lock it poisoned, say) never reach the next pod; its
        directory, no longer named by the state, is removed by garbage collection."""
        if not plans:
            return []
        with self.store.lock:
            directories: list[str] = []
            try:
                for plan in plans:
                    directories.append(self._fresh_dir(plan.allocation_id))
                allocations = [_allocation(plan, d) for plan, d in zip(plans, directories, strict=True)]
                previous = [self.store.get(plan.allocation_id) for plan in plans]
                self.store.put_many(allocations)
            except BaseException:
                for directory in directories:
                    _remove_empty(directory)
                raise
        for plan, allocation, before in zip(plans, allocations, previous, strict=True):
            _log_allocated(plan, allocation, before)
        return allocations

    def _fresh_dir(self, allocation_id: str) -> str:
        return fresh_dir(self.paths.region_dir, allocation_id)


def allocate_response(grant: Grant) -> api_pb2.ContainerAllocateResponse:
    """A backend's grant as the kubelet takes it: environment and mounts."""
    return api_pb2.ContainerAllocateResponse(
        envs=grant.env,
        mounts=[
            api_pb2.Mount(container_path=m.container, host_path=m.host, read_only=m.read_only) for m in grant.mounts
        ],
    )


def _allocation(plan: Plan, directory: str) -> Allocation:
    return Allocation(
        allocation_id=plan.allocation_id,
        device_ids=plan.device_ids,
        gpus=tuple(g.uuid for g in plan.gpus),
        memory_limits=plan.memory_limits,
        active_thread_percentage=plan.active_thread_percentage,
        region_dir=directory,
        created=time.time(),
    )


def _log_allocated(plan: Plan, allocation: Allocation, previous: Allocation | None) -> None:
    if plan.spans_gpus:
        log.warning(
            "allocation spans GPUs allocation=%s gpus=%s memory_limits=%s thread_percentage=%s "
            "(one MPS percentage per client: the largest is used)",
            plan.allocation_id, plan.visible_devices, plan.memory_limits, plan.active_thread_percentage,
        )
    log.info(
        "Allocate allocation=%s devices=%s memory_limits=%s thread_percentage=%s region=%s%s",
        plan.allocation_id,
        ",".join(plan.device_ids),
        plan.memory_limits,
        plan.active_thread_percentage,
        os.path.basename(allocation.region_dir),
        f" replaces={os.path.basename(previous.region_dir)}" if previous is not None else "",
    )


def _remove_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:
        pass
