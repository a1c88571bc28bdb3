"""The device plugin's face for MIG instances: one extended resource per MIG profile.

Operators of NVIDIA's GPU operator with ``mig.strategy: mixed`` request instances by profile
(``nvidia.com/mig-1g.10gb``, ``nvidia.com/mig-3g.40gb``): the profile is what they size a pod by,
quota by and select nodes for, and the scheduler can only count one resource name at a time.
mpsd keeps that contract: each profile present on the node is a resource ``<domain>/mig-<profile>``
(``mpsd.io/mig-1g.10gb`` with the default ``devicePlugin.resourceName`` ``mpsd.io/gpu``), whose
devices are the slices ``<MIG-uuid>::<k>`` of that profile's instances, N per instance
(``mig.slicesPerInstance``; mpsd.inventory.mig.slices_for). One resource with topology hints would let a pod
land on any profile, which a MIG user chose the layout to prevent. ``+`` is not allowed in a resource
name: as NVIDIA's mixed strategy does (k8s-device-plugin ``internal/rm``), ``1g.10gb+me`` is offered as
``mig-1g.10gb.me``, and ``1g.10gb-me`` (go-nvlib: *without* media extensions) as ``mig-1g.10gb-me``.
An instance that cannot be offered (its /dev/nvidia-caps node missing) is listed Unhealthy.

Each profile is an ordinary :class:`mpsd.plugin.DevicePlugin` (its own socket, registration, state
file ``device-plugin-state-mig-<profile>.json`` and region directory ``<regionDir>/mig-<profile>``,
so that no plugin's garbage collection touches another's), with the instances the fleet serves now
as its devices (a layout change is sent to the kubelet when the fleet's round changes the board)
and :class:`mpsd.sharing.mig.MigBackend` as its backend. A profile that appears later gets its
plugin within a poll; one whose instances all vanish keeps its plugin with no devices.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Iterable

from ..errors import MpsdError, PluginError
from ..inventory.mig import CannotDivide, MigDevice, by_profile
from ..plugin import DevicePlugin
from ..alloc.container import HostPaths
from ..alloc.usage import shim_usage
from ..sharing.mig import BURST, MigBackend

log = logging.getLogger(__name__)

POLL = 0.5


def resource_name(base: str, profile: str) -> str:
    """``mpsd.io/gpu`` and ``1g.10gb`` -> ``mpsd.io/mig-1g.10gb``; ``1g.10gb+me`` -> ``mig-1g.10gb.me``."""
    return f"{base.split('/', 1)[0]}/mig-{profile.replace('+', '.').replace(',', '.')}"


def profile_slices(profile: str, devices: Iterable[MigDevice]) -> int:
    """One N for every instance of a profile: the fewest any of them is given (mpsd.mig.fleet sets
    ``slices``); CannotDivide when one of them cannot be divided as configured."""
    counts = [d.slices for d in devices]
    if min(counts) < 1:
        raise CannotDivide(f"an instance of MIG profile {profile} cannot be divided as mig.slicesPerInstance asks "
                           "(the fleet's log line names it and the most it holds)")
    return min(counts)


class SharedAllocations:
    """Several device plugins' allocation rows as one series group: Metrics.set_allocations replaces
    the group whole, so each plugin sets its part and the union is pushed."""

    def __init__(self, metrics) -> None:
        self._metrics = metrics
        self._rows: dict[str, list] = {}
        self._lock = threading.Lock()

    def part(self, name: str) -> "_Part":
        return _Part(self, name)

    def _set(self, name: str, rows) -> None:
        with self._lock:
            self._rows[name] = list(rows)
            self._metrics.set_allocations([r for part in self._rows.values() for r in part])


class _Part:
    def __init__(self, shared: SharedAllocations, name: str) -> None:
        self._shared, self._name = shared, name

    def set_allocations(self, rows) -> None:
        self._shared._set(self._name, rows)

    def __getattr__(self, attr: str):
        return getattr(self._shared._metrics, attr)


class MigPlugins:
    def __init__(self, config, fleet, board, *, metrics=None, shim_library: str | None = None,
                 state_dir: str | None = None, usage_interval: float = 10.0) -> None:
        self.config, self.fleet, self.board = config, fleet, board
        self.metrics = metrics  # a SharedAllocations (or None)
        self.shim_library = shim_library
        self.state_dir = state_dir or config.state_dir
        self.usage_interval = usage_interval
        self.plugins: dict[str, DevicePlugin] = {}
        self._refused: dict[str, str] = {}

    def sync(self) -> None:
        """A plugin for each profile served now that has none yet."""
        for profile, devices in by_profile(d for d in self.fleet.devices(unserved=True) if d.profile).items():
            if profile in self.plugins:
                continue
            try:
                plugin = self._make(profile, devices)
                plugin.start()
            except (CannotDivide, MpsdError) as exc:
                if self._refused.get(profile) != str(exc):
                    log.error("MIG profile not offered profile=%s error=%s", profile, exc)
                self._refused[profile] = str(exc)
                continue
            self._refused.pop(profile, None)
            self.plugins[profile] = plugin

    def _make(self, profile: str, devices: list[MigDevice]) -> DevicePlugin:
        dp, mig = self.config.device_plugin, self.config.mig
        n = profile_slices(profile, devices)
        tag = "mig-" + resource_name("x/y", profile).split("/mig-", 1)[1]
        paths = HostPaths(pipe_dir=mig.pipe_root, region_dir=os.path.join(dp.region_dir, tag),
                          shim_host_dir=dp.shim_host_dir, ipc_mode=dp.ipc_mode, shm_dir=dp.shm_dir)
        name = resource_name(dp.resource_name, profile)
        log.info("MIG profile offered profile=%s resource=%s instances=%d slices_per_instance=%d",
                 profile, name, len(devices), n)
        return DevicePlugin(
            gpus=devices, resource_name=name, slices_per_gpu=n, kubelet_dir=dp.kubelet_dir, paths=paths,
            state_path=os.path.join(self.state_dir, f"device-plugin-state-{tag}.json"), board=self.board,
            shim_library=self.shim_library, pod_resources_socket=dp.pod_resources_socket or None,
            metrics=None if self.metrics is None else self.metrics.part(tag),
            usage_reader=functools.partial(shim_usage, library=self.shim_library),
            usage_interval=self.usage_interval, backend=MigBackend(paths, self.fleet.pipe_dir, device=self.fleet.device,
                                                                 partitions=self.fleet.partitions),
            gpu_source=lambda: [d for d in self.fleet.devices(unserved=True) if d.profile == profile],
        )

    def run(self, stop: threading.Event, poll: float = POLL, started: threading.Event | None = None) -> None:
        """Serve until ``stop``; PluginError at once when devicePlugin.memoryLimit asks for burst, which
        an instance's daemon cannot lend (the whole-GPU plugin refuses it on MPS v2 alike).
        ``started`` is set once the first round has registered every profile there is (/readyz)."""
        limit = self.config.device_plugin.memory_limit
        if limit:
            raise PluginError(f"devicePlugin.memoryLimit {limit} cannot be enforced on MIG instances: {BURST}")
        try:
            while True:
                self.sync()
                if started is not None:
                    started.set()
                if stop.wait(poll):
                    return
        finally:
            for plugin in self.plugins.values():
                plugin.stop()


def run_mig_plugins(config, *, board, metrics, shim_library: str, stop: threading.Event, state_dir: str | None = None,
                    fleet, started: threading.Event | None = None, **_ignored) -> None:
    """``mpsd run``'s entry (mpsd/node.py): serve every profile's plugin until ``stop``."""
    MigPlugins(config, fleet, board, metrics=metrics, shim_library=shim_library, state_dir=state_dir).run(
        stop, started=started)
