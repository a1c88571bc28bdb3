"""The ``nvidia-cuda-mps-control -f`` child process and the wiring of ``mpsd run`` (supervisor +
NVML inventory + metrics/probes + device plugin). ``mpsd status`` is in mpsd/status.py."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from . import config as cfg
from .errors import InventoryError, MpsdError, PluginError, SetupError
from .health import HealthBoard

if TYPE_CHECKING:
    from .supervisor import Status

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# Run by the interpreter in the child, in place of a preexec_fn: forking a threaded process
# (gRPC's device plugin) and running Python before exec crashed that child now and then.
# prctl(PR_SET_PDEATHSIG) survives the exec: the daemon is SIGKILLed when the thread that
# started it (the supervisor loop) dies, so a SIGKILLed mpsd leaves no daemon behind whose
# control_lock would stop the next ``mpsd run`` on that pipe dir.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('mpsd exited before its control daemon started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def daemon_command(binary: str) -> list[str]:
    """The command line that becomes ``BINARY -f`` (through _DIE_WITH_PARENT on Linux)."""
    path = shutil.which(binary)
    if path is None:
        raise SetupError(
            f"cannot start control binary {binary!r}: not found or not executable; "
            "expected a name on PATH or an absolute path"
        )
    if not sys.platform.startswith("linux") or not sys.executable:
        return [path, "-f"]
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), os.path.abspath(path), "-f"]


class DaemonProcess:
    """One ``nvidia-cuda-mps-control -f`` child: its log goes to logDir/control.log. It is
    killed by the kernel if the thread that started it (the supervisor loop) dies."""

    def __init__(self, config: cfg.Config, on_exit: Callable[["DaemonProcess", int], None]) -> None:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = config.pipe_dir
        env["CUDA_MPS_LOG_DIRECTORY"] = config.log_dir
        env.pop("CUDA_VISIBLE_DEVICES", None)
        for name in (
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "CUDA_MPS_CLIENT_PRIORITY",
        ):
            env.pop(name, None)  # mpsd's own environment must not change the daemon's defaults
        if config.visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = config.visible_devices
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # indices as nvidia-smi and NVML number them
        try:
            self.proc = subprocess.Popen(
                daemon_command(config.control_binary),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise SetupError(f"cannot start control binary {config.control_binary!r}: {exc.strerror}") from exc
        self.pid = self.proc.pid
        self.started = time.monotonic()
        self.returncode: int | None = None
        self._log_path = os.path.join(config.log_dir, "control.log")
        threading.Thread(target=self._pump, name=f"mps-log-{self.pid}", daemon=True).start()
        threading.Thread(target=self._wait, args=(on_exit,), name=f"mps-wait-{self.pid}", daemon=True).start()
        log.info("daemon started pid=%d binary=%s pipe_dir=%s", self.pid, config.control_binary, config.pipe_dir)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            out = open(self._log_path, "ab")
        except OSError as exc:
            log.warning("cannot write daemon log path=%s error=%s", self._log_path, exc.strerror)
            out = None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if out is not None:
                    out.write(line)
                    out.flush()
                text = line.decode(errors="replace").rstrip()
                level = logging.WARNING if (b"exited with status" in line or b"fatal" in line) else logging.DEBUG
                log.log(level, "daemon pid=%d says %s", self.pid, text)
        if out is not None:
            out.close()

    def _wait(self, on_exit: Callable[["DaemonProcess", int], None]) -> None:
        self.returncode = self.proc.wait()
        on_exit(self, self.returncode)

    def alive(self) -> bool:
        return self.returncode is None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the daemon and everything in its session (its servers). The daemon itself
        only while it is not reaped: its PID may belong to another process by then. Its group
        ID stays reserved while a member (a server) is left, so the group is signalled always."""
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: self.proc.send_signal(signal.SIGKILL)):
            try:
                target()
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                log.error("cannot kill daemon pid=%d error=%s", self.pid, exc)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def open_inventory(config: cfg.Config):
    try:
        from .inventory import Inventory

        return Inventory(library_path=config.nvml_library)
    except (InventoryError, ImportError, OSError) as exc:
        log.warning("NVML not available, running without GPU inventory: %s", exc)
        return None


def managed_gpus(gpus: list, visible_devices: str | None) -> list:
    """The GPUs the daemon serves: those ``visibleDevices`` names by index (nvidia-smi's
    numbering, which the daemon gets through CUDA_DEVICE_ORDER=PCI_BUS_ID) or UUID; all of
    them without it, or when it names MIG devices (NVML's GPU list cannot match those)."""
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
        self, inventory, metrics, board: HealthBoard, visible_devices: str | None = None, regions=None
    ) -> None:
        self._inventory, self._metrics, self._board = inventory, metrics, board
        self._regions = regions  # mpsd.exec_regions.ExecRegions: read in this thread too
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

    def refresh(self) -> None:
        if self._metrics is not None and self._regions is not None:
            self._metrics.set_regions(self._regions())
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
        pump.request()  # also when down: the device health series follows the board

    return observe


def run(config: cfg.Config, reload: Callable[[], cfg.Config] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 on a clean stop. Raises MpsdError when it cannot start."""
    from .exec_regions import ExecRegions
    from .supervisor import Supervisor  # it imports DaemonProcess from here

    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger().setLevel(config.log_level.upper())
    log.info("config source=%s %s", config.source or "-", cfg.describe(config))
    board = HealthBoard()
    inventory = open_inventory(config)
    gpus = _gpu_lister(inventory, config.visible_devices)
    metrics = server = None
    if config.metrics_address:
        from .metrics import Metrics, serve

        metrics = Metrics()
    regions = ExecRegions(os.path.join(config.state_dir, "exec"), lambda: shim_library_path(config))
    pump = InventoryPump(inventory, metrics, board, config.visible_devices, regions)
    pump.refresh()  # the GPU indices, before any health check needs them
    supervisor = Supervisor(
        config,
        board,
        reload=reload,
        gpu_indices=pump.gpu_indices,
        on_status=_observer(metrics, pump),
    )
    supervisor.install_signal_handlers()  # before anything slow: a SIGTERM now is a clean stop
    plugin: PluginRun | None = None  # read by the readiness probe when it is called
    if metrics is not None:
        live = supervisor.loop_alive.is_set
        server = serve(config.metrics_address, metrics, live=live, ready=lambda: _ready(board, plugin))
        log.info("metrics listening address=%s paths=/metrics,/healthz,/readyz", config.metrics_address)
    stop_plugin = threading.Event()
    plugin = _start_plugin(config, board, metrics, gpus, stop_plugin) if config.device_plugin.enabled else None
    try:
        return supervisor.run()
    finally:
        stop_plugin.set()
        if plugin is not None and plugin.thread is not None:
            plugin.thread.join(10)
        if server is not None:
            server.close()
        pump.close()
        if inventory is not None:
            inventory.close()


class PluginRun:
    """The device plugin's thread, and why it is not serving if so ("" while it serves)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.problem = ""


def _ready(board: HealthBoard, plugin: PluginRun | None = None) -> tuple[bool, str]:
    """Ready: daemon up and configured, and the device plugin (when enabled) serving. A plugin
    that is down makes only /readyz fail: failing liveness would restart mpsd, and with it the
    daemon under every running client."""
    state = board.current()
    if plugin is not None and plugin.problem:
        return False, plugin.problem
    if state.daemon_up and state.configured:
        return True, ""
    return False, state.last_error or ("daemon starting" if not state.daemon_up else "defaults not applied yet")


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


def _start_plugin(config: cfg.Config, board: HealthBoard, metrics, gpus, stop: threading.Event) -> PluginRun:
    plugin = PluginRun()
    try:
        from .plugin import run_plugin
    except ImportError as exc:
        plugin.problem = f"device plugin not available: {exc}"
        log.error("%s", plugin.problem)
        board.update(last_error=plugin.problem)
        return plugin
    try:
        shim_library = shim_library_path(config)
    except MpsdError as exc:
        plugin.problem = f"device plugin not started: {exc}"
        log.error("%s", plugin.problem)
        board.update(last_error=plugin.problem)
        return plugin

    def serve() -> None:
        try:
            run_plugin(
                config,
                pipe_dir=config.pipe_dir,
                gpus=gpus(),
                board=board,
                metrics=metrics,
                shim_library=shim_library,
                stop=stop,
                state_dir=config.state_dir,
            )
        except (PluginError, MpsdError) as exc:
            plugin.problem = f"device plugin stopped: {exc}"
        except Exception as exc:  # a bug: the node must not look fine without its plugin
            log.exception("device plugin failed")
            plugin.problem = f"device plugin stopped: {type(exc).__name__}: {exc}"
        else:
            if not stop.is_set():
                plugin.problem = "device plugin stopped without being asked to"
        if plugin.problem:
            log.error("%s", plugin.problem)
            board.update(last_error=plugin.problem)

    plugin.thread = threading.Thread(target=serve, name="device-plugin", daemon=True)
    plugin.thread.start()
    return plugin
