"""The DRA driver's Prometheus families: what each prepared claim consumed (its cap and thread
percentage) and what its processes use now (mpsd/dra/claimusage.py pushes the rows)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..metrics.base import Families

CLAIM_LABELS = ("claim", "namespace", "pod", "gpu")
DRA_GATES = ("DRAConsumableCapacity", "DRADeviceTaints")  # whose fields the API server may drop


@dataclass(frozen=True)
class ClaimUsage:
    """One prepared DRA claim on one GPU: what it consumed and what its processes use now."""

    claim: str
    namespace: str
    pod: str  # the pods of status.reservedFor, comma-separated
    gpu: int | str
    memory_bytes: int  # consumed: the cap of all its containers together
    compute_percent: float  # consumed: the active thread percentage
    used_bytes: int


class ClaimMetrics(Families):
    def _init_claims(self, r: CollectorRegistry) -> None:
        self.claim_memory = Gauge(
            "mpsd_claim_memory_bytes",
            "Device memory a prepared DRA claim consumed: the cap its containers share",
            list(CLAIM_LABELS),
            registry=r,
        )
        self.claim_compute = Gauge(
            "mpsd_claim_compute_percent",
            "Active thread percentage (percent of SMs) a prepared DRA claim consumed",
            list(CLAIM_LABELS),
            registry=r,
        )
        self.claim_used = Gauge(
            "mpsd_claim_memory_used_bytes",
            "Device memory the processes of a prepared DRA claim hold now (shim accounting)",
            list(CLAIM_LABELS),
            registry=r,
        )
        self.dra_slice_writes = Counter(
            "mpsd_dra_slice_writes",
            "ResourceSlices of the node's DRA pool written (created or replaced); each pool write bumps its generation",
            registry=r,
        )
        self.dra_fields_dropped = Gauge(
            "mpsd_dra_slice_fields_dropped",
            "1 while the API server drops fields of mpsd's ResourceSlices: the feature gate named is off there",
            ["gate"],
            registry=r,
        )
        for gate in DRA_GATES:  # exported from the start, at 0
            self.dra_fields_dropped.labels(gate).set(0)
        self.dra_device_health = Gauge(
            "mpsd_dra_device_health",
            "1 for the health mpsd reports to the kubelet for a DRA device (healthy, unhealthy, unknown)",
            ["device", "health"],
            registry=r,
        )
        self.dra_health_streams = Gauge(
            "mpsd_dra_health_streams", "DRA device health streams (NodeWatchResources) open to the kubelet", registry=r
        )
        self.dra_health_updates = Counter(
            "mpsd_dra_health_updates", "Device health lists sent to the kubelet on its streams", registry=r
        )
        self.dra_device_tainted = Gauge(
            "mpsd_dra_device_tainted",
            "1 for each GPU whose devices carry mpsd's taint in the node's ResourceSlices (reason, effect)",
            ["gpu", "reason", "effect"],
            registry=r,
        )

    def set_claims(self, rows: Iterable[ClaimUsage]) -> None:
        """The prepared DRA claims as read now; replaces the last set (an unprepared claim's series go)."""
        memory: dict[tuple[str, ...], float] = {}
        compute: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        for row in rows:
            key = (row.claim, row.namespace, row.pod, str(row.gpu))
            memory[key], compute[key], used[key] = float(row.memory_bytes), row.compute_percent, float(row.used_bytes)
        with self._lock:
            self._replace(self.claim_memory, memory)
            self._replace(self.claim_compute, compute)
            self._replace(self.claim_used, used)

    # -- ResourceSlices ------------------------------------------------------------------

    def slices_written(self, count: int) -> None:
        self.dra_slice_writes.inc(count)

    def set_slice_fields_dropped(self, gates: Iterable[str]) -> None:
        """The gates whose fields the API server dropped at the last write (1), the others 0."""
        dropped = set(gates)
        with self._lock:
            self._replace(self.dra_fields_dropped, {(g,): 1.0 if g in dropped else 0.0 for g in {*DRA_GATES, *dropped}})

    def set_device_taints(self, taints: Mapping[int, tuple[str, str]]) -> None:
        """{GPU index: (reason, effect)} of the GPUs tainted now; replaces the last set."""
        with self._lock:
            self._replace(self.dra_device_tainted, {(str(g), r, e): 1.0 for g, (r, e) in taints.items()})

    # -- device health (NodeWatchResources) ------------------------------------------------

    def set_dra_device_health(self, per_device: Mapping[str, str]) -> None:
        """device name -> "healthy" | "unhealthy" | "unknown"; replaces the last set."""
        with self._lock:
            self._replace(self.dra_device_health, dict.fromkeys(per_device.items(), 1.0))

    def set_dra_health_streams(self, count: int) -> None:
        self.dra_health_streams.set(count)

    def dra_health_sent(self) -> None:
        self.dra_health_updates.inc()
