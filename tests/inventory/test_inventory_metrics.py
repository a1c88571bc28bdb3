"""NVML (the fake, through pynvml) → Inventory → Metrics → /metrics over HTTP."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mpsd.inventory.nvml import Inventory
from mpsd.registry import Metrics
from mpsd.metrics.http import serve
from tests.fakes.nvml_build import nvml_config_text

GIB = 1 << 30


def samples(port: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_a_client_that_exits_leaves_the_scrape(fake_nvml_lib: Path, nvml_config) -> None:
    gpu = ("GPU-12345678-0000-0000-0000-000000000000", 24 * GIB, 3 * GIB, (8, 9), False, "NVIDIA L4")
    metrics = Metrics()
    with serve("127.0.0.1:0", metrics, lambda: True, lambda: (True, "")) as server:
        nvml_config(nvml_config_text(gpus=[gpu], mps_clients=[(0, 501, GIB), (0, 502, 2 * GIB)]))
        with Inventory(str(fake_nvml_lib)) as inv:
            metrics.observe_inventory(inv.gpus(), inv.mps_clients())
        assert samples(server.port, "mpsd_client_memory_bytes") == {
            (("gpu", "0"), ("pid", "501")): GIB,
            (("gpu", "0"), ("pid", "502")): 2 * GIB,
        }
        assert samples(server.port, "mpsd_gpu_memory_total_bytes") == {(("gpu", "0"), ("uuid", gpu[0])): 24 * GIB}
        nvml_config(nvml_config_text(gpus=[gpu], mps_clients=[(0, 502, 2 * GIB)]))
        with Inventory(str(fake_nvml_lib)) as inv:
            metrics.observe_inventory(inv.gpus(), inv.mps_clients())
        assert samples(server.port, "mpsd_client_memory_bytes") == {(("gpu", "0"), ("pid", "502")): 2 * GIB}
        assert samples(server.port, "mpsd_mps_clients") == {(("gpu", "0"),): 1}
