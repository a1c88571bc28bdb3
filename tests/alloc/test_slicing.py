"""Slice arithmetic: tables for each pure function, hypothesis properties for packing and limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.errors import PluginError
from mpsd.alloc.slicing import (
    MIB,
    SliceId,
    advertised_ids,
    allocation_id,
    parse_slice_id,
    plan_allocation,
    preferred_allocation,
    slice_share_bytes,
    thread_percentage,
)

from tests.plugin.conftest import GIB, FakeGpu

A, B, C = "GPU-a", "GPU-b", "GPU-c"


def ids(uuid: str, *slices: int) -> list[str]:
    return [f"{uuid}::{k}" for k in slices]


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("GPU-a::0", 10, SliceId("GPU-a", 0)),
        ("GPU-a::9", 10, SliceId("GPU-a", 9)),
        ("GPU-1234-ab::12", 100, SliceId("GPU-1234-ab", 12)),
        ("MIG-x::0", 1, SliceId("MIG-x", 0)),
    ],
)
def test_parse_slice_id(text, n, expected):
    assert parse_slice_id(text, n) == expected
    assert str(expected) == text


@pytest.mark.parametrize(
    "text", ["GPU-a::10", "GPU-a", "GPU-a::", "::3", "GPU-a::-1", "GPU-a::x", "GPU-a:3", "", "GPU-a::²", "GPU-a::٣"]
)
def test_parse_slice_id_rejects(text):
    with pytest.raises(PluginError, match="bad device ID") as info:
        parse_slice_id(text, 10)
    assert repr(text) in str(info.value) and "0..9" in str(info.value)


@pytest.mark.parametrize(
    "memory, n, shares",
    [
        (80 * GIB, 10, [8 * GIB] * 10),
        (10 * MIB, 3, [3 * MIB, 3 * MIB, 4 * MIB]),
        (10 * MIB + 12345, 3, [3 * MIB, 3 * MIB, 4 * MIB]),  # bytes below a MiB are not handed out
        (7 * MIB, 7, [MIB] * 7),
        (5 * MIB, 1, [5 * MIB]),
        (40536 * MIB, 7, [5790 * MIB, 5791 * MIB, 5791 * MIB, 5791 * MIB, 5791 * MIB, 5791 * MIB, 5791 * MIB]),
    ],
)
def test_slice_shares(memory, n, shares):
    assert [slice_share_bytes(memory, n, k) for k in range(n)] == shares


@pytest.mark.parametrize(
    "k, n, pct",
    [(1, 10, 10.0), (3, 10, 30.0), (7, 10, 70.0), (10, 10, 100.0), (1, 3, 33.33), (2, 3, 66.67), (1, 100, 1.0)],
)
def test_thread_percentage(k, n, pct):
    assert thread_percentage(k, n) == pct


def test_advertised_ids_in_index_order_and_validated():
    g = [FakeGpu(1, B, "x", GIB), FakeGpu(0, A, "x", GIB)]
    assert advertised_ids(g, 2) == ["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1"]
    with pytest.raises(PluginError, match=r"slicesPerGpu 0.*1\.\.100"):
        advertised_ids(g, 0)
    with pytest.raises(PluginError, match="longer than"):
        advertised_ids([FakeGpu(0, "GPU-" + "x" * 60, "x", GIB)], 10)


def test_allocation_id_is_stable_and_order_free():
    assert allocation_id(["GPU-a::1", "GPU-a::0"]) == allocation_id(["GPU-a::0", "GPU-a::1"])
    assert allocation_id(["GPU-a::0"]) != allocation_id(["GPU-a::1"])
    assert allocation_id(["GPU-a::0"]).startswith("alloc-")


TWO = [FakeGpu(0, A, "x", 80 * GIB), FakeGpu(1, B, "x", 40 * GIB)]


@pytest.mark.parametrize(
    "devices, limits, visible, pct",
    [
        (ids(A, 0, 1, 2), {0: 24 * GIB}, A, 30.0),  # 3 of 10
        (ids(A, 3, 4, 5, 6, 7, 8, 9), {0: 56 * GIB}, A, 70.0),  # 7 of 10
        (ids(B, 9), {0: 4 * GIB}, B, 10.0),  # ordinal 0 is what the container sees
        (ids(B, 0, 1) + ids(A, 5), {0: 8 * GIB, 1: 8 * GIB}, f"{A},{B}", 20.0),  # spans GPUs: max percentage
        (ids(A, *range(10)) + ids(B, *range(10)), {0: 80 * GIB, 1: 40 * GIB}, f"{A},{B}", 100.0),
    ],
)
def test_plan_allocation(devices, limits, visible, pct):
    plan = plan_allocation(devices, list(reversed(TWO)), 10)
    assert plan.memory_limits == limits
    assert plan.visible_devices == visible
    assert plan.active_thread_percentage == pct
    assert plan.spans_gpus == ("," in visible)
    assert plan.device_ids == tuple(sorted(devices))


@pytest.mark.parametrize(
    "devices, message",
    [
        ([], "empty allocation"),
        (["GPU-zz::0"], "GPU GPU-zz is not on this node"),
        (["GPU-a::10"], "slice 0..9"),
        (["GPU-a::1", "GPU-a::1"], "given twice"),
        (["nonsense"], "bad device ID 'nonsense'"),
    ],
)
def test_plan_allocation_rejects(devices, message):
    with pytest.raises(PluginError, match=message):
        plan_allocation(devices, TWO, 10)


ORDER = [A, B, C]


@pytest.mark.parametrize(
    "available, must, size, expected",
    [
        # empty node: the first GPU in index order
        (ids(A, *range(10)) + ids(B, *range(10)), [], 3, ids(A, 0, 1, 2)),
        # best fit: GPU-a has 4 free, GPU-b 10; a request of 3 leaves 1 on GPU-a
        (ids(A, 6, 7, 8, 9) + ids(B, *range(10)), [], 3, ids(A, 6, 7, 8)),
        # GPU-a cannot hold 3 any more: all on GPU-b
        (ids(A, 8, 9) + ids(B, *range(10)), [], 3, ids(B, 0, 1, 2)),
        # must_include pins the GPU even when another fits better
        (ids(A, 6, 7, 8, 9) + ids(B, *range(10)), ids(B, 5), 3, ids(B, 5) + ids(B, 0, 1)),
        # 12 of 10+10: one full GPU, then the rest on the other
        (ids(A, *range(10)) + ids(B, *range(10)), [], 12, ids(A, *range(10)) + ids(B, 0, 1)),
        # free 5, 4, 3 and 7 wanted: the biggest, then the best fit for 2 (GPU-c, leaves 1)
        (ids(A, *range(5)) + ids(B, *range(4)) + ids(C, *range(3)), [], 7, ids(A, *range(5)) + ids(C, 0, 1)),
        # must_include on two GPUs: both kept, rest filled from them before any other GPU
        (
            ids(A, 0, 1) + ids(B, 0, 1) + ids(C, *range(10)),
            ids(A, 1) + ids(B, 1),
            4,
            ids(A, 1) + ids(B, 1) + ids(A, 0) + ids(B, 0),
        ),
        # exact: the whole request is the must_include set
        (ids(A, 0, 1, 2), ids(A, 2, 0), 2, ids(A, 2, 0)),
        (ids(A, 0), [], 0, []),
    ],
)
def test_preferred_allocation(available, must, size, expected):
    assert preferred_allocation(available, must, size, ORDER) == expected


@pytest.mark.parametrize(
    "available, must, size, message",
    [
        (ids(A, 0, 1), [], 3, "size 3 with 2 device IDs available"),
        (ids(A, 0, 1), ids(A, 5), 1, "must-include device 'GPU-a::5' is not available"),
        (ids(A, 0, 1), ids(A, 0, 1), 1, "2 must-include devices but size 1"),
        (["junk"], [], 1, "bad device ID 'junk'"),
        (["GPU-a::²"], [], 1, "bad device ID 'GPU-a::²'"),
    ],
)
def test_preferred_allocation_rejects(available, must, size, message):
    with pytest.raises(PluginError, match=message):
        preferred_allocation(available, must, size, ORDER)


# -- properties ------------------------------------------------------------------------------


@st.composite
def node(draw):
    n = draw(st.integers(1, 16))
    mib = draw(st.lists(st.integers(1, 200 * 1024), min_size=1, max_size=4))
    gpu_list = [FakeGpu(i, f"GPU-{i}", "x", m * MIB) for i, m in enumerate(mib)]
    every = advertised_ids(gpu_list, n)
    available = draw(st.lists(st.sampled_from(every), unique=True, min_size=1)) if every else []
    return gpu_list, n, available


@st.composite
def request(draw):
    gpu_list, n, available = draw(node())
    size = draw(st.integers(1, len(available)))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=size))
    return gpu_list, n, available, must, size


def per_gpu(device_ids):
    counts: dict[str, int] = {}
    for d in device_ids:
        counts[d.rpartition("::")[0]] = counts.get(d.rpartition("::")[0], 0) + 1
    return counts


@settings(max_examples=300, deadline=None)
@given(request())
def test_preferred_is_a_valid_choice(req):
    gpu_list, n, available, must, size = req
    chosen = preferred_allocation(available, must, size, [g.uuid for g in gpu_list])
    assert len(chosen) == size
    assert len(set(chosen)) == size
    assert set(chosen) <= set(available)
    assert set(must) <= set(chosen)
    free = per_gpu(available)
    assert all(k <= free[u] for u, k in per_gpu(chosen).items())  # never more than a GPU has free


@settings(max_examples=300, deadline=None)
@given(request())
def test_preferred_uses_fewest_gpus_and_best_fit(req):
    gpu_list, n, available, _, size = req
    chosen = preferred_allocation(available, [], size, [g.uuid for g in gpu_list])
    free = sorted(per_gpu(available).values(), reverse=True)
    fewest = next(m for m in range(1, len(free) + 1) if sum(free[:m]) >= size)
    assert len(per_gpu(chosen)) == fewest
    fits = [k for k in free if k >= size]
    if fits:
        (uuid, taken), = per_gpu(chosen).items()
        assert per_gpu(available)[uuid] == min(fits)


@settings(max_examples=200, deadline=None)
@given(node(), st.data())
def test_filling_a_node_hands_out_each_slice_once_and_the_whole_memory(nd, data):
    gpu_list, n, _ = nd
    available = advertised_ids(gpu_list, n)
    order = [g.uuid for g in gpu_list]
    plans = []
    while available:
        size = data.draw(st.integers(1, len(available)))
        chosen = preferred_allocation(available, [], size, order)
        plans.append(plan_allocation(chosen, gpu_list, n))
        available = [d for d in available if d not in set(chosen)]
    handed = [d for p in plans for d in p.device_ids]
    assert len(handed) == len(set(handed)) == n * len(gpu_list)
    for g in gpu_list:
        shares = [s for p in plans for s in p.gpus if s.uuid == g.uuid]
        assert sum(s.memory_limit for s in shares) == g.memory_total  # no overlap, nothing lost
        assert sum(len(s.slices) for s in shares) == n
    for p in plans:
        assert 0 < p.active_thread_percentage <= 100
        assert p.active_thread_percentage == max(thread_percentage(len(s.slices), n) for s in p.gpus)
        assert sorted(p.memory_limits) == list(range(len(p.gpus)))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 1 << 45), st.integers(1, 100), st.data())
def test_limits_are_proportional_and_mib_aligned(memory, n, data):
    k = data.draw(st.integers(1, n))
    slices = data.draw(st.lists(st.integers(0, n - 1), unique=True, min_size=k, max_size=k))
    plan = plan_allocation([f"GPU-x::{s}" for s in slices], [FakeGpu(0, "GPU-x", "x", memory)], n)
    limit = plan.memory_limits[0]
    mib = memory // MIB
    assert limit % MIB == 0
    assert k * (mib // n) * MIB <= limit <= k * (mib // n + 1) * MIB  # every slice within 1 MiB of M/N
    assert abs(limit - k * mib * MIB / n) <= k * MIB
    assert limit <= memory
    total = sum(slice_share_bytes(memory, n, s) for s in range(n))
    assert total == mib * MIB and memory - total < MIB
