"""What every face's Prometheus families share: one registry, one lock, and label groups that
are replaced as a whole (a label set that disappears, a pid that exited or a pod that left,
disappears from the scrape too). mpsd.registry.Metrics puts the faces' families together."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge, generate_latest


class Families:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._label_sets: dict[int, set[tuple[str, ...]]] = {}  # id(gauge) → label sets set last

    def _replace(self, gauge: Gauge, values: Mapping[tuple[str, ...], float]) -> None:
        """Set every label set in ``values`` and remove the ones set last time but not now
        (new values first, so a scrape never sees the group empty). Caller holds _lock."""
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        for stale in self._label_sets.get(id(gauge), set()) - values.keys():
            gauge.remove(*stale)
        self._label_sets[id(gauge)] = set(values)

    def scrape(self) -> bytes:
        """The registry in Prometheus text format (what GET /metrics returns)."""
        return generate_latest(self.registry)
