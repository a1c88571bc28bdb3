"""Prometheus series of the MIG instances' daemons, one label set per instance
(``instance`` = the MIG UUID, ``gpu`` = the parent's index, ``profile``). Each group is replaced
as a whole, so an instance that vanishes leaves the scrape with its daemon."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge

LABELS = ("instance", "gpu", "profile")


class MigMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self._lock = threading.Lock()
        self._sets: dict[int, set[tuple[str, ...]]] = {}
        self.instances = Gauge("mpsd_mig_instances", "MIG instances served (one MPS daemon each)", registry=r)
        self.up = Gauge("mpsd_mig_daemon_up", "1 while the instance's MPS control daemon runs", LABELS, registry=r)
        self.healthy = Gauge("mpsd_mig_device_healthy",
                             "1 while the instance's slices are offered healthy (daemon up, configured, no FAULT)",
                             LABELS, registry=r)
        self.restarts = Gauge("mpsd_mig_daemon_restarts",
                              "Restarts of the instance's daemon since it was first started", LABELS, registry=r)
        self.faulted = Gauge("mpsd_mig_faulted_servers", "The instance's MPS servers in FAULT", LABELS, registry=r)
        self.impostors = Gauge("mpsd_mig_control_impostors",
                               "Control sockets of the instance found served by another process", LABELS, registry=r)
        self.defaults_restored = Gauge(
            "mpsd_mig_defaults_restored",
            "Health checks that found the instance daemon's defaults changed and put them back", LABELS, registry=r)
        self.health_seconds = Gauge("mpsd_mig_health_check_seconds",
                                    "Duration of the instance daemon's last health check", LABELS, registry=r)

    def update(self, fleet) -> None:
        """Every series from ``fleet.statuses()`` (mpsd.mig.fleet.MigFleet)."""
        rows = fleet.statuses()
        values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in
                                                           ("up", "healthy", "restarts", "faulted", "impostors",
                                                            "defaults_restored", "health_seconds")}
        for device, status, healthy in rows:
            key = (device.uuid, str(device.parent_index), device.profile)
            values["up"][key] = float(status.state == "running")
            values["healthy"][key] = float(healthy)
            values["restarts"][key] = float(status.restarts)
            values["faulted"][key] = float(sum(s == "FAULT" for s in status.server_states.values()))
            values["impostors"][key] = float(status.impostors)
            values["defaults_restored"][key] = float(status.defaults_restored)
            if status.health_latency is not None:
                values["health_seconds"][key] = status.health_latency
        with self._lock:
            self.instances.set(len(rows))
            for name, series in values.items():
                self._replace(getattr(self, name), series)

    def _replace(self, gauge: Gauge, values: Mapping[tuple[str, ...], float]) -> None:
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        for stale in self._sets.get(id(gauge), set()) - values.keys():
            gauge.remove(*stale)
        self._sets[id(gauge)] = set(values)
