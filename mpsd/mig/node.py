"""The MIG part of ``mpsd run`` (mpsd/node.py wires it): the instance daemons fed by every inventory
round, the node daemon kept to the whole GPUs, the faces given the instances (docs/mig.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .. import config as cfg
from ..lifecycle.health import HealthBoard
from .fleet import MigFleet, whole_gpus_only

if TYPE_CHECKING:
    from ..sharing import Backend


class MigNode:
    def __init__(self, fleet: MigFleet, metrics) -> None:
        self.fleet = fleet
        self.allocation_metrics = None  # the MIG device plugins' part of the allocation series
        if metrics is not None:
            from .plugin import SharedAllocations

            self._shared = SharedAllocations(metrics)
            self.allocation_metrics = self._shared
        self._metrics = metrics

    @classmethod
    def create(cls, config: cfg.Config, board: HealthBoard, inventory, metrics) -> "MigNode | None":
        """None when mig.enabled is false or NVML is missing; SetupError when the config asks what
        the control binary cannot do (static SM partitions)."""
        if not config.mig.enabled or inventory is None:
            return None
        from .metrics import MigMetrics

        on_change = MigMetrics(metrics.registry).update if metrics is not None else None
        return cls(MigFleet(config, board, on_change=on_change, inventory=inventory), metrics)

    def node_config(self, config: cfg.Config, reload: Callable[[], cfg.Config] | None,
                    listed: Callable[[], list]) -> tuple[cfg.Config, Callable[[], cfg.Config] | None]:
        """The node daemon's config (and reload) seeing the whole GPUs only, on a mixed node."""
        wrapped = None if reload is None else (lambda: whole_gpus_only(reload(), listed()))
        return whole_gpus_only(config, listed()), wrapped

    def plugin_metrics(self, metrics):
        """What the whole-GPU device plugin reports allocations to: its part of the shared group."""
        return metrics if metrics is None else self._shared.part("gpu")

    def faces(self, config: cfg.Config, backend: Backend,
              gpus: Callable[[], list]) -> tuple[Backend, Callable[[], list]]:
        """(the node's backend with MIG requests routed to the instances' daemons, the DRA driver's
        devices: the whole GPUs and the instances served)."""
        from ..sharing.build import host_paths
        from ..sharing.mig import MigBackend, Routed

        fleet = self.fleet
        mig = MigBackend(host_paths(config), fleet.pipe_dir, device=fleet.device, partitions=fleet.partitions)
        return Routed(backend, mig), (lambda: [*gpus(), *fleet.devices()])  # the unserved are not published
