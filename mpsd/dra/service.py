"""``mpsd run`` with dra.enabled: the DRA kubelet plugin wired to the API server.

Entry point (mpsd/node.py calls it in a thread, as it calls the device plugin's run_plugin)::

    run_dra(config, *, pipe_dir, gpus, board, metrics, shim_library, stop, state_dir=None, api=None,
            gpu_lister=None, started=None)

- the node is ``NODE_NAME`` (the DaemonSet sets it from the downward API), else the host name;
  its pool has the node's name (mpsd/dra/slices.py publishes it so); ``POD_UID`` names this
  instance's sockets, so that the old and the new pod of a rolling update overlap
  (mpsd/dra/kubeletplugin.py);
- the node's ResourceSlices are published (mpsd/dra/publisher.py) once the plugin serves and kept
  current (mpsd/dra/keeper.py: a watch of the node's slices, the health board's taints, the GPUs
  listed every PUBLISH_INTERVAL), checked again when the kubelet registers the plugin, and left
  in place on shutdown: the scheduler must not see the node's GPUs vanish while mpsd restarts
  (``remove_slices``, ``mpsd dra remove-slices``, deletes them when DRA is turned off);
- claims are read through ``api.get_resource_claim`` (mpsd/dra/kubeapi.py, from the service
  account or KUBECONFIG; each call bounded by API_TIMEOUT);
- regionDir, shimHostDir, ipcMode, shmDir and slicesPerGpu are the device plugin's settings,
  the state ``<stateDir>/dra-state.json``; the shim is installed into shimHostDir as the device
  plugin installs it.

Raises DraError (or KubeAPIError) when it cannot start; stops serving when ``stop`` is set.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import tempfile
import threading
from typing import Callable, Mapping, Sequence

from ..errors import MpsdError
from ..lifecycle.health import HealthBoard
from ..alloc.container import HostPaths
from ..alloc.shimfile import install_shim
from ..alloc.served import instance_id
from ..alloc.state import StateStore
from ..alloc.usage import shim_usage
from .cdi import CdiDir
from .claimusage import ClaimUsageReader
from .keeper import SliceKeeper
from .devicehealth import HealthSource
from .nvidiacdi import DEFAULT_DIRS as DEFAULT_CDI_DIRS
from .nvidiacdi import NvidiaSpecs
from .kubeletplugin import DraPlugin
from .prepared import PREPARED, PreparedClaim, Preparer
from .publisher import SlicePublisher
from .slices import GpuLike  # what Prepare needs and what the slices publish: name, capability, MIG
from .taints import Tainter

log = logging.getLogger(__name__)

STATE_FILE = "dra-state.json"
PUBLISH_INTERVAL = 5.0
API_TIMEOUT = 5.0  # per API server call: 16 claims on 8 workers stay inside the kubelet's 45 s


def read_prepared(state_dir: str) -> list[PreparedClaim]:
    """The prepared claims in ``<state_dir>/dra-state.json`` as ``mpsd status`` shows them, read
    from a private copy of the snapshot and journal: loading a damaged file moves it aside, which
    must not happen to the files a running mpsd writes."""
    source = os.path.join(state_dir, STATE_FILE)
    with tempfile.TemporaryDirectory(prefix="mpsd-status-") as tmp:
        for suffix in ("", ".journal"):
            try:
                shutil.copyfile(source + suffix, os.path.join(tmp, STATE_FILE + suffix), follow_symlinks=False)
            except OSError:
                continue
        store = StateStore(os.path.join(tmp, STATE_FILE), record=PreparedClaim)
        try:
            store.load()
        finally:
            store.close()
        return [c for c in store.all() if c.phase == PREPARED]


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get("NODE_NAME") or socket.gethostname()


def nvidia_cdi_dirs(cdi_dir: str) -> tuple[str, ...]:
    """Where NVIDIA's CDI specs may be: the runtimes' two default directories and cdiDir."""
    return tuple(dict.fromkeys((*DEFAULT_CDI_DIRS, cdi_dir)))


def build(config, *, pipe_dir: str, gpus: Sequence[GpuLike], get_claim, state_dir: str, node: str,
          metrics=None, shim_library: str | None = None, backend=None, instance: str | None = None,
          board: HealthBoard | None = None) -> DraPlugin:
    """The plugin for ``config`` (a whole mpsd Config), not started; with ``metrics``, per-claim
    series every 10 s (regions read through ``shim_library``); with ``board``, device health
    for the kubelet (mpsd/dra/devicehealth.py) from it."""
    dp, dra = config.device_plugin, config.dra
    paths = HostPaths(pipe_dir=pipe_dir, region_dir=dp.region_dir, shim_host_dir=dp.shim_host_dir,
                      ipc_mode=dp.ipc_mode, shm_dir=dp.shm_dir)
    preparer = Preparer(
        driver=dra.driver_name, node=node, pool=node, gpus=gpus, slices_per_gpu=dp.slices_per_gpu, paths=paths,
        cdi_dir=CdiDir(dra.cdi_dir), store=StateStore(os.path.join(state_dir, STATE_FILE), record=PreparedClaim),
        get_claim=get_claim, backend=backend, nvidia=NvidiaSpecs(nvidia_cdi_dirs(dra.cdi_dir)), dev_root=dra.dev_root,
    )
    usage = None
    if metrics is not None:
        usage = ClaimUsageReader(preparer.prepared, functools.partial(shim_usage, library=shim_library), metrics)
    health = None
    if board is not None:
        health = HealthSource(board, lambda: preparer.gpus, preparer.prepared, dra.mode, dp.slices_per_gpu, metrics)
    return DraPlugin(preparer, plugins_dir=dra.plugins_dir, registry_dir=dra.registry_dir, usage=usage, health=health,
                     instance=instance_id() if instance is None else instance)


def run_dra(
    config,
    *,
    pipe_dir: str,
    gpus: Sequence[GpuLike],
    board: HealthBoard,
    metrics: object | None,
    shim_library: str,
    stop: threading.Event,
    state_dir: str | None = None,
    api=None,
    gpu_lister: Callable[[], Sequence[GpuLike]] | None = None,
    backend=None,
    instance: str | None = None,
    driver_version: Callable[[], str] | None = None,
    started: threading.Event | None = None,
) -> None:
    """Serve the DRA plugin until ``stop`` is set (see the module docstring); ``started`` is set
    once its sockets are served (mpsd run's /readyz waits for it); ``backend``: the
    node's sharing backend (mpsd/sharing), MPS v2's when None; ``instance`` names its sockets
    (default: ``POD_UID``); ``driver_version``: NVIDIA's driver version as NVML reports it
    (published as the driverVersion attribute)."""
    state_dir = state_dir or config.state_dir
    own_api = api is None
    watcher = None
    if own_api:
        from .kubeapi import KubeAPI

        api = KubeAPI.from_environment(timeout=API_TIMEOUT)
        watcher = KubeAPI.from_environment(timeout=API_TIMEOUT)  # its own connection: closing it ends the watch
    node = node_name()
    dra = config.dra
    try:
        plugin = build(config, pipe_dir=pipe_dir, gpus=gpus, get_claim=api.get_resource_claim, state_dir=state_dir,
                       node=node, metrics=metrics, shim_library=shim_library, backend=backend, instance=instance,
                       board=board)
        dest = install_shim(shim_library, config.device_plugin.shim_host_dir)
        log.info("shim installed source=%s dest=%s", shim_library, dest)
        publisher = SlicePublisher(api, dra.driver_name, node, dra.mode, config.device_plugin.slices_per_gpu,
                                   node_uid=_node_uid(api, node), metrics=metrics)
        watch = getattr(watcher or api, "watch_resource_slices", None)
        keeper = SliceKeeper(
            publisher, gpus, driver_version=_version(driver_version), board=board,
            tainter=Tainter(dra.driver_name, dra.taint_effect, dra.taint_after),
            gpu_lister=gpu_lister, on_gpus=functools.partial(setattr, plugin.preparer, "gpus"),
            watch=functools.partial(watch, dra.driver_name, node) if watch else None, interval=PUBLISH_INTERVAL,
            metrics=metrics,
        )
        def registered() -> None:  # the kubelet deletes the node's slices when it starts: check at once
            publisher.invalidate()
            keeper.wake.set()

        plugin.registration.on_registered = registered
        try:
            plugin.start()
            if started is not None:
                started.set()
            keeper.run(stop)
        finally:
            plugin.stop()  # the slices stay: the node's GPUs must not vanish while mpsd restarts
    finally:
        if watcher is not None:
            watcher.close()
        if own_api:
            api.close()


def _version(driver_version: Callable[[], str] | None) -> str:
    """The driver version, "" when unknown (the attribute is then left out, as slices.py does)."""
    if driver_version is None:
        return ""
    try:
        return driver_version()
    except MpsdError as exc:
        log.warning("driver version unknown, driverVersion not published error=%s", exc)
        return ""


def _node_uid(api, node: str) -> str | None:
    """The Node's UID, so that its slices are owned by it (deleted with it); None if unreadable."""
    try:
        return api.get_node_uid(node)
    except MpsdError as exc:
        log.warning("node uid unknown, slices published without an owner node=%s error=%s", node, exc)
        return None


def remove_slices(config, node: str | None = None, api=None) -> int:
    """``mpsd dra remove-slices``: delete this node's ResourceSlices of the driver (DRA turned
    off, mpsd uninstalled); the number deleted. KubeAPIError when the API server fails."""
    own_api = api is None
    if own_api:
        from .kubeapi import KubeAPI

        api = KubeAPI.from_environment(timeout=API_TIMEOUT)
    try:
        publisher = SlicePublisher(api, config.dra.driver_name, node or node_name(), config.dra.mode,
                                   config.device_plugin.slices_per_gpu)
        return publisher.remove()
    finally:
        if own_api:
            api.close()
