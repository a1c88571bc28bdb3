"""The node's own Prometheus families, the supervisor's face: the MPS control daemon (up,
restarts, health checks, the last error, servers, faults, the control plane's verdicts), the
GPUs and MPS clients NVML lists, and the regions of mpsd exec (with the refusals of every
region kind). mpsd.registry.Metrics puts them together with the device plugin's and DRA's."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .base import Families

if TYPE_CHECKING:
    from .regions import RegionUsage
    from ..inventory.nvml import Client, Gpu

HEALTH_CHECK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_ERROR_LABEL = 200  # characters of the last error kept as a label value
REGION_KINDS = ("allocation", "exec")  # a device-plugin allocation's region, an mpsd exec region
# why a region was refused (shim.RegionError.reason); "missing" (gone meanwhile) is no refusal
REFUSAL_REASONS = ("corrupted", "not_regular", "too_large", "unreadable")


class SupervisorMetrics(Families):
    def _init_supervisor(self, r: CollectorRegistry) -> None:
        self._restarts_seen = 0  # update_supervisor's view of the previous snapshot
        self._latency_seen: float | None = None
        self._error_seen = ""
        self.daemon_up = Gauge("mpsd_daemon_up", "1 while the MPS control daemon is running", registry=r)
        self.standby = Gauge(
            "mpsd_standby", "1 while this mpsd stands by: another mpsd run supervises the daemon",
            registry=r,
        )
        self.daemon_restarts = Counter(
            "mpsd_daemon_restarts", "Restarts of the MPS control daemon by the supervisor", registry=r
        )
        self.health_check_seconds = Histogram(
            "mpsd_health_check_seconds",
            "Duration of one health check of the control daemon",
            buckets=HEALTH_CHECK_BUCKETS,
            registry=r,
        )
        self.last_error_info = Gauge(
            "mpsd_last_error_info",
            "The last error the supervisor saw (value 1, text in the label)",
            ["message"],
            registry=r,
        )
        self.last_error_timestamp = Gauge(
            "mpsd_last_error_timestamp_seconds", "Unix time of the last error (0: none yet)", registry=r
        )
        self.mps_servers = Gauge("mpsd_mps_servers", "MPS servers running per GPU", ["gpu"], registry=r)
        self.mps_clients = Gauge("mpsd_mps_clients", "MPS client processes per GPU (NVML)", ["gpu"], registry=r)
        self.client_memory = Gauge(
            "mpsd_client_memory_bytes",
            "Device memory used by one MPS client process (NVML)",
            ["gpu", "pid"],
            registry=r,
        )
        self.gpu_memory_total = Gauge(
            "mpsd_gpu_memory_total_bytes", "Device memory of the GPU (NVML)", ["gpu", "uuid"], registry=r
        )
        self.gpu_memory_used = Gauge(
            "mpsd_gpu_memory_used_bytes", "Device memory in use on the GPU (NVML)", ["gpu", "uuid"], registry=r
        )
        self.config_generation = Gauge(
            "mpsd_config_generation",
            "Generation of the applied MPS configuration (bumped on every re-apply)",
            registry=r,
        )
        self.device_healthy = Gauge(
            "mpsd_device_healthy", "1 if the GPU is offered as healthy to the kubelet", ["gpu"], registry=r
        )
        self.fault_terminations = Counter(
            "mpsd_fault_terminations",
            "Clients of an MPS server in FAULT ended by faultPolicy terminate, by how",
            ["method"],
            registry=r,
        )
        for method in ("terminate_client", "sigkill"):  # exported from the start, at 0
            self.fault_terminations.labels(method)
        self._terminations_seen: dict[str, int] = {}
        self.control_impostors = Counter(
            "mpsd_control_impostors",
            "Control sockets found served by another process than mpsd's daemon (the daemon is restarted)",
            registry=r,
        )
        self.defaults_restored = Counter(
            "mpsd_defaults_restored",
            "Health checks that found the daemon's defaults changed (any UID can set them) and put them back",
            registry=r,
        )
        self.verdict_age = Gauge(
            "mpsd_health_verdict_age_seconds",
            "Seconds since the last conclusive health check (grows while a held control session blinds it)",
            registry=r,
        )
        self.defaults_contested = Gauge(
            "mpsd_defaults_contested_seconds",
            "Seconds the daemon's defaults have been found changed (and put back) at every health check in a row",
            registry=r,
        )
        self._control_seen = (0, 0)  # (impostors, defaults restored) of the previous snapshot
        self.multi_user = Gauge(
            "mpsd_mps_multi_user",
            "1 while the MPS daemon serves every UID from one server (-multiuser-server), 0 one UID at a time",
            registry=r,
        )
        self.clients_waiting = Gauge(
            "mpsd_mps_clients_waiting",
            "CUDA clients the MPS daemon holds waiting for a server of another UID (at the last health check)",
            registry=r,
        )
        self.mps_servers_faulted = Gauge(
            "mpsd_mps_servers_faulted", "MPS servers in FAULT at the last health check", registry=r
        )
        self.region_cap = Gauge(
            "mpsd_region_memory_cap_bytes",
            "Memory cap of one device of an mpsd exec region (shim accounting)",
            ["region", "device"],
            registry=r,
        )
        self.region_used = Gauge(
            "mpsd_region_memory_used_bytes",
            "Device memory held by the processes of an mpsd exec region (shim accounting)",
            ["region", "device"],
            registry=r,
        )
        self.region_process = Gauge(
            "mpsd_region_process_memory_bytes",
            "Device memory held by one live process of an mpsd exec region (shim accounting)",
            ["region", "device", "pid"],
            registry=r,
        )
        self.regions_refused = Counter(
            "mpsd_regions_refused",
            "Reads of a region mpsd refused (every round that refuses it counts), by region kind and why",
            ["kind", "reason"],
            registry=r,
        )
        for kind in REGION_KINDS:  # exported from the start, at 0: increase() sees the first refusal
            for reason in REFUSAL_REASONS:
                self.regions_refused.labels(kind, reason)

    # -- supervisor --------------------------------------------------------------------

    def set_daemon_up(self, up: bool) -> None:
        self.daemon_up.set(1 if up else 0)

    def set_standby(self, standing_by: bool) -> None:
        self.standby.set(1 if standing_by else 0)

    def daemon_restarted(self) -> None:
        self.daemon_restarts.inc()

    def observe_health_check(self, seconds: float) -> None:
        self.health_check_seconds.observe(seconds)

    def set_last_error(self, message: str, when: float | None = None) -> None:
        """Record the latest error; only the latest message is exported. "" clears it."""
        text = " ".join(message.split())[:MAX_ERROR_LABEL]
        with self._lock:
            self._replace(self.last_error_info, {(text,): 1.0} if text else {})
            if text:
                self.last_error_timestamp.set(time.time() if when is None else when)

    def set_config_generation(self, generation: int) -> None:
        self.config_generation.set(generation)

    def set_faulted_servers(self, count: int) -> None:
        self.mps_servers_faulted.set(count)

    def set_mps_servers(self, per_gpu: Mapping[int, int] | Mapping[str, int]) -> None:
        with self._lock:
            self._replace(self.mps_servers, {(str(gpu),): float(n) for gpu, n in per_gpu.items()})

    def set_device_health(self, per_gpu: Mapping[int, bool]) -> None:
        with self._lock:
            self._replace(self.device_healthy, {(str(gpu),): 1.0 if ok else 0.0 for gpu, ok in per_gpu.items()})

    def update_supervisor(
        self,
        *,
        daemon_up: bool,
        restarts: int,
        health_latency: float | None,
        last_error: str,
        servers: int | Mapping[int, int],
        config_generation: int,
    ) -> None:
        """One supervisor status snapshot (mpsd.node pushes one per change). ``restarts`` is
        the running total: the counter advances by the difference. Snapshots repeat the last
        latency and error, so a latency is observed and an error stamped only when it
        changes. ``servers`` as a plain count is exported with gpu="all"."""
        with self._lock:
            new_restarts = max(restarts - self._restarts_seen, 0)
            self._restarts_seen = restarts
            new_latency = health_latency is not None and health_latency != self._latency_seen
            self._latency_seen = health_latency
            new_error = last_error != self._error_seen
            self._error_seen = last_error
        self.set_daemon_up(daemon_up)
        if new_restarts:
            self.daemon_restarts.inc(new_restarts)
        if new_latency:
            self.observe_health_check(float(health_latency))  # type: ignore[arg-type]
        if new_error:
            self.set_last_error(last_error)
        self.set_mps_servers({"all": servers} if isinstance(servers, int) else servers)
        self.set_config_generation(config_generation)

    def set_control_plane(
        self, impostors: int, defaults_restored: int, verdict_age: float, defaults_contested: float = 0.0
    ) -> None:
        """Running totals from the supervisor: the counters advance by the difference."""
        with self._lock:
            seen_impostors, seen_restored = self._control_seen
            self._control_seen = (max(impostors, seen_impostors), max(defaults_restored, seen_restored))
        if impostors > seen_impostors:
            self.control_impostors.inc(impostors - seen_impostors)
        if defaults_restored > seen_restored:
            self.defaults_restored.inc(defaults_restored - seen_restored)
        self.verdict_age.set(verdict_age)
        self.defaults_contested.set(defaults_contested)

    def set_uid_sharing(self, multi_user: bool | None, waiting: int) -> None:
        """How the daemon shares a GPU between UIDs (mpsd.daemon.multiuser); multi_user None: not known yet."""
        if multi_user is not None:
            self.multi_user.set(1.0 if multi_user else 0.0)
        self.clients_waiting.set(float(waiting))

    def set_fault_terminations(self, totals: Mapping[str, int]) -> None:
        """Running totals per method (terminate_client, sigkill): each counter advances by the
        difference to the last totals seen."""
        with self._lock:
            for method, total in totals.items():
                new = total - self._terminations_seen.get(method, 0)
                if new > 0:
                    self.fault_terminations.labels(method).inc(new)
                self._terminations_seen[method] = max(total, self._terminations_seen.get(method, 0))

    # -- inventory ---------------------------------------------------------------------

    def observe_inventory(self, gpus: Iterable[Gpu], clients: Iterable[Client]) -> None:
        """GPU memory and MPS clients from one inventory pass; replaces the previous pass.
        A client whose memory NVML cannot tell is counted but has no memory series."""
        total: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        per_gpu: dict[tuple[str, ...], float] = {}
        memory: dict[tuple[str, ...], float] = {}
        for gpu in gpus:
            total[(str(gpu.index), gpu.uuid)] = float(gpu.memory_total)
            used[(str(gpu.index), gpu.uuid)] = float(gpu.memory_used)
            per_gpu[(str(gpu.index),)] = 0.0
        for client in clients:
            key = (str(client.gpu_index),)
            per_gpu[key] = per_gpu.get(key, 0.0) + 1
            if client.used_memory is not None:
                mkey = (str(client.gpu_index), str(client.pid))
                memory[mkey] = memory.get(mkey, 0.0) + float(client.used_memory)
        with self._lock:
            self._replace(self.gpu_memory_total, total)
            self._replace(self.gpu_memory_used, used)
            self._replace(self.mps_clients, per_gpu)
            self._replace(self.client_memory, memory)

    def update_gpus(self, gpus: Iterable[Gpu], clients: Iterable[Client]) -> None:
        """Alias of observe_inventory (the name mpsd.node calls)."""
        self.observe_inventory(gpus, clients)

    # -- mpsd exec regions ---------------------------------------------------------------

    def set_regions(self, rows: Iterable[RegionUsage]) -> None:
        """The regions of mpsd exec (mpsd.metrics.regions) as read now; replaces the last set."""
        cap: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        per_process: dict[tuple[str, ...], float] = {}
        for row in rows:
            key = (row.region, str(row.device))
            cap[key] = float(row.cap_bytes)
            used[key] = float(row.used_bytes)
            for pid, nbytes in row.processes:
                per_process[key + (str(pid),)] = float(nbytes)
        with self._lock:
            self._replace(self.region_cap, cap)
            self._replace(self.region_used, used)
            self._replace(self.region_process, per_process)

    def region_refused(self, kind: str, error: BaseException) -> bool:
        """Count one refused read of a region of ``kind`` (REGION_KINDS) if ``error`` is a
        refusal: a shim.RegionError whose reason is one of REFUSAL_REASONS. A region that was
        gone by the time it was opened, or any other error, is not counted. True if counted."""
        if kind not in REGION_KINDS:
            raise ValueError(f"region kind {kind!r}: expected one of {', '.join(REGION_KINDS)}")
        reason = getattr(error, "reason", None)
        if reason not in REFUSAL_REASONS:
            return False
        self.regions_refused.labels(kind, reason).inc()
        return True
