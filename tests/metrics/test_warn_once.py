"""The 'warn once per region' memories of the usage readers stay bounded: a node whose pods come
and go, each leaving an unreadable region, used to grow them by one path per pod forever."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

import shim
from mpsd.dra.claimusage import ClaimUsageReader
from mpsd.metrics.regions import ExecRegions
from mpsd.alloc.state import StateStore
from mpsd.plugin.usage import UsageTracker

PATHS = 3000  # distinct failing regions over the daemon's life
LIMIT = 1024  # keys a memory keeps (mpsd.logs.OncePerKey.LIMIT)


def refuse(path: str) -> dict[int, int]:
    raise OSError(f"unreadable region {path}")


def test_once_per_key_forgets_the_oldest_beyond_its_limit() -> None:
    from mpsd.logs import OncePerKey

    assert OncePerKey.LIMIT == LIMIT
    seen = OncePerKey(limit=3)
    assert [seen.first(k) for k in "abca"] == [True, True, True, False]
    assert seen.first("d") and len(seen) == 3  # b, the least recently seen, is forgotten
    assert seen.first("b") and not seen.first("a") and not seen.first("d")
    with pytest.raises(ValueError, match="limit"):
        OncePerKey(limit=0)


def test_claim_regions_that_ever_failed_are_not_all_remembered(caplog: pytest.LogCaptureFixture) -> None:
    def claims(batch: int) -> list[SimpleNamespace]:  # 100 claims at a time, then others
        names = ["stuck"] + [f"c{batch}-{i}" for i in range(99)]
        return [SimpleNamespace(uid=n, namespace="ns", name=n, region_dir=f"/nonexistent/{n}", gpus=(),
                                request_plans=lambda: [(None, SimpleNamespace(gpus=()))]) for n in names]

    now = [claims(0)]
    reader = ClaimUsageReader(lambda: now[0], refuse, None)
    with caplog.at_level(logging.WARNING):
        for batch in range(PATHS // 100):
            now[0] = claims(batch)
            reader.tick()
            reader.tick()
    assert len(reader._warned) <= LIMIT
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 + 99 * (PATHS // 100)  # once per region: the one failing all along too
    assert len([m for m in messages if "/nonexistent/stuck/" in m]) == 1


def test_allocation_warnings_that_ever_fired_are_not_all_remembered(tmp_path) -> None:
    tracker = UsageTracker(store=StateStore(str(tmp_path / "state.json")), region_root=str(tmp_path),
                           resource_name="mpsd.io/gpu", gpu_index={}, pod_resources_socket=None, metrics=None)
    for i in range(PATHS):  # e.g. "state not writable" lines whose error text changes
        tracker._warn_once(f"state:error {i}", "state not writable error=%s", i)
    assert len(tracker._warned) <= LIMIT


def test_exec_regions_that_ever_failed_are_not_all_remembered(tmp_path, monkeypatch) -> None:
    root = tmp_path / "exec"
    reader = ExecRegions(str(root), lambda: "/nonexistent/libmpsshim.so")
    monkeypatch.setattr(shim, "usage", lambda path, **kw: refuse(path))
    for batch in range(PATHS // 250):  # regions of exec'd processes come and go
        for name in os.listdir(root) if root.exists() else []:
            os.unlink(root / name / "region")
            os.rmdir(root / name)
        for i in range(250):
            (root / f"r{batch}-{i}").mkdir(parents=True)
            (root / f"r{batch}-{i}" / "region").write_bytes(b"x")
        assert reader() == []
    assert len(reader._warned) <= LIMIT
