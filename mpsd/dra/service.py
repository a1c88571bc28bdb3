"""``mpsd run`` with dra.enabled: the DRA kubelet plugin wired to the API server.

Entry point (mpsd/node.py calls it in a thread, as it calls the device plugin's run_plugin)::

    run_dra(config, *, pipe_dir, gpus, board, metrics, shim_library, stop, state_dir=None, api=None,
            gpu_lister=None)

- the node is ``NODE_NAME`` (the DaemonSet sets it from the downward API), else the host name;
  its pool has the node's name (mpsd/dra/slices.py publishes it so);
- the node's ResourceSlices are published (mpsd/dra/publisher.py) once the plugin serves, kept
  current every PUBLISH_INTERVAL, checked again when the kubelet registers the plugin, and
  removed on shutdown after the registration socket is gone;
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
from ..health import HealthBoard
from ..plugin.response import SHIM_NAME, HostPaths
from ..plugin.slicing import GpuLike
from ..plugin.state import StateStore, install_file
from ..plugin.usage import shim_usage
from .cdi import CdiDir
from .claimusage import ClaimUsageReader
from .devicehealth import HealthSource
from .nvidiacdi import DEFAULT_DIRS as DEFAULT_CDI_DIRS
from .nvidiacdi import NvidiaSpecs
from .kubeletplugin import DraPlugin
from .prepared import PREPARED, PreparedClaim, Preparer
from .publisher import SlicePublisher

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
          metrics=None, shim_library: str | None = None, board: HealthBoard | None = None) -> DraPlugin:
    """The plugin for ``config`` (a whole mpsd Config), not started; with ``metrics``, per-claim
    series every 10 s (regions read through ``shim_library``); with ``board``, device health
    for the kubelet (mpsd/dra/devicehealth.py) from it."""
    dp, dra = config.device_plugin, config.dra
    paths = HostPaths(pipe_dir=pipe_dir, region_dir=dp.region_dir, shim_host_dir=dp.shim_host_dir,
                      ipc_mode=dp.ipc_mode, shm_dir=dp.shm_dir)
    preparer = Preparer(
        driver=dra.driver_name, node=node, pool=node, gpus=gpus, slices_per_gpu=dp.slices_per_gpu, paths=paths,
        cdi_dir=CdiDir(dra.cdi_dir), store=StateStore(os.path.join(state_dir, STATE_FILE), record=PreparedClaim),
        get_claim=get_claim, nvidia=NvidiaSpecs(nvidia_cdi_dirs(dra.cdi_dir)),
    )
    usage = None
    if metrics is not None:
        usage = ClaimUsageReader(preparer.prepared, functools.partial(shim_usage, library=shim_library), metrics)
    health = None
    if board is not None:
        health = HealthSource(board, lambda: preparer.gpus, preparer.prepared, dra.mode, dp.slices_per_gpu, metrics)
    return DraPlugin(preparer, plugins_dir=dra.plugins_dir, registry_dir=dra.registry_dir, usage=usage, health=health)


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
    driver_version: Callable[[], str] | None = None,
) -> None:
    """Serve the DRA plugin until ``stop`` is set (see the module docstring). ``driver_version``:
    NVIDIA's driver version as NVML reports it (published as the driverVersion attribute)."""
    state_dir = state_dir or config.state_dir
    own_api = api is None
    if own_api:
        from .kubeapi import KubeAPI

        api = KubeAPI.from_environment(timeout=API_TIMEOUT)
    node = node_name()
    try:
        plugin = build(config, pipe_dir=pipe_dir, gpus=gpus, get_claim=api.get_resource_claim, state_dir=state_dir,
                       node=node, metrics=metrics, shim_library=shim_library, board=board)
        dest = install_file(shim_library, config.device_plugin.shim_host_dir, SHIM_NAME)
        log.info("shim installed source=%s dest=%s", shim_library, dest)
        publisher = SlicePublisher(api, config.dra.driver_name, node, config.dra.mode,
                                   config.device_plugin.slices_per_gpu, node_uid=_node_uid(api, node))
        plugin.registration.on_registered = publisher.invalidate  # the kubelet wipes slices at its start
        try:
            plugin.start()
            publish_until(stop, publisher, gpus, gpu_lister, plugin.preparer, driver_version=driver_version)
        finally:
            plugin.stop()  # deregistered first: no new Prepare while the slices go
            try:
                publisher.remove()
            except MpsdError as exc:
                log.error("resourceslices not removed on shutdown (the kubelet removes them 30 s after the "
                          "plugin is gone) error=%s", exc)
    finally:
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


def publish_until(stop: threading.Event, publisher: SlicePublisher, gpus: Sequence[GpuLike],
                  gpu_lister: Callable[[], Sequence[GpuLike]] | None = None, preparer: Preparer | None = None,
                  interval: float = PUBLISH_INTERVAL, driver_version: Callable[[], str] | None = None) -> None:
    """Keep the node's ResourceSlices equal to the GPUs until ``stop``: at once, then every
    ``interval`` (publish makes no API call while nothing changed, and checks the server at its
    resync interval or after a registration); an API failure is logged once and retried. With
    ``gpu_lister`` (NVML through mpsd's inventory) the GPUs are listed again each round: a GPU
    that appears, goes or changes is published, and Prepare checks claims against the new list
    (an empty listing, NVML failing for a moment, keeps the last one)."""
    last = ""
    while True:
        listed = list(gpu_lister()) if gpu_lister is not None else []
        if listed and listed != list(gpus):
            log.info("GPUs changed, publishing them gpus=%s", ",".join(str(g.index) for g in listed))
            gpus = listed
            if preparer is not None:
                preparer.gpus = listed
        try:
            publisher.publish(gpus, _version(driver_version))
            last = ""
        except (MpsdError, ValueError) as exc:
            if str(exc) != last:
                log.error("resourceslices not published (retrying every %.0fs): %s", interval, exc)
            last = str(exc)
        if stop.wait(interval):
            return
