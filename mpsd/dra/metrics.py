"""The DRA driver's Prometheus families: what each prepared claim consumed (its cap and thread
percentage) and what its processes use now (mpsd/dra/claimusage.py pushes the rows)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from ..metricbase import Families

CLAIM_LABELS = ("claim", "namespace", "pod", "gpu")


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
