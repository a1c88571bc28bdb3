"""The wiring of ``mpsd run``: the supervisor, the NVML inventory, metrics and probes, and
the device plugin, started in order and stopped in reverse. The control daemon's child
process is mpsd/daemon/process.py; the loop that keeps it alive is mpsd/lifecycle/supervisor.py."""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Callable

from . import config as cfg
from .daemon import dirs
from .errors import InventoryError, MpsdError
from .logs import LOG_FORMAT
from .metrics.regions import ExecRegions
from .lifecycle.health import HealthBoard
from .lifecycle.standby import Standby
from .lifecycle.supervisor import Status, Supervisor

log = logging.getLogger(__name__)


def open_inventory(config: cfg.Config):
    try:
        from .inventory.nvml import Inventory

        return Inventory(library_path=config.nvml_library)
    except (InventoryError, ImportError, OSError) as exc:
        log.warning("NVML not available, running without GPU inventory: %s", exc)
        return None


def managed_gpus(gpus: list, visible_devices: str | None) -> list:
    """The GPUs the daemon serves: those ``visibleDevices`` names by index (nvidia-smi's
    numbering, which the daemon gets through CUDA_DEVICE_ORDER=PCI_BUS_ID) or UUID; all of
    them without it, or when it names MIG devices (NVML's GPU list cannot match those).
    Never a GPU in MIG mode: MPS cannot use it whole (its instances are mpsd/mig/fleet.py's)."""
    gpus = [g for g in gpus if not getattr(g, "mig_enabled", False)]
    if not visible_devices:
        return list(gpus)
    names = visible_devices.split(",")
    if any(name.startswith("MIG-") for name in names):
        return list(gpus)
    return [g for g in gpus if str(g.index) in names or g.uuid in names]


def _gpu_lister(inventory, visible_devices: str | None) -> Callable[[], list]:
    def gpus() -> list:
        if inventory is None:
            return []
        try:
            return managed_gpus(inventory.gpus(), visible_devices)
        except InventoryError as exc:
            log.warning("NVML query failed: %s", exc)
            return []

    return gpus


class InventoryPump:
    """Reads NVML in its own thread for the GPU series and the FAULT mapping. NVML can block
    for seconds on a GPU in trouble; the supervisor loop (health checks, restarts, SIGTERM)
    must never wait on it. Requests coalesce: a refresh reads the latest state. Memory
    series cover every GPU; indices and device health only the managed ones."""

    def __init__(
        self, inventory, metrics, board: HealthBoard, visible_devices: str | None = None, regions=None,
        on_listing: Callable[[list], None] | None = None,
    ) -> None:
        self._inventory, self._metrics, self._board = inventory, metrics, board
        self._regions = regions  # mpsd.metrics.regions.ExecRegions: read in this thread too
        self._on_listing = on_listing  # each round's GPU listing (MIG: the instances read and served)
        self.listed: list = []  # the last successful listing
        self._visible_devices = visible_devices
        self._cond = threading.Condition()
        self._pending = self._closed = False
        self._indices: list[int] = []
        self._thread = threading.Thread(target=self._run, name="nvml-refresh", daemon=True)
        self._thread.start()

    def request(self) -> None:
        with self._cond:
            self._pending = True
            self._cond.notify()

    def gpu_indices(self) -> list[int]:
        """The GPU indices of the last successful listing (kept when NVML fails meanwhile)."""
        with self._cond:
            return list(self._indices)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                self._pending = False
            self.refresh()

    def refresh(self, regions: bool = True) -> None:
        """NVML's view, then (``regions``) the regions of mpsd exec. The regions are files
        others write and can take long to read: never on the start path (``run`` refreshes
        without them), and after NVML so that a slow read never delays the GPU series."""
        self._refresh_gpus()
        if regions and self._metrics is not None and self._regions is not None:
            self._metrics.set_regions(self._regions())

    def _refresh_gpus(self) -> None:
        if self._inventory is None:
            return
        try:
            listed = self._inventory.gpus()
            clients = self._inventory.mps_clients() if self._metrics is not None else []
        except InventoryError as exc:
            log.warning("NVML query failed: %s", exc)
            return
        managed = managed_gpus(listed, self._visible_devices)
        with self._cond:
            self._indices = [g.index for g in managed]
            self.listed = list(listed)
        if self._on_listing is not None:
            try:
                self._on_listing(listed)
            except Exception:  # the GPU series and device health must not depend on it
                log.exception("inventory round observer failed")
        if self._metrics is not None:
            health = self._board.current()
            self._metrics.update_gpus(listed, clients)
            self._metrics.set_device_health({g.index: health.gpu_healthy(g.index) for g in managed})


def _observer(metrics, pump: InventoryPump) -> Callable[[Status], None]:
    """Push each supervisor status into the Prometheus objects; NVML's view is refreshed by
    the pump's thread."""

    def observe(status: Status) -> None:
        if metrics is not None:
            metrics.update_supervisor(
                daemon_up=status.state == "running",
                restarts=status.restarts,
                health_latency=status.health_latency,
                last_error=status.last_error,
                servers=len(status.servers),
                config_generation=status.config_generation,
            )
            metrics.set_faulted_servers(sum(state == "FAULT" for state in status.server_states.values()))
            metrics.set_fault_terminations(status.fault_terminations)
            metrics.set_control_plane(
                status.impostors, status.defaults_restored, status.verdict_age, status.defaults_contested
            )
            metrics.set_uid_sharing(status.multi_user, len(status.waiting))
        pump.request()  # also when down: the device health series follows the board

    return observe


def run(config: cfg.Config, reload: Callable[[], cfg.Config] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop. Raises MpsdError when it cannot start,
    SetupError at once when another ``mpsd run`` holds the pipe dir: its lock is taken before
    anything else touches the pipe dir, and kept until the daemon is gone or let go (its
    supervision over: a standby may take over while the kubelet faces stop). As an instance
    of a rollout (independent lifecycle, ``POD_UID``), it stands by for the lock instead
    (mpsd/lifecycle/standby.py)."""
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger().setLevel(config.log_level.upper())
    standby = None
    locks: list[int] = []
    try:
        locks.append(dirs.hold_pipe_dir(config.pipe_dir, config.state_dir))
    except dirs.PipeDirHeld as held:
        standby = Standby.instead_of(config, held)

    def release() -> None:
        if standby is not None and standby.fd is not None:
            locks.append(standby.fd)
            standby.fd = None
        while locks:
            dirs.release_pipe_dir(locks.pop())

    try:
        return _serve(config, reload, standby, release)
    finally:
        release()
        if standby is not None:
            standby.close()


def _serve(config: cfg.Config, reload: Callable[[], cfg.Config] | None, standby: Standby | None = None,
           release: Callable[[], None] = lambda: None) -> int:
    log.info("config source=%s %s", config.source or "-", cfg.describe(config))
    board = HealthBoard()
    inventory = open_inventory(config)
    gpus = _gpu_lister(inventory, config.visible_devices)
    metrics = server = None
    if config.metrics_address:
        from .registry import Metrics
        from .metrics.http import serve

        metrics = Metrics()
    regions = exec_regions(config, metrics)
    from .mig.node import MigNode  # docs/mig.md: a daemon per MIG instance

    mig = MigNode.create(config, board, inventory, metrics)
    pump = InventoryPump(inventory, metrics, board, config.visible_devices, regions,
                         on_listing=mig.fleet.observe if mig is not None else None)
    pump.refresh(regions=False)  # the GPU indices, before any health check needs them; the regions later
    if mig is not None:  # mixed nodes: the node daemon sees the whole GPUs, each instance has its own
        config, reload = mig.node_config(config, reload, lambda: pump.listed)
    backend, v3 = sharing_backend(config, inventory, gpus)
    supervisor = Supervisor(
        config,
        board,
        reload=reload,
        gpu_indices=pump.gpu_indices,
        on_status=_observer(metrics, pump),
        v3=v3,
    )
    if standby is None:
        supervisor.install_signal_handlers()  # before anything slow: a SIGTERM now is a clean stop
    else:  # its own handlers are in since the lock was found held; the supervisor's come with the lock
        standby.attach(board, metrics, pump.request)
    plugin: PluginRun | None = None  # read by the readiness probe when it is called
    dra: PluginRun | None = None
    mig_plugins: PluginRun | None = None
    if metrics is not None:
        def live() -> bool:  # the supervisor's loop runs, or this mpsd stands by for it
            return supervisor.loop_alive.is_set() or (standby is not None and standby.waiting)

        server = serve(config.metrics_address, metrics, live=live,
                       ready=lambda: _ready(board, plugin, dra, mig_plugins))
        log.info("metrics listening address=%s paths=/metrics,/healthz,/readyz", config.metrics_address)
    stop_plugin = threading.Event()
    plugin = (_start_plugin(config, board, mig.plugin_metrics(metrics) if mig else metrics, gpus, stop_plugin,
                            backend) if config.device_plugin.enabled else None)
    if mig is not None:  # MIG slices: per-profile device plugins, DRA devices of the instances
        from .mig.plugin import run_mig_plugins

        if config.device_plugin.enabled:
            mig_plugins = _start_service("MIG device plugins", lambda: run_mig_plugins, config, board,
                                         mig.allocation_metrics, gpus, stop_plugin, fleet=mig.fleet)
        backend, gpus = mig.faces(config, backend, gpus)
    version = inventory.driver_version if inventory is not None else None  # driverVersion of the slices
    dra = _start_dra(config, board, metrics, gpus, stop_plugin, backend, version) if config.dra.enabled else None
    if v3 is not None:
        v3.start_background()
    try:
        if standby is not None and not standby.take_over(supervisor.install_signal_handlers):
            return 0
        code = supervisor.run()
        release()  # the daemon is let go (or quit): the next mpsd may take over while the faces stop
        return code
    finally:
        if v3 is not None:
            v3.stop_background()
        stop_plugin.set()
        for run in (plugin, dra, mig_plugins):
            if run is not None and run.thread is not None:
                run.thread.join(10)
        if server is not None:
            server.close()
        pump.close()
        if mig is not None:  # after the pump: no round may start an instance's daemon again
            mig.fleet.stop()
        if inventory is not None:
            inventory.close()


class PluginRun:
    """The device plugin's (or the DRA plugin's) thread, whether it serves yet (``started``,
    set by its runner once its sockets are served), and why it is not serving if so ("" while
    it serves or starts)."""

    def __init__(self, label: str = "plugin") -> None:
        self.label = label
        self.thread: threading.Thread | None = None
        self.started = threading.Event()
        self.problem = ""


def _ready(board: HealthBoard, *plugins: PluginRun | None) -> tuple[bool, str]:
    """Ready: daemon up and configured, and the device plugin and the DRA plugin (when enabled)
    serving. A plugin that is down makes only /readyz fail: failing liveness would restart mpsd,
    and with it the daemon under every running client."""
    state = board.current()
    for plugin in plugins:
        if plugin is not None and plugin.problem:
            return False, plugin.problem
        if plugin is not None and plugin.thread is not None and not plugin.started.is_set():
            return False, f"{plugin.label} starting"
    if state.daemon_up and state.configured:
        return (False, state.unverified) if state.unverified else (True, "")
    return False, state.last_error or ("daemon starting" if not state.daemon_up else "defaults not applied yet")


def exec_regions(config: cfg.Config, metrics) -> ExecRegions:
    """The reader of the regions of `mpsd exec` under stateDir/exec; each refused region is
    counted in ``metrics`` (mpsd_regions_refused_total{kind="exec"}) unless it is None."""
    refused = None if metrics is None else functools.partial(metrics.region_refused, "exec")
    return ExecRegions(os.path.join(config.state_dir, "exec"), lambda: shim_library_path(config), refused)


def shim_library_path(config: cfg.Config) -> str:
    """libmpsshim.so for clients: shimLibrary when set (it must exist), else the shim package's."""
    if config.shim_library:
        if not os.path.isfile(config.shim_library):
            raise MpsdError(f"shimLibrary {config.shim_library!r}: no such file; expected a built libmpsshim.so")
        return config.shim_library
    try:
        import shim

        return str(shim.library_path())
    except Exception as exc:  # ShimNotFound or an import problem: one line either way
        raise MpsdError(
            f"cannot find libmpsshim.so: {exc}; build it (pip install -e .) or pass --shim-library"
        ) from exc


def sharing_backend(config: cfg.Config, inventory, gpus):
    """The node's sharing backend (mpsd/sharing), chosen once; SetupError when mps.protocol 3 cannot be had."""
    from .lifecycle.v3 import supervision_for
    from .sharing.build import build, choose_for, describe, record

    driver = None
    if inventory is not None:
        try:
            driver = inventory.driver_version()
        except InventoryError as exc:
            log.warning("driver version unknown: %s", exc)
    choice = choose_for(config, driver)
    nvml = None
    if inventory is not None and choice.protocol == 3:
        from .sharing.memory import NvmlLimits

        nvml = NvmlLimits()
    backend = build(config, choice, gpus, nvml)
    v3 = supervision_for(backend, config)
    log.info("sharing backend %s", describe(backend, choice))
    record(config.state_dir, backend, choice)  # for mpsd status
    return backend, v3


def _start_plugin(config: cfg.Config, board: HealthBoard, metrics, gpus, stop: threading.Event,
                  backend=None) -> PluginRun:
    def load():
        from .plugin import run_plugin

        return run_plugin

    return _start_service("device plugin", load, config, board, metrics, gpus, stop, backend=backend)


def _start_dra(config: cfg.Config, board: HealthBoard, metrics, gpus, stop: threading.Event,
               backend=None, driver_version: Callable[[], str] | None = None) -> PluginRun:
    def load():
        from .dra.service import run_dra

        return run_dra

    return _start_service("DRA plugin", load, config, board, metrics, gpus, stop, gpu_lister=gpus, backend=backend,
                          driver_version=driver_version)


def _start_service(
    label: str, load: Callable[[], Callable], config: cfg.Config, board: HealthBoard, metrics, gpus,
    stop: threading.Event, **extra,
) -> PluginRun:
    """Run ``load()(config, pipe_dir=..., gpus=..., started=..., ...)`` in a thread until ``stop``;
    the runner sets ``started`` once it serves; a failure to start or a stop nobody asked for is
    the run's ``problem`` (and the board's last error)."""
    plugin = PluginRun(label)
    try:
        runner = load()
    except ImportError as exc:
        plugin.problem = f"{label} not available: {exc}"
        log.error("%s", plugin.problem)
        board.update(last_error=plugin.problem)
        return plugin
    try:
        shim_library = shim_library_path(config)
    except MpsdError as exc:
        plugin.problem = f"{label} not started: {exc}"
        log.error("%s", plugin.problem)
        board.update(last_error=plugin.problem)
        return plugin

    def serve() -> None:
        try:
            runner(
                config,
                pipe_dir=config.pipe_dir,
                gpus=gpus(),
                board=board,
                metrics=metrics,
                shim_library=shim_library,
                stop=stop,
                state_dir=config.state_dir,
                started=plugin.started,
                **extra,
            )
        except MpsdError as exc:
            plugin.problem = f"{label} stopped: {exc}"
        except Exception as exc:  # a bug: the node must not look fine without its plugin
            log.exception("%s failed", label)
            plugin.problem = f"{label} stopped: {type(exc).__name__}: {exc}"
        else:
            if not stop.is_set():
                plugin.problem = f"{label} stopped without being asked to"
        if plugin.problem:
            log.error("%s", plugin.problem)
            board.update(last_error=plugin.problem)

    plugin.thread = threading.Thread(target=serve, name=label.replace(" ", "-").lower(), daemon=True)
    plugin.thread.start()
    return plugin
