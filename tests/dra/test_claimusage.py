"""Per-claim metrics: consumed memory and compute and the region's live usage, read from a real
region held by a real process through the shim's reader, on /metrics' text format."""

from __future__ import annotations

import functools
import os

from mpsd.dra.claims import ClaimRef
from mpsd.dra.claimusage import ClaimUsageReader, claim_rows
from mpsd.registry import Metrics
from mpsd.alloc.usage import shim_usage

from tests.regionholder import hold
from tests.dra.conftest import GIB, claim, result

MIB = 1 << 20


def scraped(metrics):
    """The mpsd_claim_* samples of /metrics' text, parsed as Prometheus parses it."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.scrape().decode())
            for s in f.samples if s.name.startswith("mpsd_claim_")}


def test_a_claims_series_carry_its_pods_caps_and_live_usage(env, holder_exe, shim_lib):
    env.claims.put(claim(results=[result(memory="20Gi", compute="30")], pods=("web-1", "web-0")))
    p = env.loaded()
    rec = p.prepare(ClaimRef("ns", "c1", "uid-1"))
    holder = hold(holder_exe, os.path.join(rec.region_dir, "region-gpu"), f"0:{20 * GIB}:{300 * MIB}")
    try:
        metrics = Metrics()
        rows = ClaimUsageReader(p.prepared, functools.partial(shim_usage, library=str(shim_lib)), metrics).tick()
        (row,) = rows
        assert (row.claim, row.namespace, row.pod, row.gpu) == ("c1", "ns", "web-0,web-1", 0)
        assert (row.memory_bytes, row.compute_percent, row.used_bytes) == (20 * GIB, 30.0, 300 * MIB)
        labels = {"claim": "c1", "gpu": "0", "namespace": "ns", "pod": "web-0,web-1"}
        assert scraped(metrics) == {
            ("mpsd_claim_memory_bytes", tuple(sorted(labels.items()))): 20 * GIB,
            ("mpsd_claim_compute_percent", tuple(sorted(labels.items()))): 30.0,
            ("mpsd_claim_memory_used_bytes", tuple(sorted(labels.items()))): 300 * MIB,
        }
    finally:
        holder.kill()
        holder.wait()
    p.unprepare(ClaimRef("ns", "c1", "uid-1"))
    ClaimUsageReader(p.prepared, lambda path: {}, metrics).tick()
    assert scraped(metrics) == {}  # an unprepared claim's series go


def test_an_unreadable_region_counts_as_nothing_used(env, shim_lib, caplog):
    env.claims.put(claim())
    p = env.loaded()
    rec = p.prepare(ClaimRef("ns", "c1", "uid-1"))
    os.symlink("/etc/passwd", os.path.join(rec.region_dir, "region-gpu"))  # a pod's trick: refused, not followed
    reader = ClaimUsageReader(p.prepared, functools.partial(shim_usage, library=str(shim_lib)), None)
    (row,) = reader.tick()
    assert row.used_bytes == 0
    reader.tick()
    warnings = [r for r in caplog.records if "cannot read usage" in r.getMessage()]
    assert len(warnings) == 1 and "ns/c1" in warnings[0].getMessage()


def test_rows_per_gpu_in_host_index_order(env):
    env.claims.put(claim(results=[result(device="gpu-1", memory="4Gi"), result(device="gpu-0", request="b")]))
    p = env.loaded()
    p.prepare(ClaimRef("ns", "c1", "uid-1"))
    rows = claim_rows(p.prepared(), {"uid-1": {1: 5}})
    assert [(r.gpu, r.memory_bytes, r.used_bytes) for r in rows] == [(0, 8 * GIB, 0), (1, 4 * GIB, 5)]


def test_mpsd_status_lists_prepared_claims(env, tmp_path):
    """``mpsd status`` (collect_status + render_status) shows the claims of the DRA state file,
    read from a copy: the running plugin's files are left as they are."""
    from mpsd import config as cfg
    from mpsd.status import collect_status, render_status

    env.claims.put(claim(results=[result(memory="20Gi", compute="25")], pods=("web-0",)))
    p = env.loaded()
    p.prepare(ClaimRef("ns", "c1", "uid-1"))
    before = sorted(os.listdir(env.state_path.parent))

    class NoControl:  # the daemon is down: status still lists the claims
        def __getattr__(self, name):
            from mpsd.errors import DaemonNotRunning

            def down(*a, **k):
                raise DaemonNotRunning("no daemon")
            return down

    config = cfg.load(None, {}, {"state-dir": str(env.state_path.parent), "nvml-library": str(tmp_path / "none.so")})
    data = collect_status(config, control=NoControl(), inventory=None)
    assert [(c["namespace"], c["name"], c["pods"], c["gpus"]) for c in data["claims"]] == [
        ("ns", "c1", ["web-0"], [{"index": 0, "memoryLimit": 20 * GIB}])]
    text = render_status(data)
    assert "ns/c1" in text and "20480M" in text and "25%" in text and "web-0" in text
    assert sorted(os.listdir(env.state_path.parent)) == before


def test_a_refused_claim_region_is_counted_every_round(env, shim_lib):
    """A claim's region lives in an allocation directory made by the device plugin's core, so a
    refused one counts as kind="allocation", the same series the MpsdRegionsRefused alert reads."""
    env.claims.put(claim())
    p = env.loaded()
    rec = p.prepare(ClaimRef("ns", "c1", "uid-1"))
    os.symlink("/etc/passwd", os.path.join(rec.region_dir, "region-gpu"))
    metrics = Metrics()
    reader = ClaimUsageReader(p.prepared, functools.partial(shim_usage, library=str(shim_lib)), metrics)
    reader.tick()
    reader.tick()
    assert metrics.registry.get_sample_value(
        "mpsd_regions_refused_total", {"kind": "allocation", "reason": "not_regular"}) == 2
