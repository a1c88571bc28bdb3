"""SlicePublisher against the stand-in API server (every write validated, strict): the node's
pool is written once, rewritten with the next generation on a GPU or config change, split at
128 devices, converges after failures and conflicts, and is removed on shutdown."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from mpsd.dra.kubeapi import KubeAPI
from mpsd.dra.publisher import SlicePublisher
from mpsd.errors import KubeAPIError
from mpsd.inventory.nvml import Gpu, Inventory
from mpsd.registry import Metrics
from tests.dra.apiserver import StandInAPIServer
from tests.fakes.nvml_build import nvml_config_text

MIB, GIB = 1 << 20, 1 << 30
DRIVER, NODE = "gpu.mpsd.io", "node-a"
GPU0 = Gpu(0, "GPU-5f1c0d3e-8a4b-4c2d-9e0f-112233445566", "NVIDIA H100 80GB HBM3", 80 * GIB, 0, (9, 0), False)
GPU1 = Gpu(1, "GPU-0a0b0c0d-1111-2222-3333-444444444444", "NVIDIA H100 80GB HBM3", 80 * GIB, 0, (9, 0), False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api(kubeconfig: Path) -> Any:
    with KubeAPI.from_environment(timeout=30) as client:
        yield client


def publisher(api: KubeAPI, mode: str = "capacity", slices_per_gpu: int = 10, clock: Clock | None = None,
              node: str = NODE) -> SlicePublisher:
    return SlicePublisher(api, DRIVER, node, mode, slices_per_gpu, resync_interval=60, clock=clock or Clock())


def pool(server: StandInAPIServer, node: str = NODE) -> tuple[set[tuple[int, int]], list[str]]:
    """{(generation, resourceSliceCount)} of the node's slices, and their device names."""
    slices = server.pool_slices(DRIVER, node)
    assert all(s["spec"]["pool"]["name"] == node for s in slices)
    shapes = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}
    return shapes, sorted(d["name"] for s in slices for d in s["spec"]["devices"])


def by_gpu(server: StandInAPIServer, node: str = NODE) -> list[dict]:
    """The node's slices in GPU order."""
    return sorted(server.pool_slices(DRIVER, node), key=lambda s: s["spec"]["devices"][0]["name"])


def test_first_publish_writes_a_slice_per_gpu(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    assert publisher(api).publish([GPU1, GPU0], "580.95.05") is True
    first, second = by_gpu(apiserver)
    for slice_obj in (first, second):
        spec = slice_obj["spec"]
        assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
        assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}
        assert slice_obj["metadata"]["name"].startswith(f"{NODE}-{DRIVER}-")
    assert [d["name"] for d in first["spec"]["devices"]] == ["gpu-0"]
    assert [d["name"] for d in second["spec"]["devices"]] == ["gpu-1"]
    assert first["spec"]["devices"][0]["allowMultipleAllocations"] is True
    assert second["spec"]["devices"][0]["attributes"]["uuid"] == {"string": GPU1.uuid}


def test_unchanged_gpus_write_nothing_and_ask_nothing_until_the_resync(apiserver: StandInAPIServer,
                                                                       api: KubeAPI) -> None:
    clock = Clock()
    pub = publisher(api, clock=clock)
    pub.publish([GPU0], "580.95.05")
    before = len(apiserver.requests)
    assert pub.publish([GPU0], "580.95.05") is False
    assert len(apiserver.requests) == before  # no API call at all
    clock.now += 61
    assert pub.publish([GPU0], "580.95.05") is False
    assert apiserver.requests[before:] == [("GET", apiserver.requests[0][1])]  # one list, no write


def test_a_restarted_mpsd_finds_its_pool_current(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    publisher(api).publish([GPU0, GPU1], "580.95.05")
    # the real API server stores quantities in its own spelling: they compare by value
    stored = by_gpu(apiserver)[0]
    apiserver.slices[stored["metadata"]["name"]]["spec"]["devices"][0]["capacity"]["memory"]["value"] = str(80 * GIB)
    writes = len(apiserver.writes())
    assert publisher(api).publish([GPU0, GPU1], "580.95.05") is False
    assert len(apiserver.writes()) == writes


@pytest.mark.parametrize("change", ["gpu removed", "gpu added", "memory", "driver version"])
def test_a_gpu_change_rewrites_the_pool_with_the_next_generation(apiserver: StandInAPIServer, api: KubeAPI,
                                                                 change: str) -> None:
    pub = publisher(api)
    pub.publish([GPU0, GPU1], "580.95.05")
    names = sorted(apiserver.slices)
    gpus, version = {
        "gpu removed": ([GPU0], "580.95.05"),
        "gpu added": ([GPU0, GPU1, Gpu(2, "GPU-2", "NVIDIA L4", 24 * GIB, 0, (8, 9), False)], "580.95.05"),
        "memory": ([GPU0, Gpu(1, GPU1.uuid, GPU1.name, 40 * GIB, 0, (9, 0), False)], "580.95.05"),
        "driver version": ([GPU0, GPU1], "580.105.08"),
    }[change]
    assert pub.publish(gpus, version) is True
    assert pool(apiserver)[0] == {(2, len(gpus))}
    kept = sorted(set(names) & set(apiserver.slices))
    assert len(kept) == min(2, len(gpus))  # updated in place
    writes = [m for m, _ in apiserver.writes()][2:]
    assert writes == {"gpu removed": ["PUT", "DELETE"], "gpu added": ["PUT", "PUT", "POST"]}.get(change, ["PUT", "PUT"])


def test_a_mode_change_rewrites_the_pool(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    publisher(api, "capacity").publish([GPU0], "580.95.05")
    assert publisher(api, "slices", 4).publish([GPU0], "580.95.05") is True
    assert pool(apiserver) == ({(2, 1)}, sorted(f"gpu-0-slice-{k}" for k in range(4)))
    assert publisher(api, "slices", 2).publish([GPU0], "580.95.05") is True
    assert pool(apiserver) == ({(3, 1)}, ["gpu-0-slice-0", "gpu-0-slice-1"])


def test_a_gpu_of_more_than_64_devices_is_split_and_joined_again(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    gpus = [Gpu(i, f"GPU-{i}", "NVIDIA L4", 24 * GIB, 0, (8, 9), False) for i in range(2)]
    pub = publisher(api, "slices", 100)
    pub.publish(gpus, "580.95.05")  # 200 devices: 64 + 36 per GPU
    shapes, names = pool(apiserver)
    assert shapes == {(1, 4)} and len(names) == 200 and len(apiserver.slices) == 4
    pub.publish(gpus[:1], "580.95.05")  # 100 devices: two slices, the other two deleted
    shapes, names = pool(apiserver)
    assert shapes == {(2, 2)} and len(names) == 100 and len(apiserver.slices) == 2
    assert [m for m, _ in apiserver.writes()][-4:] == ["PUT", "PUT", "DELETE", "DELETE"]


def test_remove_deletes_only_this_nodes_slices_of_the_driver(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    publisher(api, "slices", 100).publish([GPU0, GPU1])  # 200 devices, 4 slices
    publisher(api, node="node-b").publish([GPU0])
    assert publisher(api).remove() == 4
    assert pool(apiserver) == (set(), [])
    assert pool(apiserver, "node-b")[1] == ["gpu-0"]
    assert publisher(api).remove() == 0


def test_an_api_server_that_is_down_raises_and_the_next_publish_converges(apiserver: StandInAPIServer,
                                                                          api: KubeAPI) -> None:
    pub = publisher(api, "slices", 100)
    apiserver.stop()
    with pytest.raises(KubeAPIError, match="cannot reach the API server"):
        pub.publish([GPU0, GPU1])
    apiserver.start()
    apiserver.fail["POST"] = [None, 500]  # the second slice of four fails: half a pool is on the server
    with pytest.raises(KubeAPIError, match="500"):
        publisher(api, "slices", 100).publish([GPU0, GPU1])
    assert pool(apiserver)[0] == {(1, 4)} and len(apiserver.slices) == 1
    assert pub.publish([GPU0, GPU1]) is True
    shapes, names = pool(apiserver)
    assert shapes == {(2, 4)} and len(names) == 200


def test_a_conflict_is_retried_from_a_fresh_list(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    pub = publisher(api)
    pub.publish([GPU0])
    apiserver.fail["PUT"] = [409]
    assert pub.publish([GPU0, GPU1]) is True
    assert pool(apiserver) == ({(2, 2)}, ["gpu-0", "gpu-1"])


def test_a_pool_deleted_behind_mpsds_back_is_written_again_at_the_resync(apiserver: StandInAPIServer,
                                                                         api: KubeAPI) -> None:
    clock = Clock()
    pub = publisher(api, clock=clock)
    pub.publish([GPU0])
    apiserver.slices.clear()  # e.g. the kubelet wiped the node's slices
    clock.now += 61
    assert pub.publish([GPU0]) is True
    assert pool(apiserver) == ({(2, 1)}, ["gpu-0"])


def test_the_nodes_gpus_from_nvml_are_published(apiserver: StandInAPIServer, api: KubeAPI, fake_nvml_lib: Path,
                                               nvml_config: Any) -> None:
    nvml_config(nvml_config_text(gpus=[
        ("GPU-5f1c0d3e-8a4b-4c2d-9e0f-112233445566", 80 * GIB, 0, (9, 0), False, "NVIDIA H100 80GB HBM3"),
        ("GPU-0a0b0c0d-1111-2222-3333-444444444444", 15 * GIB, 0, (7, 5), False, "Tesla T4"),
    ], driver="580.95.05"))
    with Inventory(library_path=str(fake_nvml_lib)) as inventory:
        assert publisher(api).publish(inventory.gpus(), inventory.driver_version()) is True
    t4 = by_gpu(apiserver)[1]["spec"]["devices"][0]
    assert t4["attributes"]["productName"] == {"string": "Tesla T4"}
    assert t4["attributes"]["computeCapability"] == {"version": "7.5.0"}
    assert t4["attributes"]["driverVersion"] == {"version": "580.95.5"}
    assert t4["capacity"]["memory"]["value"] == "15Gi"


NODE_OBJ = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "uid": "3f1a2b4c-5d6e-4f70-8192-a3b4c5d6e7f8"}}


def test_slices_are_owned_by_the_node_when_its_uid_is_known(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    apiserver.nodes[NODE] = NODE_OBJ
    uid = api.get_node_uid(NODE)
    assert uid == NODE_OBJ["metadata"]["uid"]
    publisher(api).publish([GPU0])  # an older mpsd: no owner
    owned = SlicePublisher(api, DRIVER, NODE, "capacity", 10, node_uid=uid)
    assert owned.publish([GPU0]) is True  # same devices, but the owner is missing: rewritten
    (slice_obj,) = apiserver.pool_slices(DRIVER, NODE)
    assert slice_obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]
    assert SlicePublisher(api, DRIVER, NODE, "capacity", 10, node_uid=uid).publish([GPU0]) is False


def test_an_unknown_node_is_one_line(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    with pytest.raises(KubeAPIError, match="get Node node-x: API server answered 404"):
        api.get_node_uid("node-x")


def test_invalidate_makes_the_next_publish_check_at_once(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    pub = publisher(api)
    pub.publish([GPU0])
    apiserver.slices.clear()  # the kubelet restarted and wiped the node's slices
    assert pub.publish([GPU0]) is False  # within the resync interval: not seen
    pub.invalidate()  # the kubelet registered the plugin again
    assert pub.publish([GPU0]) is True
    assert pool(apiserver) == ({(2, 1)}, ["gpu-0"])


def samples(metrics: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for f in metrics.registry.collect() for s in f.samples
            if s.name == name}


@pytest.mark.parametrize("gate, mode, taints, fields", [
    ("DRAConsumableCapacity", "capacity", {}, ["allowMultipleAllocations", "capacity.requestPolicy"]),
    ("DRADeviceTaints", "slices", {1: [{"key": "gpu.mpsd.io/unhealthy", "value": "MPSDaemonDown",
                                        "effect": "NoSchedule"}]}, ["taints"]),
])
def test_fields_a_gate_off_drops_are_said_once_and_not_written_again(
        apiserver: StandInAPIServer, api: KubeAPI, caplog: pytest.LogCaptureFixture,
        gate: str, mode: str, taints: dict, fields: list[str]) -> None:
    """1.34/1.35 API servers drop allowMultipleAllocations and requestPolicy (DRAConsumableCapacity
    off): a publisher that compared what it wants with what is stored rewrote the pool, with a new
    generation, at every resync, forever."""
    apiserver.gates_off = {gate}
    clock, metrics = Clock(), Metrics()
    pub = SlicePublisher(api, DRIVER, NODE, mode, 4, resync_interval=60, clock=clock, metrics=metrics)
    with caplog.at_level(logging.ERROR, logger="mpsd.dra.publisher"):
        assert pub.publish([GPU0, GPU1], "580.95.05", taints) is True
        writes, generation = len(apiserver.writes()), pub.generation
        for _ in range(3):  # resyncs: the same content is not written again
            clock.now += 61
            assert pub.publish([GPU0, GPU1], "580.95.05", taints) is False
        assert len(apiserver.writes()) == writes and pool(apiserver)[0] == {(generation, 2)}
        assert pub.publish([GPU0, GPU1], "580.105.08", taints) is True  # new content is written, once
        clock.now += 61
        assert pub.publish([GPU0, GPU1], "580.105.08", taints) is False
    assert pub.dropped == {gate: fields}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert f"feature gate {gate} is off" in lines[0] and ", ".join(fields) in lines[0]
    assert ("dra.mode: slices" if gate == "DRAConsumableCapacity" else "dra.taintEffect: none") in lines[0]
    dropped = samples(metrics, "mpsd_dra_slice_fields_dropped")
    assert dropped[(("gate", gate),)] == 1.0 and sum(dropped.values()) == 1.0
    assert samples(metrics, "mpsd_dra_slice_writes_total")[()] == 4.0  # two pool writes of two slices


def test_a_gate_on_stores_everything_and_nothing_is_reported(apiserver: StandInAPIServer, api: KubeAPI) -> None:
    metrics = Metrics()
    pub = SlicePublisher(api, DRIVER, NODE, "capacity", 4, metrics=metrics)
    assert pub.publish([GPU0], "580.95.05") is True
    assert pub.dropped == {}
    assert set(samples(metrics, "mpsd_dra_slice_fields_dropped").values()) == {0.0}


def test_fields_a_slice_uses_already_are_kept_when_the_gate_goes_off(apiserver: StandInAPIServer,
                                                                      api: KubeAPI) -> None:
    """The registry keeps a gated field on update when the stored slice uses it (dropDisabledFields'
    'feature in use' rule): nothing is dropped then, and nothing is reported."""
    publisher(api).publish([GPU0])
    apiserver.gates_off = {"DRAConsumableCapacity"}
    pub = publisher(api)
    assert pub.publish([GPU0], "580.95.05") is True
    assert pub.dropped == {}
    assert by_gpu(apiserver)[0]["spec"]["devices"][0]["allowMultipleAllocations"] is True


TAINT = {"key": "gpu.mpsd.io/unhealthy", "value": "MPSServerFault", "effect": "NoSchedule"}


def test_a_taint_is_a_pool_write_and_its_time_stays_until_recovery(apiserver: StandInAPIServer,
                                                                   api: KubeAPI) -> None:
    clock = Clock()
    pub = publisher(api, clock=clock)
    pub.publish([GPU0, GPU1], "580.95.05")
    assert pub.publish([GPU0, GPU1], "580.95.05", {1: [TAINT]}) is True  # no timeAdded: the server sets it
    assert pool(apiserver)[0] == {(2, 2)}  # every slice of the pool, the next generation
    (stored,) = by_gpu(apiserver)[1]["spec"]["devices"][0]["taints"]
    assert stored["value"] == "MPSServerFault" and stored["timeAdded"].endswith("Z")
    assert "taints" not in by_gpu(apiserver)[0]["spec"]["devices"][0]
    writes = len(apiserver.writes())
    clock.now += 61
    assert pub.publish([GPU0, GPU1], "580.95.05", {1: [TAINT]}) is False  # the server's timeAdded is no change
    assert len(apiserver.writes()) == writes
    later = {**TAINT, "timeAdded": "2030-01-01T00:00:00Z"}
    assert pub.publish([GPU0, GPU1], "580.105.08", {1: [later]}) is True  # another change: the time stays
    assert by_gpu(apiserver)[1]["spec"]["devices"][0]["taints"] == [stored]
    assert pub.publish([GPU0, GPU1], "580.105.08") is True  # recovered
    assert pool(apiserver)[0] == {(4, 2)}
    assert all("taints" not in d for s in by_gpu(apiserver) for d in s["spec"]["devices"])
