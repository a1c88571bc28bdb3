"""mpsd.metrics.http: values in, Prometheus text out (scraped over real HTTP and parsed)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mpsd.inventory.nvml import Client, Gpu
from mpsd.plugin.metrics import AllocationUsage
from mpsd.registry import Metrics
from mpsd.metrics.http import Server, serve

GIB = 1 << 30
GPU0 = Gpu(0, "GPU-aaaa", "NVIDIA A100", 80 * GIB, 6 * GIB, (8, 0), False)
GPU1 = Gpu(1, "GPU-bbbb", "NVIDIA A100", 80 * GIB, 0, (8, 0), False)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def server(metrics: Metrics) -> Iterator[Server]:
    with serve("127.0.0.1:0", metrics, live=lambda: True, ready=lambda: (True, "")) as s:
        yield s


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics and parse it: {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def named(samples: dict, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_supervisor_metrics(metrics: Metrics, server: Server) -> None:
    metrics.set_daemon_up(True)
    metrics.daemon_restarted()
    metrics.daemon_restarted()
    metrics.observe_health_check(0.003)
    metrics.observe_health_check(0.3)
    metrics.set_config_generation(7)
    metrics.set_mps_servers({0: 1, 1: 0})
    metrics.set_device_health({0: True, 1: False})
    s = scrape(server)
    assert s[("mpsd_daemon_up", ())] == 1
    assert s[("mpsd_daemon_restarts_total", ())] == 2
    assert s[("mpsd_health_check_seconds_count", ())] == 2
    assert s[("mpsd_health_check_seconds_sum", ())] == pytest.approx(0.303)
    assert s[("mpsd_health_check_seconds_bucket", (("le", "0.005"),))] == 1
    assert s[("mpsd_health_check_seconds_bucket", (("le", "0.5"),))] == 2
    assert s[("mpsd_config_generation", ())] == 7
    assert named(s, "mpsd_mps_servers") == {(("gpu", "0"),): 1, (("gpu", "1"),): 0}
    assert named(s, "mpsd_device_healthy") == {(("gpu", "0"),): 1, (("gpu", "1"),): 0}
    metrics.set_daemon_up(False)
    metrics.set_device_health({0: False})
    s = scrape(server)
    assert s[("mpsd_daemon_up", ())] == 0
    assert named(s, "mpsd_device_healthy") == {(("gpu", "0"),): 0}


def test_last_error_keeps_only_the_latest_message(metrics: Metrics, server: Server) -> None:
    s = scrape(server)
    assert named(s, "mpsd_last_error_info") == {} and s[("mpsd_last_error_timestamp_seconds", ())] == 0
    metrics.set_last_error("daemon exited\nwith status 1", when=1000.0)
    metrics.set_last_error("server FAULT on gpu 0", when=2000.0)
    s = scrape(server)
    assert named(s, "mpsd_last_error_info") == {(("message", "server FAULT on gpu 0"),): 1}
    assert s[("mpsd_last_error_timestamp_seconds", ())] == 2000
    metrics.set_last_error("x" * 1000)
    assert list(named(scrape(server), "mpsd_last_error_info")) == [(("message", "x" * 200),)]
    metrics.set_last_error("")
    assert named(scrape(server), "mpsd_last_error_info") == {}


def test_inventory_replaces_stale_label_sets(metrics: Metrics, server: Server) -> None:
    metrics.observe_inventory([GPU0, GPU1], [Client(0, 101, 2 * GIB), Client(0, 102, GIB), Client(1, 201, None)])
    s = scrape(server)
    assert named(s, "mpsd_gpu_memory_total_bytes") == {
        (("gpu", "0"), ("uuid", "GPU-aaaa")): 80 * GIB,
        (("gpu", "1"), ("uuid", "GPU-bbbb")): 80 * GIB,
    }
    assert named(s, "mpsd_gpu_memory_used_bytes")[(("gpu", "0"), ("uuid", "GPU-aaaa"))] == 6 * GIB
    assert named(s, "mpsd_mps_clients") == {(("gpu", "0"),): 2, (("gpu", "1"),): 1}
    assert named(s, "mpsd_client_memory_bytes") == {
        (("gpu", "0"), ("pid", "101")): 2 * GIB,
        (("gpu", "0"), ("pid", "102")): GIB,
    }
    metrics.observe_inventory([GPU0], [Client(0, 102, 3 * GIB)])  # pid 101 exited, GPU 1 gone
    s = scrape(server)
    assert named(s, "mpsd_client_memory_bytes") == {(("gpu", "0"), ("pid", "102")): 3 * GIB}
    assert named(s, "mpsd_mps_clients") == {(("gpu", "0"),): 1}
    assert list(named(s, "mpsd_gpu_memory_total_bytes")) == [(("gpu", "0"), ("uuid", "GPU-aaaa"))]
    metrics.observe_inventory([GPU0], [])
    assert named(scrape(server), "mpsd_mps_clients") == {(("gpu", "0"),): 0}
    assert named(scrape(server), "mpsd_client_memory_bytes") == {}


def test_allocations_replace_the_previous_set(metrics: Metrics, server: Server) -> None:
    a = AllocationUsage("alloc-1", "llm-0", "serving", "vllm", 0, 8 * GIB, 5 * GIB)
    b = AllocationUsage("alloc-2", "embed-0", "serving", "tei", 1, 4 * GIB, 0)
    metrics.set_allocations([a, b])
    s = scrape(server)
    labels_a = (
        ("allocation", "alloc-1"),
        ("container", "vllm"),
        ("gpu", "0"),
        ("namespace", "serving"),
        ("pod", "llm-0"),
    )
    assert named(s, "mpsd_allocation_memory_limit_bytes")[labels_a] == 8 * GIB
    assert named(s, "mpsd_allocation_memory_used_bytes")[labels_a] == 5 * GIB
    assert len(named(s, "mpsd_allocation_memory_used_bytes")) == 2
    metrics.set_allocations([b])
    s = scrape(server)
    assert [dict(k)["allocation"] for k in named(s, "mpsd_allocation_memory_used_bytes")] == ["alloc-2"]
    assert [dict(k)["allocation"] for k in named(s, "mpsd_allocation_memory_limit_bytes")] == ["alloc-2"]


def test_each_metrics_has_its_own_registry_unless_given_one() -> None:
    a, b = Metrics(), Metrics()
    a.set_daemon_up(True)
    assert b"mpsd_daemon_up 0.0" in b.scrape() and b"mpsd_daemon_up 1.0" in a.scrape()
    shared = CollectorRegistry()
    assert Metrics(shared).registry is shared
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Metrics(shared)


def test_update_supervisor_counts_each_change_once(metrics: Metrics, server: Server) -> None:
    snapshot = dict(daemon_up=True, restarts=0, health_latency=None, last_error="", servers=0, config_generation=1)
    metrics.update_supervisor(**snapshot)
    metrics.update_supervisor(**{**snapshot, "health_latency": 0.02})
    metrics.update_supervisor(**{**snapshot, "health_latency": 0.02})  # same check, republished
    metrics.update_supervisor(
        **{
            **snapshot,
            "daemon_up": False,
            "restarts": 2,
            "health_latency": 0.02,
            "last_error": "daemon exited with status 1",
        }
    )
    metrics.update_supervisor(
        **{
            **snapshot,
            "restarts": 2,
            "health_latency": 0.04,
            "last_error": "daemon exited with status 1",
            "servers": 3,
            "config_generation": 4,
        }
    )
    s = scrape(server)
    assert s[("mpsd_daemon_up", ())] == 1
    assert s[("mpsd_daemon_restarts_total", ())] == 2
    assert s[("mpsd_health_check_seconds_count", ())] == 2
    assert s[("mpsd_health_check_seconds_sum", ())] == pytest.approx(0.06)
    assert named(s, "mpsd_last_error_info") == {(("message", "daemon exited with status 1"),): 1}
    assert named(s, "mpsd_mps_servers") == {(("gpu", "all"),): 3}
    assert s[("mpsd_config_generation", ())] == 4
    stamped = s[("mpsd_last_error_timestamp_seconds", ())]
    assert stamped > 0
    metrics.update_supervisor(**{**snapshot, "restarts": 2, "last_error": "daemon exited with status 1"})
    assert scrape(server)[("mpsd_last_error_timestamp_seconds", ())] == stamped  # same error: not re-stamped
    metrics.update_supervisor(**{**snapshot, "restarts": 2})
    assert named(scrape(server), "mpsd_last_error_info") == {}


def test_update_gpus_is_observe_inventory(metrics: Metrics, server: Server) -> None:
    metrics.update_gpus([GPU0], [Client(0, 7, GIB)])
    assert named(scrape(server), "mpsd_client_memory_bytes") == {(("gpu", "0"), ("pid", "7")): GIB}


def test_region_refusals_are_counted_by_kind_and_reason_from_zero(metrics: Metrics, server: Server) -> None:
    from shim import RegionError

    refused = named(scrape(server), "mpsd_regions_refused_total")
    assert len(refused) == 8 and set(refused.values()) == {0.0}  # 2 kinds x 4 reasons, before any refusal
    assert metrics.region_refused("exec", RegionError("bad magic", "corrupted")) is True
    assert metrics.region_refused("allocation", RegionError("a FIFO", "not_regular")) is True
    assert metrics.region_refused("allocation", RegionError("gone meanwhile", "missing")) is False
    assert metrics.region_refused("allocation", OSError("no library")) is False
    refused = named(scrape(server), "mpsd_regions_refused_total")
    assert refused[(("kind", "exec"), ("reason", "corrupted"))] == 1.0
    assert refused[(("kind", "allocation"), ("reason", "not_regular"))] == 1.0
    assert sum(refused.values()) == 2.0 and len(refused) == 8
    with pytest.raises(ValueError, match="region kind 'pod': expected one of allocation, exec"):
        metrics.region_refused("pod", RegionError("x", "corrupted"))
