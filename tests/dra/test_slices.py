"""The pure ResourceSlice builders (mpsd/dra/slices.py): tables, and a property that every
pool they build passes the schema (kubernetes-validate, strict) and the API's own rules."""
from __future__ import annotations

from decimal import Decimal

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.dra.slices import build_devices, build_slices, capacity_device, comparable, dropped_fields, slice_name_prefix
from mpsd.dra.values import quantity, semver
from mpsd.inventory.nvml import Gpu
from tests.dra.apirules import resource_slice_errors

MIB, GIB = 1 << 20, 1 << 30
H100 = Gpu(0, "GPU-5f1c0d3e-8a4b-4c2d-9e0f-112233445566", "NVIDIA H100 80GB HBM3", 81559 * MIB, 0, (9, 0), False)
T4 = Gpu(1, "GPU-0a0b0c0d-1111-2222-3333-444444444444", "Tesla T4", 15360 * MIB, 0, (7, 5), False)


@pytest.mark.parametrize("text, version", [
    ("580.95.05", "580.95.5"), ("550.163.01", "550.163.1"), ("535.104.05", "535.104.5"), ("9.0", "9.0.0"),
    ("12", "12.0.0"), (" 570.86.10 ", "570.86.10"), ("1.2.3.4", None), ("580.95.05-beta", None), ("", None),
    ("abc", None), ("v580", None),
])
def test_semver(text: str, version: str | None) -> None:
    assert semver(text) == version


@pytest.mark.parametrize("value, binary, text", [
    (16 * GIB, True, "16Gi"), (256 * MIB, True, "256Mi"), (1638 * MIB, True, "1638Mi"), (1024 * GIB, True, "1Ti"),
    (1536, True, "1536"), (1024, True, "1Ki"), (100, False, "100"), (25, False, "25"), (33.33, False, "33330m"),
    (14.29, False, "14290m"), (0, True, "0"),
])
def test_quantity_is_the_api_servers_canonical_form(value: float, binary: bool, text: str) -> None:
    assert quantity(value, binary) == text


def test_a_capacity_mode_device() -> None:
    device = capacity_device(H100, "580.95.05", 10)
    assert device == {
        "name": "gpu-0",
        "attributes": {
            "index": {"int": 0}, "uuid": {"string": H100.uuid}, "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "computeCapability": {"version": "9.0.0"}, "memory": {"int": 81559 * MIB}, "mps": {"bool": True},
            "driverVersion": {"version": "580.95.5"},
        },
        "allowMultipleAllocations": True,
        "capacity": {
            "memory": {"value": "81559Mi", "requestPolicy": {
                "default": "8155Mi", "validRange": {"min": "256Mi", "max": "81559Mi", "step": "1Mi"}}},
            "compute": {"value": "100", "requestPolicy": {
                "default": "10", "validRange": {"min": "1", "max": "100", "step": "1"}}},
        },
    }


@pytest.mark.parametrize("slices_per_gpu, memory, compute", [
    (1, "15Gi", "100"), (4, "3840Mi", "25"), (3, "5Gi", "33"), (100, "256Mi", "1"),  # 153Mi is below the minimum
])
def test_defaults_are_one_device_plugin_slice(slices_per_gpu: int, memory: str, compute: str) -> None:
    capacity = capacity_device(T4, "", slices_per_gpu)["capacity"]
    assert capacity["memory"]["requestPolicy"]["default"] == memory
    assert capacity["compute"]["requestPolicy"]["default"] == compute


def test_a_gpu_without_room_for_one_minimum_slice_is_refused_in_one_line() -> None:
    tiny = Gpu(3, "GPU-tiny", "Tiny", 256 * MIB, 0, (7, 0), False)
    with pytest.raises(ValueError, match=r"^GPU 3 \(GPU-tiny\) has 256 MiB: capacity mode needs more than 256$"):
        capacity_device(tiny, "", 10)


def test_an_unparsable_driver_version_is_left_out() -> None:
    assert "driverVersion" not in capacity_device(T4, "unknown", 10)["attributes"]


def test_slices_mode_devices_add_up_to_the_gpu() -> None:
    devices = build_devices([T4, H100], "slices", 3, "580.95.05")
    assert [d["name"] for d in devices] == [f"gpu-{g}-slice-{k}" for g in (0, 1) for k in range(3)]
    for gpu in (H100, T4):
        mine = [d for d in devices if d["attributes"]["uuid"]["string"] == gpu.uuid]
        assert sum(int(comparable([d])[0]["capacity"]["memory"]["value"]) for d in mine) == gpu.memory_total
        assert [d["attributes"]["slice"] for d in mine] == [{"int": k} for k in range(3)]
        assert {d["capacity"]["compute"]["value"] for d in mine} == {"33330m"}
        assert all("allowMultipleAllocations" not in d for d in mine)


def test_mig_gpus_are_left_out_and_order_is_by_index() -> None:
    mig = Gpu(2, "GPU-mig", "NVIDIA A100", 40 * GIB, 0, (8, 0), True)
    assert [d["name"] for d in build_devices([T4, mig, H100], "capacity", 10)] == ["gpu-0", "gpu-1"]


@pytest.mark.parametrize("mode, n, message", [
    ("shared", 10, "bad dra.mode 'shared': expected one of capacity, slices"),
    ("slices", 0, "bad slicesPerGpu 0: expected an integer 1..100"),
    ("slices", 101, "bad slicesPerGpu 101"),
])
def test_bad_mode_or_count(mode: str, n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_devices([T4], mode, n)


def _gpus(count: int) -> list[Gpu]:
    return [Gpu(i, f"GPU-{i}", "NVIDIA L4", 24 * GIB, 0, (8, 9), False) for i in range(count)]


@pytest.mark.parametrize("mode, gpus, n, sizes", [
    ("capacity", 0, 10, [0]),  # no GPU: one empty slice, so the pool exists and says so
    ("capacity", 1, 10, [1]),
    ("capacity", 8, 10, [1] * 8),  # one slice per GPU: 1.34's scheduler checks the slice's first device
    ("slices", 2, 10, [10, 10]),
    ("slices", 2, 64, [64, 64]),
    ("slices", 2, 100, [64, 36, 64, 36]),  # at most 64 devices in a slice (the limit once a device has taints)
])
def test_a_pool_has_a_slice_per_gpu(mode: str, gpus: int, n: int, sizes: list[int]) -> None:
    """kubernetes/kubernetes#133705 (fixed in 1.35 by #133706, not in 1.34): the 1.34 scheduler
    checks a request's capacity against the device at the request's index in the slice, so with
    every GPU in one slice only GPU 0's capacity counts. One slice per GPU leaves it one device."""
    devices = build_devices(_gpus(gpus), mode, n)
    slices = build_slices(devices, "gpu.mpsd.io", "node-a", 7)
    assert [len(s["spec"]["devices"]) for s in slices] == sizes
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices} == \
        {(7, len(sizes))}
    assert [d for s in slices for d in s["spec"]["devices"]] == devices
    for s in slices:  # no slice holds two GPUs
        assert len({d["attributes"]["index"]["int"] for d in s["spec"]["devices"]}) <= 1


def test_taints_go_on_every_device_of_their_gpu() -> None:
    taint = {"key": "gpu.mpsd.io/unhealthy", "value": "MPSServerFault", "effect": "NoSchedule",
             "timeAdded": "2026-05-01T10:00:00Z"}
    devices = build_devices(_gpus(2), "slices", 3, taints={1: [taint]})
    assert [d.get("taints") for d in devices] == [None] * 3 + [[taint]] * 3
    capacity = build_devices(_gpus(2), "capacity", 3, taints={0: [taint]})
    assert [d.get("taints") for d in capacity] == [[taint], None]


def test_comparable_leaves_out_the_time_a_taint_was_added() -> None:
    """The API server adds timeAdded when it is not set (the field's description in the 1.37
    schema): a stored taint compares equal to the same taint without it."""
    taint = {"key": "gpu.mpsd.io/unhealthy", "value": "MPSDaemonDown", "effect": "NoSchedule"}
    ours = build_devices(_gpus(1), "capacity", 3, taints={0: [taint]})
    stored = build_devices(_gpus(1), "capacity", 3, taints={0: [{**taint, "timeAdded": "2026-05-01T10:00:00Z"}]})
    assert comparable(ours) == comparable(stored)
    assert comparable(ours) != comparable(build_devices(_gpus(1), "capacity", 3))


def test_slice_names_leave_room_for_the_servers_suffix() -> None:
    assert slice_name_prefix("node-a", "gpu.mpsd.io") == "node-a-gpu.mpsd.io-"
    assert len(slice_name_prefix("n" * 253, "gpu.mpsd.io")) + 5 <= 253


def test_comparable_reads_quantities_by_value() -> None:
    ours = capacity_device(T4, "", 10)
    stored = {**ours, "capacity": {"memory": {**ours["capacity"]["memory"], "value": str(15360 * MIB)},
                                   "compute": ours["capacity"]["compute"]}}
    assert stored != ours and comparable([stored]) == comparable([ours])
    assert comparable([ours])[0]["capacity"]["compute"]["requestPolicy"]["default"] == Decimal(10)


gpus = st.lists(st.builds(
    Gpu, index=st.integers(0, 15), uuid=st.uuids().map(lambda u: f"GPU-{u}"),
    name=st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=96),
    memory_total=st.integers(257 * MIB, 192 * GIB), memory_used=st.just(0),
    compute_capability=st.tuples(st.integers(3, 12), st.integers(0, 9)), mig_enabled=st.booleans(),
), max_size=8, unique_by=lambda g: g.index)


@settings(max_examples=40, deadline=None)
@given(gpus=gpus, mode=st.sampled_from(["capacity", "slices"]), n=st.integers(1, 100),
       driver=st.sampled_from(["580.95.05", "550.54", "garbage", ""]))
def test_every_pool_passes_the_schema_and_the_api_rules(gpus: list[Gpu], mode: str, n: int, driver: str) -> None:
    taint = {"key": "gpu.mpsd.io/unhealthy", "value": "MPSDaemonDown", "effect": "NoExecute",
             "timeAdded": "2026-05-01T10:00:00Z"}
    taints = {g.index: [taint] for g in gpus[::2]}  # some GPUs tainted: at most 64 devices in their slices
    for obj in build_slices(build_devices(gpus, mode, n, driver, taints=taints), "gpu.mpsd.io", "node-a", 1):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert resource_slice_errors(obj) == []


TAINT = {"key": "gpu.mpsd.io/unhealthy", "value": "MPSDaemonDown", "effect": "NoSchedule"}


def _strip(device: dict, *fields: str) -> dict:
    out = {k: v for k, v in device.items() if k not in fields}
    if "requestPolicy" in fields:
        out["capacity"] = {k: {f: x for f, x in c.items() if f != "requestPolicy"} for k, c in device["capacity"].items()}
    return out


@pytest.mark.parametrize("stored, dropped", [
    (lambda d: d, {}),
    (lambda d: {**d, "taints": [{**TAINT, "timeAdded": "2026-05-01T10:00:00Z"}]}, {}),  # the server's time
    (lambda d: _strip(d, "allowMultipleAllocations", "requestPolicy"),
     {"DRAConsumableCapacity": ["allowMultipleAllocations", "capacity.requestPolicy"]}),
    (lambda d: _strip(d, "taints"), {"DRADeviceTaints": ["taints"]}),
    (lambda d: _strip(d, "taints", "allowMultipleAllocations", "requestPolicy"),
     {"DRAConsumableCapacity": ["allowMultipleAllocations", "capacity.requestPolicy"], "DRADeviceTaints": ["taints"]}),
    (lambda d: {**d, "attributes": {}}, {"unknown": ["attributes"]}),
    (lambda d: {**d, "name": "gpu-9"}, {"unknown": ["devices"]}),
])
def test_dropped_fields_name_the_gate(stored, dropped: dict) -> None:
    (sent,) = build_devices([H100], "capacity", 4, taints={0: [TAINT]})
    assert dropped_fields([sent], [stored(sent)]) == dropped
