"""One MPS control daemon per MIG instance, each supervised exactly like the node's whole-GPU daemon.

NVIDIA's MPS documentation ("Starting multiple control/server pairs": "use different CUDA MPS
directories to start different controllers"; "CUDA_VISIBLE_DEVICES ... the devices will be
remapped by the MPS server") and the MIG user guide ("CUDA MPS is supported on top of MIG. The
only limitation is that the maximum number of clients (48) is lowered proportionally to the
Compute Instance size"; a MIG device is named to CUDA by its ``MIG-<uuid>``) give the shape:
a control daemon per instance with

- its own pipe dir ``<mig.pipeRoot>/<MIG-uuid>`` and log dir ``<logDir>/<MIG-uuid>``,
- ``CUDA_VISIBLE_DEVICES=MIG-<uuid>``: its servers see the instance as device 0,
- the node's default active thread percentage and client priority; no default pinned memory
  limit (the node's ``pinnedMemLimit`` names whole GPUs by index; a slice carries its own).

Each daemon is an ordinary :class:`mpsd.lifecycle.supervisor.Supervisor` in a thread of its own: health
checks, restarts with backoff, defaults applied and restored, FAULT, impostor checks, its pipe
dir locked (its run lock in stateDir) against a second mpsd. :class:`MigFleet` starts and stops them as
instances appear and vanish (``reconcile``, called every inventory round), and keeps the node's
HealthBoard's ``mig_healthy`` (instances whose daemon serves, configured and without FAULT) and
``mig_layout`` current, so the faces' device health follows each instance's own daemon.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

from .. import config as cfg
from ..daemon import dirs
from ..errors import MpsdError, SetupError
from ..lifecycle.health import HealthBoard
from ..daemon.control import Control
from ..inventory.mig import CannotDivide, MigDevice, slices_for
from ..daemon.smpartition import Partitions, binary_support
from ..lifecycle.snapshot import Status
from ..lifecycle.supervisor import Supervisor
from .pause import MIG_UUID, listening, paused

log = logging.getLogger(__name__)

STOP_TIMEOUT_SLACK = 5.0  # seconds past shutdownTimeout a vanished instance's daemon is waited for


def instance_config(config: cfg.Config, device: MigDevice) -> cfg.Config:
    """The config of the daemon of ``device``: the node's, with the instance's own directories and
    device, no pinned memory default, no compute mode change, and none of the node's services.
    The instance daemons are mpsd's own children (``daemonLifecycle: owned``): the holder keeps
    the node daemon only, so an mpsd restart restarts the instance daemons (docs/mig.md)."""
    return cfg.replace(
        config,
        daemon_lifecycle="owned",
        pipe_dir=os.path.join(config.mig.pipe_root, device.uuid),
        log_dir=os.path.join(config.log_dir, device.uuid),
        visible_devices=device.uuid,
        pinned_mem_limit={},
        exclusive_process=False,  # a compute mode belongs to the GPU (nvidia-smi -i <gpu>), not to an instance
        metrics_address="",
        device_plugin=dataclasses.replace(config.device_plugin, enabled=False),
        dra=dataclasses.replace(config.dra, enabled=False),
    )


def served_pipe_dir(config: cfg.Config, uuid: str) -> str:
    """The pipe dir of the daemon mpsd runs for MIG instance ``uuid`` (``mpsd exec --mig-instance``);
    ConfigError (one line) when it is no MIG UUID or no daemon listens there."""
    from ..errors import ConfigError

    if not MIG_UUID.fullmatch(uuid):
        raise ConfigError(f"--mig-instance {uuid[:90]!r}: expected a MIG device UUID, MIG-... "
                          "(nvidia-smi -L lists them)")
    pipe_dir = os.path.join(config.mig.pipe_root, uuid)
    if dirs.client_socket_problem(Path(pipe_dir)) or not listening(pipe_dir):  # a quit daemon leaves its socket
        served = sorted(n for n in _listdir(config.mig.pipe_root)
                        if MIG_UUID.fullmatch(n) and listening(os.path.join(config.mig.pipe_root, n)))
        raise ConfigError(f"--mig-instance {uuid}: no MPS daemon of mpsd serves that instance ({pipe_dir}/control "
                          f"accepts no connection); served: {', '.join(served) or 'none'} "
                          f"(mig.pipeRoot {config.mig.pipe_root})")
    return pipe_dir


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


NO_DEVICE = "-1"  # CUDA_VISIBLE_DEVICES naming no device: CUDA stops at the first invalid entry


def whole_gpus_only(config: cfg.Config, gpus: Iterable) -> cfg.Config:
    """On a node with GPUs in MIG mode, the node daemon's CUDA_VISIBLE_DEVICES names its whole GPUs
    (unless ``visibleDevices`` says otherwise): MIG instances have daemons of their own. Where every
    GPU is in MIG mode it names none: unset, a client of the node's pipe dir would land on whichever
    MIG device CUDA lists first."""
    gpus = list(gpus)
    if not config.mig.enabled or config.visible_devices or not any(g.mig_enabled for g in gpus):
        return config
    whole = [g.uuid for g in sorted(gpus, key=lambda g: g.index) if not g.mig_enabled]
    return cfg.replace(config, visible_devices=",".join(whole) or NO_DEVICE)


def caps_problem(device: MigDevice, caps_dir: str) -> str:
    """Why a container of ``device`` could not open it: a /dev/nvidia-caps node its capabilities
    need is missing where mpsd sees the host's (an instance created after mpsd's container was,
    without the host's /dev/nvidia-caps mounted); "" when they are there or not known."""
    missing = [f"nvidia-cap{m}" for m in device.caps_minors or ()
               if not os.path.exists(os.path.join(caps_dir, f"nvidia-cap{m}"))]
    if not missing:
        return ""
    return (f"its capability node {', '.join(missing)} is missing in {caps_dir} (instances created after mpsd "
            "started need the host's /dev/nvidia-caps mounted: deploy/components/mig)")





class InstanceDaemon:
    """The supervised daemon of one MIG instance, in a thread of its own."""

    def __init__(self, device: MigDevice, config: cfg.Config, notify: Callable[[], None]) -> None:
        self.device = device
        self.config = instance_config(config, device)
        self.board = HealthBoard()
        self.problem = ""  # why it stopped on its own (a first start that could not begin)
        self._notify = notify
        c = self.config
        self._lock = dirs.hold_pipe_dir(c.pipe_dir, c.state_dir)  # SetupError: another mpsd serves it
        self.supervisor = Supervisor(self.config, self.board, gpu_indices=lambda: [0],
                                     on_status=lambda status: notify(),
                                     daemon_args=("-S",) if device.sm_partitions else ())
        self.thread = threading.Thread(target=self._run, name=f"mig-{device.uuid[4:12]}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self.supervisor.run()
        except MpsdError as exc:
            self.problem = str(exc)
            log.error("MIG instance daemon not started instance=%s error=%s", self.device.uuid, exc)
        finally:
            dirs.release_pipe_dir(self._lock)
            self._notify()

    def healthy(self) -> bool:
        return self.thread.is_alive() and self.board.current().gpu_healthy(0)

    def status(self) -> Status:
        return self.supervisor.status()

    def stop(self) -> None:
        self.supervisor.stop()


class MigFleet:
    """The daemons of the node's MIG instances; thread-safe."""

    def __init__(self, config: cfg.Config, board: HealthBoard,
                 on_change: Callable[["MigFleet"], None] | None = None, inventory=None) -> None:
        self.config = config
        self.board = board
        self._inventory = inventory  # mpsd.inventory.nvml.Inventory, read by observe()
        self._read_error = ""
        if config.mig.sm_partition_profiles:  # refused at start where the daemon cannot do it
            supported, why = binary_support(config.control_binary)
            if not supported:
                raise SetupError(f"mig.smPartitionProfiles {','.join(config.mig.sm_partition_profiles)}: static SM "
                                 f"partitions need a control binary that has them: {why}; expected "
                                 "mig.smPartitionProfiles \"\" or the nvidia-cuda-mps-control of a CUDA 13.1+ driver")
            log.info("static SM partitions for MIG profiles %s: %s", ",".join(config.mig.sm_partition_profiles), why)
        self.partitions = Partitions(self.control, self.daemon_pid)
        self._on_change = on_change  # metrics; called after every change of health or layout
        self._lock = threading.RLock()
        self._runs: dict[str, InstanceDaemon] = {}
        self._retiring: list[InstanceDaemon] = []
        self._problems: dict[str, str] = {}  # uuid -> why its daemon could not be made (logged once)
        self._unserved: list[MigDevice] = []  # instances not offered (problem set): listed unhealthy

    # -- what the faces ask ------------------------------------------------------------------

    def devices(self, unserved: bool = False) -> list[MigDevice]:
        """The instances served now (a daemon each), in (GPU, GPU instance, compute instance) order;
        ``unserved``: also those not offered (``problem`` says why; the device plugin lists them
        unhealthy, the DRA driver leaves them out)."""
        with self._lock:
            found = [r.device for r in self._runs.values()] + (list(self._unserved) if unserved else [])
        return sorted(found, key=lambda d: (d.parent_index, d.gpu_instance, d.compute_instance))

    def get(self, uuid: str) -> InstanceDaemon | None:
        with self._lock:
            return self._runs.get(uuid)

    def pipe_dir(self, uuid: str) -> str | None:
        run = self.get(uuid)
        return None if run is None else run.config.pipe_dir

    def device(self, uuid: str) -> MigDevice | None:
        run = self.get(uuid)
        return None if run is None else run.device

    def daemon_pid(self, uuid: str) -> int | None:
        run = self.get(uuid)
        return None if run is None else run.status().pid

    def control(self, uuid: str) -> Control:
        run = self.get(uuid)
        if run is None:
            from ..errors import ControlError

            raise ControlError(f"MIG instance {uuid} is not served")
        c = run.config
        return Control(c.control_binary, c.pipe_dir, c.log_dir, c.health_timeout)

    # -- the inventory round ------------------------------------------------------------------

    def observe(self, gpus: list) -> None:
        """One inventory round (mpsd.node.InventoryPump): the instances of ``gpus`` read from NVML
        and reconciled. NVML failing keeps the daemons as they are (one line per new error)."""
        from ..errors import InventoryError

        try:
            devices = self._inventory.mig_devices(gpus, self.config.mig.caps_file)
        except InventoryError as exc:
            if str(exc) != self._read_error:
                log.warning("MIG layout not read, daemons kept as they are: %s", exc)
            self._read_error = str(exc)
            return
        self._read_error = ""
        self.reconcile(devices)

    def reconcile(self, devices: Iterable[MigDevice]) -> None:
        """Start a daemon for each new instance, stop those of instances that vanished; a daemon
        whose first start failed is tried again. The same UUID is the same instance (NVML: UUIDs are
        immutable for the lifetime of a MIG device)."""
        changed = False
        with self._lock:
            divided = [self._divided(d) for d in ([] if paused(self.config) else devices)]
            current = {d.uuid: d for d in divided if not d.problem}
            unserved = [d for d in divided if d.problem]
            changed = [d.uuid for d in unserved] != [d.uuid for d in self._unserved]
            self._unserved = unserved
            for uuid in [u for u, r in self._runs.items() if u not in current or not r.thread.is_alive()]:
                run = self._runs.pop(uuid)
                changed = True
                if uuid not in current:
                    log.warning("MIG instance gone, stopping its daemon instance=%s", run.device.describe())
                run.stop()
                self._retiring.append(run)
            for uuid, device in current.items():
                if uuid in self._runs:
                    continue
                try:
                    run = InstanceDaemon(device, self.config, self._health_changed)
                except MpsdError as exc:
                    if self._problems.get(uuid) != str(exc):
                        log.error("MIG instance not served instance=%s error=%s", device.describe(), exc)
                    self._problems[uuid] = str(exc)
                    continue
                self._problems.pop(uuid, None)
                self._runs[uuid] = run
                run.start()
                changed = True
                log.info("MIG instance served instance=%s pipe_dir=%s", device.describe(), run.config.pipe_dir)
            self._retiring = [r for r in self._retiring if r.thread.is_alive()]
            known = set(current) | {d.uuid for d in unserved}
            for key in [k for k in self._problems if k.rpartition(":")[2] not in known]:
                del self._problems[key]
        if changed:
            self.board.update(mig_layout=self.board.current().mig_layout + 1)
        self._health_changed()

    def _divided(self, device: MigDevice) -> MigDevice:
        """``device`` with the slices the faces offer (0, said once, when the config cannot divide it),
        or with ``problem`` set (said once) when it cannot be offered at all."""
        problem = device.problem or caps_problem(device, self.config.mig.caps_dir)
        if problem:
            if self._problems.get("offer:" + device.uuid) != problem:
                log.error("MIG instance not offered instance=%s problem=%s", device.describe(), problem)
            self._problems["offer:" + device.uuid] = problem
            device = dataclasses.replace(device, problem=problem)
        try:
            n = slices_for(device, self.config.mig.slices_per_instance, self.config.device_plugin.slices_per_gpu)
        except CannotDivide as exc:
            if self._problems.get("divide:" + device.uuid) != str(exc):
                log.error("MIG instance not offered (its daemon runs): %s", exc)
            self._problems["divide:" + device.uuid] = str(exc)
            n = 0
        return dataclasses.replace(device, slices=n,
                                   sm_partitions=device.profile in self.config.mig.sm_partition_profiles)

    def _health_changed(self) -> None:
        with self._lock:
            healthy = frozenset(u for u, r in self._runs.items() if r.healthy())
        self.board.update(mig_healthy=healthy)
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:  # a metrics bug must not stop supervision
                log.exception("MIG fleet observer failed")

    def statuses(self) -> list[tuple[MigDevice, Status, bool]]:
        """(instance, its supervisor's status, healthy) for every served instance."""
        with self._lock:
            runs = list(self._runs.values())
        return [(r.device, r.status(), r.healthy()) for r in runs]

    def stop(self) -> None:
        """Stop every daemon (quit, bounded by shutdownTimeout each, all at once) and wait for them."""
        with self._lock:
            runs = list(self._runs.values()) + self._retiring
            self._runs.clear()
            self._retiring = []
        for run in runs:
            run.stop()
        for run in runs:
            run.thread.join(self.config.shutdown_timeout + STOP_TIMEOUT_SLACK)
            if run.thread.is_alive():
                log.error("MIG instance daemon did not stop instance=%s", run.device.uuid)
