"""Every face's Prometheus families in one registry: the node's own (mpsd/metrics/node.py), the
device plugin's (mpsd/plugin/metrics.py) and the DRA driver's (mpsd/dra/metrics.py), scraped in
this order by mpsd/metrics/http.py. Part of the composition root: it imports the faces, so
nothing below them imports it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from .dra.metrics import ClaimMetrics
from .metrics.node import SupervisorMetrics
from .plugin.metrics import AllocationMetrics


class Metrics(SupervisorMetrics, AllocationMetrics, ClaimMetrics):
    """Every face's families in one registry (scraped in this order)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._init_supervisor(self.registry)
        self._init_allocations(self.registry)
        self._init_claims(self.registry)
