"""Allocations on disk: atomic replacement, round trip, damaged files kept aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.errors import PluginError
from mpsd.alloc.state import Allocation, StateStore, write_atomic

GIB = 1 << 30

allocations = st.builds(
    Allocation,
    allocation_id=st.from_regex(r"alloc-[0-9a-f]{16}", fullmatch=True),
    device_ids=st.lists(st.from_regex(r"GPU-[0-9a-f]{4}::[0-9]{1,2}", fullmatch=True), min_size=1, max_size=5).map(tuple),
    gpus=st.lists(st.from_regex(r"GPU-[0-9a-f]{4}", fullmatch=True), min_size=1, max_size=3).map(tuple),
    memory_limits=st.dictionaries(st.integers(0, 7), st.integers(0, 1 << 50), max_size=3),
    active_thread_percentage=st.floats(0.01, 100.0),
    region_dir=st.text(min_size=1, max_size=20),
    created=st.floats(0, 2e9),
    pod=st.text(max_size=10),
    namespace=st.text(max_size=10),
    container=st.text(max_size=10),
    allocated=st.floats(0, 2e9),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(allocations, max_size=5, unique_by=lambda a: a.allocation_id))
def test_what_is_put_is_what_a_new_store_loads(tmp_path_factory, items):
    path = str(tmp_path_factory.mktemp("state") / "s.json")
    store = StateStore(path)
    store.put_many(items)
    assert StateStore(path).load() == {a.allocation_id: a for a in items}


def test_remove_and_reload(tmp_path):
    path = str(tmp_path / "s.json")
    a = Allocation("a1", ("GPU-a::0",), ("GPU-a",), {0: GIB}, 10.0, "/r/a1", 1.0)
    b = Allocation("b1", ("GPU-a::1",), ("GPU-a",), {0: GIB}, 10.0, "/r/b1", 2.0)
    store = StateStore(path)
    store.put(a)
    store.put(b)
    assert [x.allocation_id for x in store.remove(["a1", "zz"])] == ["a1"]
    assert list(StateStore(path).load()) == ["b1"]
    store.compact()
    assert sorted(os.listdir(tmp_path)) == ["s.json", "s.json.journal", "s.json.lock"]  # no temporary files left
    assert (tmp_path / "s.json.journal").stat().st_size == 0
    assert list(StateStore(path).load()) == ["b1"]


def test_missing_file_is_an_empty_state(tmp_path):
    assert StateStore(str(tmp_path / "none.json")).load() == {}


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"version": 99, "allocations": []}', b'{"version": 1, "allocations": [{"x": 1}]}', b"[]"],
)
def test_damaged_file_is_kept_aside_and_reported(tmp_path, caplog, content):
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with caplog.at_level("ERROR", logger="mpsd.alloc.state"):
        assert StateStore(str(path)).load() == {}
    assert (tmp_path / "s.json.bad").read_bytes() == content  # nothing lost
    assert "state file unreadable" in caplog.text and str(path) in caplog.text


def test_write_atomic_replaces_by_rename(tmp_path):
    path = tmp_path / "f"
    write_atomic(str(path), b"one")
    inode = path.stat().st_ino
    write_atomic(str(path), b"two", mode=0o600)
    assert path.read_bytes() == b"two"
    assert path.stat().st_ino != inode
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_write_atomic_failure_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PluginError, match=r"cannot write .*file/sub/s\.json"):
        write_atomic(str(blocker / "sub" / "s.json"), b"{}")


def test_state_file_is_json_with_a_version(tmp_path):
    path = tmp_path / "s.json"
    store = StateStore(str(path))
    store.put(Allocation("a1", ("GPU-a::0",), ("GPU-a",), {0: GIB}, 10.0, "/r/a1", 1.0))
    store.compact()
    data = json.loads(path.read_text())
    assert data["version"] == 1
    assert data["allocations"][0]["memory_limits"] == {"0": GIB}


def alloc(i: int, created: float = 1.0) -> Allocation:
    return Allocation(f"a{i}", (f"GPU-a::{i}",), ("GPU-a",), {0: GIB}, 10.0, f"/r/a{i}", created)


def test_a_line_cut_short_by_a_crash_is_dropped_and_the_next_write_starts_clean(tmp_path, caplog):
    path = str(tmp_path / "s.json")
    store = StateStore(path)
    store.put(alloc(1))
    store.put(alloc(2))
    store.close()
    with open(path + ".journal", "ab") as f:
        f.write(b'{"put":[{"allocation_id":"a3"')  # the process died inside a write
    with caplog.at_level("WARNING", logger="mpsd.alloc.state"):
        restarted = StateStore(path)
        assert sorted(restarted.load()) == ["a1", "a2"]
    assert "partial line" in caplog.text
    restarted.put(alloc(4))
    assert sorted(StateStore(path).load()) == ["a1", "a2", "a4"]


def test_a_journal_left_behind_by_a_crash_during_compaction_replays_to_the_snapshot(tmp_path):
    path = str(tmp_path / "s.json")
    store = StateStore(path)
    store.put(alloc(1, created=1.0))
    store.put(alloc(1, created=2.0))  # changed again
    store.put(alloc(2))
    store.remove(["a2"])
    journal = (tmp_path / "s.json.journal").read_bytes()
    store.compact()
    (tmp_path / "s.json.journal").write_bytes(journal)  # as if the crash came before the truncation
    assert StateStore(path).load() == {"a1": alloc(1, created=2.0)}


def test_compaction_happens_by_itself_after_many_lines(tmp_path):
    path = str(tmp_path / "s.json")
    store = StateStore(path, compact_every=10)
    for i in range(25):
        store.put(alloc(i))
    assert store.journal_lines == 5
    assert len(json.loads((tmp_path / "s.json").read_text())["allocations"]) == 20
    assert len(StateStore(path).load()) == 25


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_refuses_the_change_with_one_line_and_loses_nothing(tmp_path):
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    path = str(mnt / "s.json")
    store = StateStore(path)
    try:
        store.put(alloc(1))
        filler = mnt / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 4096) == 4096:
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises(PluginError, match=r"cannot write .*s\.json\.journal: No space left") as info:
            store.put(Allocation("a2", ("GPU-a::2",), ("GPU-a",), {0: GIB}, 10.0, "/r/" + "x" * 8000, 1.0))
        assert "\n" not in str(info.value)
        assert sorted(store.all(), key=lambda a: a.allocation_id) == [alloc(1)]  # memory unchanged too
        filler.unlink()
        store.put(alloc(3))
        assert sorted(StateStore(path).load()) == ["a1", "a3"]
    finally:
        store.close()
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_damaged_journal_line_ends_the_replay_and_the_journal_is_kept_aside(tmp_path, caplog):
    path = str(tmp_path / "s.json")
    store = StateStore(path)
    store.put(alloc(1))
    store.close()
    with open(path + ".journal", "ab") as f:
        f.write(b'{"put": 7}\n')
    store = StateStore(path)
    store.put(alloc(2))  # written after the damaged line: not replayed, but kept in the file aside
    store.close()
    content = (tmp_path / "s.json.journal").read_bytes()
    with caplog.at_level("ERROR", logger="mpsd.alloc.state"):
        restarted = StateStore(path)
        assert sorted(restarted.load()) == ["a1"]
    assert "line=2" in caplog.text
    assert (tmp_path / "s.json.journal.bad").read_bytes() == content
    restarted.compact()
    restarted.put(alloc(3))
    assert sorted(StateStore(path).load()) == ["a1", "a3"]


def _in_another_process(path: str, code: str) -> subprocess.Popen:
    prelude = ("import sys, time\nfrom mpsd.alloc.state import Allocation, StateStore\n"
               f"store = StateStore({path!r})\nstore.load()\n")
    return subprocess.Popen([sys.executable, "-c", prelude + code], stdout=subprocess.PIPE, text=True)


def _alloc(name: str) -> Allocation:
    return Allocation(name, (f"GPU-a::{name}",), ("GPU-a",), {0: GIB}, 10.0, f"/r/{name}", 1.0)


def test_two_processes_sharing_the_state_never_lose_each_others_changes(tmp_path):
    """The old and the new mpsd of a rolling update serve side by side over one state file: the
    old store compacted its own copy over the other's changes (b1 was lost)."""
    path = str(tmp_path / "s.json")
    store = StateStore(path)
    store.load()
    store.put(_alloc("a1"))
    other = _in_another_process(path, "store.put(Allocation('b1', ('GPU-a::b1',), ('GPU-a',), {0: 1 << 30}, 10.0, "
                                      "'/r/b1', 1.0))\nstore.compact()\n")
    assert other.wait(60) == 0
    assert store.get("b1") is not None  # read again: the files changed under it
    store.put(_alloc("a2"))
    store.compact()
    assert sorted(StateStore(path).load()) == ["a1", "a2", "b1"]


def test_the_lock_excludes_another_process_and_its_wait_is_bounded(tmp_path):
    path = str(tmp_path / "s.json")
    holder = _in_another_process(path, "with store.lock:\n    print('held', flush=True)\n    time.sleep(3)\n")
    assert holder.stdout.readline() == "held\n"
    store = StateStore(path)
    store.lock.wait = 0.3
    with pytest.raises(PluginError, match=r"^state lock .*s\.json\.lock held by another process for 0\.3s$"):
        store.put(_alloc("a1"))
    store.lock.wait = 30
    t0 = time.monotonic()
    store.put(_alloc("a1"))  # waits for the holder, then goes on
    assert time.monotonic() - t0 > 0.5
    assert holder.wait(60) == 0
    assert list(StateStore(path).load()) == ["a1"]
