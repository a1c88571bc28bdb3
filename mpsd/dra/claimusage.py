"""Per-claim metrics: what each prepared claim consumed (its cap and thread percentage) and what
its processes hold now in its shim regions (one per request, mpsd/dra/cdi.py), one row per claim
and GPU for ``Metrics.set_claims``.

The region is read through the allocation core's reader (mpsd.alloc.usage.shim_usage: a private
copy of a pod's file, refused when it is a symlink, a FIFO or too large)."""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Mapping

from ..logs import OncePerKey
from .metrics import ClaimUsage
from ..alloc.usage import UsageReader
from .cdi import region_file
from .prepared import PreparedClaim

log = logging.getLogger(__name__)


def claim_rows(claims: Iterable[PreparedClaim], used: Mapping[str, Mapping[int, int]]) -> list[ClaimUsage]:
    """``used``: claim UID -> bytes per GPU (host index). GPUs labelled by host index."""
    return [
        ClaimUsage(
            claim=c.name, namespace=c.namespace, pod=",".join(sorted(c.pods)), gpu=g.index,
            memory_bytes=g.memory_limit, compute_percent=c.active_thread_percentage,
            used_bytes=int(used.get(c.uid, {}).get(g.index, 0)),
        )
        for c in claims
        for g in c.gpus
    ]


class ClaimUsageReader:
    """One round: read every prepared claim's region, push the rows. A region that cannot be
    read counts as 0 used, with one warning per directory."""

    def __init__(self, prepared: Callable[[], list[PreparedClaim]], reader: UsageReader, metrics) -> None:
        self.prepared, self.reader, self.metrics = prepared, reader, metrics
        self._warned = OncePerKey()

    def tick(self) -> list[ClaimUsage]:
        claims = self.prepared()
        used = {c.uid: self._read(c) for c in claims}
        rows = claim_rows(claims, used)
        if self.metrics is not None:
            self.metrics.set_claims(rows)
        return rows

    def _read(self, claim: PreparedClaim) -> Mapping[int, int]:
        """Bytes per GPU (host index): each request's region, its ordinals mapped to its GPUs."""
        used: dict[int, int] = {}
        for request, plan in claim.request_plans():
            path = os.path.join(claim.region_dir, region_file(request))
            try:
                per_ordinal = self.reader(path)
            except Exception as exc:  # noqa: BLE001 - a pod's damaged region must not stop the others
                if self.metrics is not None:  # a claim's region is an allocation directory's (the plugin's core)
                    self.metrics.region_refused("allocation", exc)  # every round, as the device plugin counts
                if self._warned.first(path):
                    log.warning("cannot read usage claim=%s/%s path=%s error=%s", claim.namespace, claim.name, path,
                                exc)
                continue
            index = {g.ordinal: g.index for g in plan.gpus}
            for ordinal, nbytes in per_ordinal.items():
                if ordinal in index:
                    used[index[ordinal]] = used.get(index[ordinal], 0) + int(nbytes)
        return used
