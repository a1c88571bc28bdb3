"""No series outlives what it describes: once a pod's allocation, a DRA claim, an exec region, a process or
a GPU client goes, its series leave the scrape (every per-entity family is replaced as a
whole, mpsd.registry.Metrics._replace), and churn through many pods and regions leaves the
series count where it started. Every labelled family of Metrics is either one of those
replaced here or has labels from a fixed set of values only, so a new per-entity family
fails this test until it is covered."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.metrics_cardinality import world
from mpsd.registry import Metrics

BOUNDED = {"method", "kind", "reason", "gate"}  # label values from a fixed set in the code, never from a pod or pid
REPLACED = {  # family -> the setter that replaces its labelled group (exercised below)
    "mpsd_last_error_info": "set_last_error",
    "mpsd_mps_servers": "set_mps_servers",
    "mpsd_mps_clients": "observe_inventory",
    "mpsd_client_memory_bytes": "observe_inventory",
    "mpsd_gpu_memory_total_bytes": "observe_inventory",
    "mpsd_gpu_memory_used_bytes": "observe_inventory",
    "mpsd_device_healthy": "set_device_health",
    "mpsd_allocation_memory_used_bytes": "set_allocations",
    "mpsd_allocation_memory_limit_bytes": "set_allocations",
    "mpsd_region_memory_cap_bytes": "set_regions",
    "mpsd_region_memory_used_bytes": "set_regions",
    "mpsd_region_process_memory_bytes": "set_regions",
    "mpsd_claim_memory_bytes": "set_claims",
    "mpsd_claim_compute_percent": "set_claims",
    "mpsd_claim_memory_used_bytes": "set_claims",
    "mpsd_dra_device_tainted": "set_device_taints",
    "mpsd_dra_device_health": "set_dra_device_health",
}


def series(m: Metrics) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Sample name -> label sets in one scrape (without the _created timestamps)."""
    out: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for family in text_string_to_metric_families(m.scrape().decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):
                out.setdefault(s.name, set()).add(tuple(sorted(s.labels.items())))
    return out


def count(m: Metrics) -> int:
    return sum(len(v) for v in series(m).values())


def test_every_labelled_family_is_replaced_as_a_whole_or_bounded() -> None:
    m = Metrics()
    families = [v for v in vars(m).values() if isinstance(v, (Gauge, Counter, Histogram))]
    per_entity = {f._name for f in families if set(f._labelnames) - BOUNDED}
    assert per_entity == set(REPLACED), "a new labelled family: replace it as a whole and add it to REPLACED"


def test_series_of_gone_pods_regions_processes_and_errors_leave_the_scrape() -> None:
    m = Metrics()
    world(m, "a", pods=3, regions=2, claims=2)
    before = series(m)
    assert {name for name in REPLACED if before.get(name)} == set(REPLACED)
    world(m, "b", pods=0, regions=0, gpus=1)
    m.set_last_error("")
    after = series(m)
    kept = {(name, labels) for name in REPLACED for labels in after.get(name, set()) & before[name]}
    assert kept == {(name, (("gpu", "0"),)) for name in ("mpsd_mps_servers", "mpsd_mps_clients", "mpsd_device_healthy")}
    for name in ("mpsd_allocation_memory_used_bytes", "mpsd_region_process_memory_bytes", "mpsd_client_memory_bytes",
                 "mpsd_last_error_info", "mpsd_claim_memory_bytes", "mpsd_claim_memory_used_bytes"):
        assert not after.get(name), name


def test_churn_through_many_pods_and_regions_keeps_the_series_count() -> None:
    m = Metrics()
    world(m, "start", pods=10, regions=20, claims=5)
    start = count(m)
    for i in range(30):
        world(m, f"churn{i}", pods=10, regions=20, claims=5)
    assert count(m) == start
    world(m, "bigger", pods=20, regions=20)
    assert count(m) > start  # it does count: more pods, more series
