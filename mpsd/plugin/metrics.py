"""The device plugin's Prometheus families: each allocation's memory limit and what its
processes use now (shim accounting; mpsd/plugin/usage.py pushes the rows every round)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from ..metrics.base import Families

ALLOCATION_LABELS = ("allocation", "pod", "namespace", "container", "gpu")


@dataclass(frozen=True)
class AllocationUsage:
    """One device-plugin allocation: its memory limit and what its processes use now."""

    allocation_id: str
    pod: str
    namespace: str
    container: str
    gpu: int | str
    limit_bytes: int
    used_bytes: int


class AllocationMetrics(Families):
    def _init_allocations(self, r: CollectorRegistry) -> None:
        self.allocation_used = Gauge(
            "mpsd_allocation_memory_used_bytes",
            "Device memory used by one device-plugin allocation (shim accounting)",
            list(ALLOCATION_LABELS),
            registry=r,
        )
        self.allocation_limit = Gauge(
            "mpsd_allocation_memory_limit_bytes",
            "Device memory limit of one device-plugin allocation",
            list(ALLOCATION_LABELS),
            registry=r,
        )

    def set_allocations(self, rows: Iterable[AllocationUsage]) -> None:
        limits: dict[tuple[str, ...], float] = {}
        used: dict[tuple[str, ...], float] = {}
        for row in rows:
            key = (row.allocation_id, row.pod, row.namespace, row.container, str(row.gpu))
            limits[key] = float(row.limit_bytes)
            used[key] = float(row.used_bytes)
        with self._lock:
            self._replace(self.allocation_limit, limits)
            self._replace(self.allocation_used, used)
