"""A pod chooses the shape of what it leaves in its allocation directory: thousands of nested
directories (``shutil.rmtree`` raised RecursionError there, which stopped every later usage
and GC round of every pod), symlinks to host files, FIFOs, a directory it cannot let go of.
Removal (mpsd.trees) survives any of them without following a link, and a round that cannot
remove one directory says so in one line and goes on with the others."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.alloc.state import Allocation
from mpsd.trees import remove_tree

from tests.plugin.conftest import RESOURCE, FakePodResources, allocate, gpus, stub

REPO = Path(__file__).resolve().parents[2]
DEPTH = 3000  # far past Python's recursion limit; a regionDir tmpfs has inodes for it


def plant_deep_tree(top: str, host_dir: str, depth: int = DEPTH) -> None:
    """``depth`` nested directories below ``top``, every 100th with a symlink to ``host_dir``
    and a FIFO; made by descriptor (the full path is far longer than PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            if level % 100 == 0:
                os.symlink(host_dir, "host", dir_fd=fd)
                os.mkfifo("fifo", dir_fd=fd)
            below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)


def three_allocations(plugin) -> list[tuple[list[str], Allocation]]:
    """(device IDs, stored allocation) of three one-slice Allocates, in order."""
    _, s = stub(plugin)
    uuid = plugin.gpus[0].uuid
    ids = [[f"{uuid}::{k}"] for k in range(3)]
    for one in ids:
        allocate(s, one)
    by_ids = {a.device_ids: a for a in plugin.store.all()}
    return [(one, by_ids[tuple(one)]) for one in ids]


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory for deep trees outside pytest's own temporary directories (pytest removes
    old ones recursively: a tree a killed run left there would break a later session's
    clean-up), removed here with remove_tree whatever a failed test left."""
    d = Path(tempfile.mkdtemp(prefix="deeptrees-", dir="/tmp"))
    yield d
    remove_tree(str(d))


@pytest.fixture
def host_dir(scratch: Path) -> Path:
    """A host directory the pods' symlinks point at."""
    d = scratch / "host"
    d.mkdir()
    (d / "precious").write_text("host data")
    return d


def test_remove_tree_survives_any_depth_and_follows_no_link(scratch, host_dir):
    top = scratch / "tree"
    top.mkdir()
    plant_deep_tree(str(top), str(host_dir))
    (top / "link-to-host-file").symlink_to(host_dir / "precious")
    result = remove_tree(str(top))
    assert result.complete, result.error
    assert not top.exists()
    assert (host_dir / "precious").read_text() == "host data"  # nothing followed
    assert remove_tree(str(top)).complete  # a tree already gone is no error


# a tree as a list of (parent index, kind): entry i is made in entry parent's directory (-1: the top)
KINDS = ("dir", "file", "fifo", "link-to-host-dir", "link-to-host-file", "dangling-link")
trees = st.lists(st.tuples(st.integers(-1, 40), st.sampled_from(KINDS)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(trees)
def test_remove_tree_removes_any_tree_and_touches_nothing_outside(tmp_path_factory, shape):
    base = tmp_path_factory.mktemp("shape")
    host = base / "host"
    host.mkdir()
    (host / "precious").write_text("host data")
    top = base / "tree"
    top.mkdir()
    dirs = [top]
    for n, (parent, kind) in enumerate(shape):
        where = dirs[parent % len(dirs)] / f"e{n}"
        if kind == "dir":
            where.mkdir()
            dirs.append(where)
        elif kind == "file":
            where.write_bytes(b"x")
        elif kind == "fifo":
            os.mkfifo(where)
        else:
            targets = {"link-to-host-dir": host, "link-to-host-file": host / "precious"}
            where.symlink_to(targets.get(kind, base / "gone"))
    result = remove_tree(str(top))
    assert result.complete, result.error
    assert not top.exists() and os.listdir(host) == ["precious"] and (host / "precious").read_text() == "host data"


def test_remove_tree_unlinks_a_symlink_in_place_of_the_tree(scratch, host_dir):
    top = scratch / "tree"
    top.symlink_to(host_dir)
    assert remove_tree(str(top)).complete
    assert not os.path.lexists(top) and (host_dir / "precious").exists()


def test_remove_tree_work_is_bounded_and_a_later_call_finishes(scratch, host_dir):
    top = scratch / "tree"
    top.mkdir()
    plant_deep_tree(str(top), str(host_dir), depth=200)
    first = remove_tree(str(top), max_steps=100)
    assert not first.complete and "\n" not in first.error and top.exists()
    assert remove_tree(str(top)).complete and not top.exists()


def test_a_deep_tree_in_a_pods_directory_stops_no_usage_or_gc_round(env, kubelet, host_dir, caplog):
    pr = FakePodResources(str(env.pod_resources_socket))
    plugin = env.plugin(gpus(80), usage_reader=lambda path: {0: 7}, gc_grace=30.0)
    plugin.start()
    try:
        (hostile_ids, hostile), (good_ids, good), (_, orphan) = three_allocations(plugin)
        plant_deep_tree(hostile.region_dir, str(host_dir))
        plugin.store.put(replace(hostile, created=hostile.created - 3600))  # its pod ended an hour ago
        plugin.store.remove([orphan.allocation_id])  # a directory no allocation names: swept
        plant_deep_tree(orphan.region_dir, str(host_dir))
        pr.pods = [("good", "t", "c", RESOURCE, good_ids)]
        now = time.time()
        plugin.tracker.tick(now=now)  # the hostile allocation goes unlisted, the orphan unnamed
        rows = plugin.tracker.tick(now=now + 60)
        assert [(r.pod, r.used_bytes) for r in rows] == [("good", 7)]
        assert not os.path.exists(hostile.region_dir) and not os.path.exists(orphan.region_dir)
        assert [a.allocation_id for a in plugin.store.all()] == [good.allocation_id]
        assert (host_dir / "precious").read_text() == "host data"
        assert plugin.tracker.tick(now=now + 70)  # and the rounds after
    finally:
        plugin.stop()
        pr.stop()


def test_a_directory_that_cannot_be_removed_is_one_line_and_the_round_goes_on(env, kubelet, tmp_path, caplog):
    """A mount point inside a pod's directory (EBUSY) stands for any directory mpsd cannot remove."""
    if os.geteuid() != 0:
        pytest.skip("bind-mounting needs root")
    pr = FakePodResources(str(env.pod_resources_socket))
    plugin = env.plugin(gpus(80), usage_reader=lambda path: {0: 7}, gc_grace=30.0)
    plugin.start()
    mounted = ""
    try:
        (_, stuck), (_, ended), (good_ids, _) = three_allocations(plugin)
        mounted = os.path.join(stuck.region_dir, "busy")
        os.mkdir(mounted)
        (tmp_path / "src").mkdir()
        if subprocess.run(["mount", "--bind", str(tmp_path / "src"), mounted]).returncode != 0:
            pytest.skip("cannot bind-mount here")
        for a in (stuck, ended):
            plugin.store.put(replace(a, created=a.created - 3600))
        pr.pods = [("good", "t", "c", RESOURCE, good_ids)]
        now = time.time()
        plugin.tracker.tick(now=now)
        with caplog.at_level("WARNING", logger="mpsd.plugin.usage"):
            rows = plugin.tracker.tick(now=now + 60)
        assert [(r.pod, r.used_bytes) for r in rows] == [("good", 7)]
        assert not os.path.exists(ended.region_dir)  # the other stale directory went
        lines = [r.getMessage() for r in caplog.records if stuck.region_dir in r.getMessage()]
        assert len(lines) == 1 and "not removed" in lines[0] and "busy" in lines[0], lines
    finally:
        if mounted:
            subprocess.run(["umount", mounted], check=False)
        plugin.stop()
        pr.stop()


def test_mpsd_exec_returns_its_childs_code_after_a_deep_tree_in_its_region_dir(scratch, host_dir):
    child = (
        "import os, sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.plugin.test_deep_trees import plant_deep_tree;"
        "plant_deep_tree(os.path.dirname(os.environ['MPSSHIM_REGION']), sys.argv[2]); sys.exit(7)"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mpsd", "exec", f"--state-dir={scratch / 'state'}", "--",
         sys.executable, "-c", child, str(REPO), str(host_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    assert result.returncode == 7, result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(scratch / "state" / "exec") == []  # its region directory is gone
    assert (host_dir / "precious").read_text() == "host data"


def test_every_removal_of_a_tree_goes_through_mpsd_trees():
    users = [p for d in ("mpsd", "shim") for p in (REPO / d).rglob("*.py") if "rmtree(" in p.read_text()]
    assert users == [], "remove pod-writable trees with mpsd.trees.remove_tree, not shutil.rmtree"
