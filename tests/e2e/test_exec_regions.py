"""mpsd run's series for the regions of `mpsd exec` (mpsd.metrics.regions): real region files
charged by real holder processes (the region core), read through libmpsshim.so, served by the
metrics exporter; and the FAULT count pushed from a supervisor status."""

from __future__ import annotations

import functools
import os
import urllib.request

from mpsd.metrics.regions import ExecRegions, RegionUsage, region_files
from mpsd.lifecycle.health import HealthBoard
from mpsd.registry import Metrics
from mpsd.metrics.http import serve
from mpsd.node import InventoryPump, _observer
from mpsd.lifecycle.supervisor import Status
from tests.regionholder import hold, reader_survives_truncation

G = 1 << 30
M = 1 << 20


def scrape(metrics: Metrics) -> list[str]:
    with (
        serve("127.0.0.1:0", metrics, lambda: True, lambda: True) as server,
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp,
    ):
        body = resp.read()
    return [line for line in body.decode().splitlines() if not line.startswith("#")]


def test_region_files_reads_only_regular_files_one_level_down_without_symlinks(tmp_path):
    root = tmp_path / "exec"
    for name in ("b", "a", "fifo", "linked", "empty"):
        (root / name).mkdir(parents=True)
    (root / "a" / "region").write_bytes(b"")
    (root / "b" / "region").write_bytes(b"")
    os.mkfifo(root / "fifo" / "region")
    (root / "linked" / "region").symlink_to(root / "a" / "region")
    (root / "dirlink").symlink_to(root / "a")
    (root / "plain-file").write_bytes(b"")
    assert region_files(str(root)) == [("a", str(root / "a" / "region")), ("b", str(root / "b" / "region"))]
    assert region_files(str(root), limit=1) == [("a", str(root / "a" / "region"))]
    assert region_files(str(tmp_path / "absent")) == []


def test_region_names_that_are_not_printable_utf8_are_skipped(holder_exe, shim_lib, tmp_path):
    root = tmp_path / "exec"
    for name in (b"caf\xe9", b"new\nline", b"ok"):
        os.makedirs(os.path.join(os.fsencode(root), name))
    for name in (b"new\nline", b"ok"):
        open(os.path.join(os.fsencode(root), name, b"region"), "wb").close()
    a = hold(holder_exe, os.path.join(os.fsencode(root), b"caf\xe9", b"region"), f"0:{4 * G}:{G}")
    try:
        assert region_files(str(root)) == [("ok", str(root / "ok" / "region"))]
        metrics = Metrics()
        metrics.set_regions(ExecRegions(str(root), lambda: str(shim_lib))())
        assert "mpsd_region_" not in "".join(scrape(metrics))  # and the scrape still works
    finally:
        a.kill()
        a.wait()


def test_exec_regions_reads_caps_usage_and_live_processes(holder_exe, shim_lib, tmp_path):
    root = tmp_path / "exec"
    for name in ("shared", "solo", "bad", "fifo"):
        (root / name).mkdir(parents=True)
    (root / "bad" / "region").write_bytes(b"not a region" * 1000)
    os.mkfifo(root / "fifo" / "region")
    a = hold(holder_exe, root / "shared" / "region", f"0:{4 * G}:{3 * G}")
    b = hold(holder_exe, root / "shared" / "region", f"0:{4 * G}:{512 * M}")
    c = hold(holder_exe, root / "solo" / "region", f"1:{2 * G}:{M}")
    try:
        rows = ExecRegions(str(root), lambda: str(shim_lib))()
        assert [(r.region, r.device, r.cap_bytes, r.used_bytes) for r in rows] == [
            ("shared", 0, 4 * G, 3 * G + 512 * M),
            ("solo", 1, 2 * G, M),
        ]
        assert sorted(rows[0].processes) == sorted([(a.pid, 3 * G), (b.pid, 512 * M)])
        b.kill()
        b.wait()
        again = ExecRegions(str(root), lambda: str(shim_lib))()
        assert again[0].processes == ((a.pid, 3 * G),)  # a dead process has no series
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait()


def test_without_a_shim_library_the_regions_are_not_read(tmp_path):
    (tmp_path / "exec" / "x").mkdir(parents=True)
    (tmp_path / "exec" / "x" / "region").write_bytes(b"")

    def missing() -> str:
        raise OSError("no libmpsshim.so")

    assert ExecRegions(str(tmp_path / "exec"), missing)() == []


def test_each_refused_region_is_counted_by_reason_at_every_read(holder_exe, shim_lib, tmp_path):
    root = tmp_path / "exec"
    for name in ("bad", "huge", "good"):
        (root / name).mkdir(parents=True)
    (root / "bad" / "region").write_bytes(b"not a region" * 1000)
    with open(root / "huge" / "region", "wb") as f:
        f.truncate(1 << 40)  # sparse: refused for its size, never read
    a = hold(holder_exe, root / "good" / "region", f"0:{4 * G}:{G}")
    metrics = Metrics()
    read = ExecRegions(str(root), lambda: str(shim_lib), functools.partial(metrics.region_refused, "exec"))
    try:
        assert [r.region for r in read()] == ["good"]
        assert [r.region for r in read()] == ["good"]
        counted = {
            reason: metrics.registry.get_sample_value("mpsd_regions_refused_total", {"kind": "exec", "reason": reason})
            for reason in ("corrupted", "too_large", "not_regular", "unreadable")
        }
        assert counted == {"corrupted": 2, "too_large": 2, "not_regular": 0, "unreadable": 0}
        assert 'mpsd_regions_refused_total{kind="exec",reason="corrupted"} 2.0' in scrape(metrics)
    finally:
        a.kill()
        a.wait()


def test_mpsd_run_counts_the_refused_regions_under_its_state_dir(shim_lib, tmp_path):
    from mpsd import config as cfg
    from mpsd.node import exec_regions

    (tmp_path / "exec" / "bad").mkdir(parents=True)
    (tmp_path / "exec" / "bad" / "region").write_bytes(b"not a region" * 1000)
    config = cfg.load(None, {}, {"state-dir": str(tmp_path), "shim-library": str(shim_lib)})
    metrics = Metrics()
    assert exec_regions(config, metrics)() == []
    assert 'mpsd_regions_refused_total{kind="exec",reason="corrupted"} 1.0' in scrape(metrics)
    assert exec_regions(config, None)() == []  # without metrics: read, nothing counted


def test_the_pump_exports_region_series_and_drops_them_when_the_region_goes(holder_exe, shim_lib, tmp_path):
    root = tmp_path / "exec"
    (root / "web").mkdir(parents=True)
    a = hold(holder_exe, root / "web" / "region", f"0:{4 * G}:{G}")
    metrics = Metrics()
    pump = InventoryPump(None, metrics, HealthBoard(), regions=ExecRegions(str(root), lambda: str(shim_lib)))
    try:
        pump.refresh()
        lines = scrape(metrics)
        assert 'mpsd_region_memory_cap_bytes{device="0",region="web"} 4.294967296e+09' in lines
        assert 'mpsd_region_memory_used_bytes{device="0",region="web"} 1.073741824e+09' in lines
        assert f'mpsd_region_process_memory_bytes{{device="0",pid="{a.pid}",region="web"}} 1.073741824e+09' in lines
        (root / "web" / "region").unlink()
        pump.refresh()
        assert not [line for line in scrape(metrics) if line.startswith("mpsd_region_")]
    finally:
        pump.close()
        a.kill()
        a.wait()


def test_set_regions_replaces_the_previous_rows():
    metrics = Metrics()
    metrics.set_regions([RegionUsage("a", 0, 4 * G, G, ((7, G),))])
    metrics.set_regions([RegionUsage("b", 0, 2 * G, 0, ())])
    lines = [line for line in scrape(metrics) if line.startswith("mpsd_region_")]
    assert lines == [
        'mpsd_region_memory_cap_bytes{device="0",region="b"} 2.147483648e+09',
        'mpsd_region_memory_used_bytes{device="0",region="b"} 0.0',
    ]


def test_the_observer_exports_how_many_servers_are_in_fault():
    metrics = Metrics()
    pump = InventoryPump(None, metrics, HealthBoard())
    try:
        observe = _observer(metrics, pump)
        observe(Status(state="running", servers=(10, 11, 12), server_states={10: "FAULT", 11: "ACTIVE", 12: "FAULT"}))
        assert "mpsd_mps_servers_faulted 2.0" in scrape(metrics)
        observe(Status(state="running", servers=(13,), server_states={13: "ACTIVE"}))
        assert "mpsd_mps_servers_faulted 0.0" in scrape(metrics)
    finally:
        pump.close()


READER = """
import sys, time
from mpsd.metrics.regions import ExecRegions
root, lib = sys.argv[1], sys.argv[2]
regions = ExecRegions(root, lambda: lib)
deadline = time.monotonic() + 8
reads = 0
while time.monotonic() < deadline:
    regions()
    reads += 1
print(reads)
"""


def test_a_client_truncating_its_region_cannot_kill_mpsd_run(holder_exe, shim_lib, tmp_path):
    # the reader is mpsd run's inventory pump: a SIGBUS there would take the control daemon and
    # every MPS client of the node with it; the region files are the clients'
    region = tmp_path / "exec" / "job" / "region"
    region.parent.mkdir(parents=True)
    holder = hold(holder_exe, region, f"0:{8 * G}:{G}")
    reader_survives_truncation(holder, region, READER, str(tmp_path / "exec"), str(shim_lib))


def bytes_read() -> int:
    """What this process has read through read(2)/pread(2) so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_a_region_of_the_wrong_size_is_refused_before_a_byte_of_it_is_copied(shim_lib, tmp_path):
    import pytest

    import shim
    from shim._usage import MAX_REGION_BYTES

    root = tmp_path / "exec"
    for k in range(4):  # files as large as the reader ever took (sparse: no disk needed)
        (root / f"r{k}").mkdir(parents=True)
        with open(root / f"r{k}" / "region", "wb") as f:
            f.truncate(MAX_REGION_BYTES)
    before = bytes_read()
    rows = ExecRegions(str(root), lambda: str(shim_lib))()
    read = bytes_read() - before
    assert rows == []  # each refused, none stops the others
    assert read < 4 * M, f"{read} bytes read"  # the library's own load, not 4 x 64 MiB of copies
    with pytest.raises(shim.RegionError, match=r"r0/region is 67108864 bytes, expected \d+ \(truncated"):
        shim.usage(root / "r0" / "region", library=str(shim_lib), copy=True)
