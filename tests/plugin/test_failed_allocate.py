"""A failed Allocate leaves the plugin's state exactly as it was: journal, memory and
directories. The state disk is a real small tmpfs, filled until one page is left: room for
the first container's journal line of a two-container Allocate, not for the second's."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from mpsd.alloc.state import Allocation, StateStore

from tests.plugin.conftest import RESOURCE, FakePodResources, allocate, gpus, stub

PAGE = 4096


@pytest.fixture
def state_tmpfs(env) -> Iterator[Path]:
    """A 64 KiB tmpfs where the plugin keeps its state."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = env.state_path.parent
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def fill_leaving(mnt: Path, pages: int) -> Path:
    """Fill ``mnt`` with a file of whole pages, then give back ``pages`` of them."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        try:
            while os.write(fd, b"x" * PAGE) == PAGE:
                pass
        except OSError:
            pass
        size = os.fstat(fd).st_size // PAGE * PAGE
        os.ftruncate(fd, size - pages * PAGE)
    finally:
        os.close(fd)
    vfs = os.statvfs(mnt)
    assert vfs.f_bavail * vfs.f_frsize == pages * PAGE  # the precondition the test needs
    return filler


def snapshot(env, plugin) -> tuple:
    """Everything a failed Allocate must leave as it was."""
    journal = Path(plugin.store.journal_path)
    return (
        plugin.store.all(),
        journal.read_bytes() if journal.exists() else b"",
        sorted(os.listdir(env.paths.region_dir)),
    )


def test_a_failed_allocate_leaves_journal_memory_and_directories_as_they_were(env, kubelet, state_tmpfs):
    g = gpus(80)
    plugin = env.plugin(g, slices=100)
    plugin.start()
    try:
        _, s = stub(plugin)
        first = [f"{g[0].uuid}::{k}" for k in range(50)]  # a line of ~2.5 KiB each
        second = [f"{g[0].uuid}::{k}" for k in range(50, 100)]
        allocate(s, first)  # an earlier pod on the same slices as the first container
        (previous,) = plugin.store.all()
        plugin.store.compact()  # an empty journal: the next line starts a new page
        filler = fill_leaving(state_tmpfs, pages=1)
        before = snapshot(env, plugin)
        with pytest.raises(grpc.RpcError) as info:
            allocate(s, first, second)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "No space left" in info.value.details()
        assert snapshot(env, plugin) == before
        assert StateStore(str(env.state_path)).load() == {previous.allocation_id: previous}  # on disk too
        assert plugin.store.get(previous.allocation_id).region_dir == previous.region_dir  # still named
        filler.unlink()
        reply = allocate(s, first, second)  # room again: both containers, recorded together
        assert len(reply.container_responses) == 2 and len(plugin.store.all()) == 2
    finally:
        plugin.stop()


def test_a_change_in_the_journal_stands_when_only_the_compaction_after_it_fails(tmp_path, env, state_tmpfs, caplog):
    """The journal line is durable: the change returns, the snapshot is written later."""
    store = StateStore(str(env.state_path), compact_every=2)

    def alloc(n: int) -> Allocation:
        return Allocation(f"a{n}", (f"GPU-a::{n}",), ("GPU-a",), {0: 1 << 30}, 10.0, f"/r/{n}", float(n))

    try:
        store.put(alloc(1))  # one small line in the journal's first page
        filler = fill_leaving(state_tmpfs, pages=0)  # the next line fits that page, a snapshot does not
        with caplog.at_level("WARNING", logger="mpsd.alloc.state"):
            store.put(alloc(2))  # the second line: compaction is due and fails
        assert [a.allocation_id for a in store.all()] == ["a1", "a2"]
        assert sorted(StateStore(str(env.state_path)).load()) == ["a1", "a2"]
        assert any("compaction" in r.getMessage() and "\n" not in r.getMessage() for r in caplog.records)
        filler.unlink()
        store.put(alloc(3))  # compacts now
        assert store.journal_lines == 0
        assert sorted(StateStore(str(env.state_path)).load()) == ["a1", "a2", "a3"]
    finally:
        store.close()


def test_a_full_state_disk_stops_no_usage_round_and_loses_nothing(env, kubelet, state_tmpfs, caplog):
    """Labels and garbage collection wait for the disk (nothing is released that the state still
    names); usage is still read and exported, with one line, and all resumes once there is room."""
    pr = FakePodResources(str(env.pod_resources_socket))
    g = gpus(80)
    plugin = env.plugin(g, usage_reader=lambda path: {0: 7}, gc_grace=30.0)
    plugin.start()
    try:
        _, s = stub(plugin)
        ended_ids, good_ids = [f"{g[0].uuid}::0"], [f"{g[0].uuid}::1"]
        allocate(s, ended_ids)
        allocate(s, good_ids)
        ended = next(a for a in plugin.store.all() if list(a.device_ids) == ended_ids)
        plugin.store.put(replace(ended, created=ended.created - 3600))  # its pod ended an hour ago
        plugin.store.compact()  # an empty journal: the next line needs a page
        filler = fill_leaving(state_tmpfs, pages=0)
        pr.pods = [("good", "t", "c", RESOURCE, good_ids)]
        now = time.time()
        with caplog.at_level("WARNING", logger="mpsd.plugin.usage"):
            plugin.tracker.tick(now=now)
            rows = plugin.tracker.tick(now=now + 60)
        assert [(r.pod, r.used_bytes) for r in rows] == [("good", 7)]
        assert len(plugin.store.all()) == 2 and os.path.isdir(ended.region_dir)  # not released unrecorded
        lines = [r.getMessage() for r in caplog.records if "No space left" in r.getMessage()]
        assert len(lines) == 1, lines
        filler.unlink()
        plugin.tracker.tick(now=now + 70)
        assert [a.pod for a in plugin.store.all()] == ["good"] and not os.path.exists(ended.region_dir)
    finally:
        plugin.stop()
        pr.stop()
