"""What a misbehaving kubelet, a hostile pod or a damaged file can throw at the plugin: every
answer is a one-line gRPC error or a logged line, never a hang, a traceback or a lost slice.
Real gRPC on unix sockets against the fake kubelet, as in test_grpc."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from mpsd.plugin import api_pb2

from tests.plugin.conftest import allocate, gpus, stub, wait_for

EMPTY = api_pb2.Empty()


def prefer(s, available, size, must=()):
    req = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=list(available), must_include_deviceIDs=list(must), allocation_size=size
            )
        ]
    )
    return list(s.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)


@pytest.mark.parametrize("number", ["1" * 5000, "9" * 50, "007", "01"])
def test_allocate_with_a_bad_slice_number_is_a_one_line_invalid_argument(started, number):
    g = gpus(80)
    _, s = stub(started(g))
    with pytest.raises(grpc.RpcError) as info:
        allocate(s, [f"{g[0].uuid}::{number}"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "bad device ID" in details and "\n" not in details and len(details) < 400


def test_preferred_allocation_never_returns_one_slice_twice(started):
    g = gpus(80)
    _, s = stub(started(g))
    u = g[0].uuid
    with pytest.raises(grpc.RpcError) as info:
        prefer(s, [f"{u}::1", f"{u}::01", f"{u}::2"], 2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'{u}::01'" in info.value.details() and "\n" not in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        prefer(s, [f"{u}::1", f"{u}::2"], 1, must=[f"{u}::{'1' * 5000}"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert prefer(s, [f"{u}::1", f"{u}::2", f"{u}::3"], 2) == [f"{u}::1", f"{u}::2"]  # still serving


def test_deeply_nested_state_file_is_moved_aside_and_the_plugin_starts_empty(env, kubelet, caplog):
    env.state_path.parent.mkdir(parents=True, exist_ok=True)
    content = b'{"version": 1, "allocations": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    env.state_path.write_bytes(content)
    g = gpus(80)
    plugin = env.plugin(g)
    with caplog.at_level("ERROR", logger="mpsd.alloc.state"):
        plugin.start()
    try:
        assert plugin.store.all() == []
        aside = [p for p in env.state_path.parent.iterdir() if p.name.startswith(env.state_path.name + ".bad")]
        assert [p.read_bytes() for p in aside] == [content]  # nothing lost
        lines = [r for r in caplog.records if "state file unreadable" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0].getMessage()
        _, s = stub(plugin)
        allocate(s, [f"{g[0].uuid}::0"])  # and it serves
        assert len(plugin.store.all()) == 1
    finally:
        plugin.stop()


def test_many_list_and_watch_streams_do_not_starve_allocate(started):
    g = gpus(80)
    plugin = started(g)
    calls = []
    channels = []
    for _ in range(12):  # more than the server had workers: each stream holds one while open
        channel, s = stub(plugin)
        channels.append(channel)
        call = s.ListAndWatch(EMPTY)
        calls.append(call)
    first = []

    def read(call) -> None:
        try:
            first.append(next(call))
        except grpc.RpcError as exc:
            first.append(exc)

    readers = [threading.Thread(target=read, args=(c,), daemon=True) for c in calls]
    for t in readers:
        t.start()
    for t in readers:
        t.join(10)
    assert len(first) == 12  # every stream got its list or a refusal, none waits
    refused = [x for x in first if isinstance(x, grpc.RpcError)]
    assert all(x.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for x in refused), refused
    assert len(refused) <= 12 - 8  # at least as many streams as before are served
    _, s = stub(plugin)
    t0 = time.monotonic()
    reply = allocate(s, [f"{g[0].uuid}::0"])  # timeout=10 inside
    assert time.monotonic() - t0 < 5.0  # starved, it waited out its 10 s deadline
    assert reply.container_responses[0].envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    for call in calls:
        call.cancel()
    # cancelled streams give their places back: a new one is served
    assert wait_for(lambda: plugin.servicer._streams == 0)
    assert len(next(s.ListAndWatch(EMPTY, timeout=5)).devices) == 10
