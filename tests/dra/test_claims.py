"""Claim parsing: what a ResourceClaim gives a container on this node, and every refusal in one line."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from mpsd.dra.claims import ClaimRef, parse_quantity, plan_claim, selects_node
from mpsd.errors import DraError
from mpsd.alloc.slicing import slice_share_bytes

from tests.dra.conftest import DRIVER, GIB, NODE, claim, gpus, opaque, result

MIB = 1 << 20
REF = ClaimRef("ns", "c1", "uid-1")


def plan(c, slices=4, gpu_list=None):
    return plan_claim(c, REF, driver=DRIVER, node=NODE, pool=NODE, gpus=gpu_list or gpus(80, 40),
                      slices_per_gpu=slices)


@pytest.mark.parametrize("text, value", [
    ("4Gi", 4 * GIB), ("25", 25), ("0.5", Fraction(1, 2)), ("500m", Fraction(1, 2)), ("1e3", 1000),
    ("1k", 1000), ("1Mi", MIB), ("+2", 2), ("-1", -1), (".5", Fraction(1, 2)), ("12.5", Fraction(25, 2)),
    ("1E", 10**18), ("1Ei", 1 << 60), ("1E3", 1000), ("Gi", 0),  # as the API server reads them (test_quantity.py)
])
def test_quantities(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "4 Gi", "4GB", "4gi", "1e", "--1", 4, None, "1" * 70, "4Gi\n"])
def test_bad_quantities(text):
    with pytest.raises(ValueError, match="bad quantity"):
        parse_quantity(text)


# consumed (memory, compute) -> (limit bytes of the 80 GiB GPU 0, thread percentage)
@pytest.mark.parametrize("memory, compute, limit, percent", [
    ("20Gi", "25", 20 * GIB, 25.0),
    ("20Gi", None, 20 * GIB, 25.0),  # compute from memory: 20/80
    ("1Gi", None, GIB, 1.25),
    ("1000Mi", None, 1000 * MIB, 1.23),  # 1.2207...: rounded up to a hundredth
    (None, "25", 20 * GIB, 25.0),  # memory from compute: a quarter
    (None, "33", 27033 * MIB, 33.0),  # 26.4 GiB rounded down to a MiB
    (None, None, 80 * GIB, 100.0),  # nothing consumed: the whole GPU
    ("80Gi", "100", 80 * GIB, 100.0),
    ("1500000000", "10", 1430 * MIB, 10.0),  # bytes, rounded down to a MiB
])
def test_capacity_mode_limits(memory, compute, limit, percent):
    p = plan(claim(results=[result(memory=memory, compute=compute)]))
    assert p.plan.memory_limits == {0: limit}
    assert p.plan.active_thread_percentage == percent
    assert p.plan.gpus[0].uuid == gpus(80, 40)[0].uuid
    assert [r.device for r in p.results] == ["gpu-0"]
    assert p.pods == ("pod-a",)


def test_slices_mode_gives_the_device_plugins_share():
    p = plan(claim(results=[result(device="gpu-1-slice-2", memory=None), result(device="gpu-1-slice-3", memory=None)]))
    total = 40 * GIB
    assert p.plan.memory_limits == {0: slice_share_bytes(total, 4, 2) + slice_share_bytes(total, 4, 3)}
    assert p.plan.active_thread_percentage == 50.0
    assert p.plan.gpus[0].index == 1 and p.plan.gpus[0].slices == (2, 3)


def test_two_gpus_each_get_their_own_limit_and_the_largest_percentage():
    p = plan(claim(results=[result(device="gpu-1", memory="10Gi"), result(device="gpu-0", request="b", memory="8Gi")]))
    assert p.plan.memory_limits == {0: 8 * GIB, 1: 10 * GIB}  # ordinals in host index order
    assert p.plan.active_thread_percentage == 25.0  # 10 of 40 GiB


def test_client_priority_from_the_opaque_config_the_claims_wins():
    base = {"apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig"}
    cfg = [opaque({**base, "clientPriority": 0}, source="FromClass"),
           opaque({**base, "clientPriority": 1}),
           opaque({"whatever": True}, driver="other.example.com")]
    assert plan(claim(config=cfg)).client_priority == 1
    assert plan(claim()).client_priority is None


def test_other_drivers_results_are_left_to_them():
    p = plan(claim(results=[result(driver="other.example.com", device="x"), result()]))
    assert [r.device for r in p.results] == ["gpu-0"]


@pytest.mark.parametrize("node_selector, selected", [
    ({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}, True),
    ({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["x", NODE]}]}]}, True),
    ({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["other"]}]},
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}, True),
    ({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["x"]}]}]}, False),
    ({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]}]}, False),
    ({"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}],
                             "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}, False),
    ({"nodeSelectorTerms": [{}]}, False),
    (None, False),
])
def test_node_selector(node_selector, selected):
    assert selects_node(node_selector, NODE) is selected


def _bad(c, match, **kw):
    with pytest.raises(DraError, match=match) as info:
        plan(c, **kw)
    message = str(info.value)
    assert "\n" not in message and "ns/c1" in message
    return message


def test_a_claim_for_another_node_is_refused():
    _bad(claim(node="node-b"), "allocated to another node .*'node-a'")


def test_a_claim_whose_uid_changed_is_refused():
    c = claim(uid="uid-2")
    assert "'uid-2' on the API server, the kubelet asked for 'uid-1'" in _bad(c, "UID")


def test_an_unallocated_claim_is_refused():
    c = claim()
    del c["status"]["allocation"]
    _bad(c, "not allocated")


def test_a_claim_without_our_devices_is_refused():
    _bad(claim(results=[result(driver="other.example.com")]), "no device of driver gpu.mpsd.io")


def test_another_pool_is_refused():
    _bad(claim(results=[result(pool="node-b")]), "pool 'node-b' is not this node's pool 'node-a'")


@pytest.mark.parametrize("memory, compute, match", [
    ("81Gi", None, "consumed memory 81Gi is outside 1Mi..85899345920"),
    ("1Ki", None, "consumed memory 1Ki is outside"),
    (None, "101", "consumed compute 101 is outside"),
    (None, "0", "consumed compute 0 is outside"),
    ("4GB", None, "bad quantity '4GB'"),
])
def test_consumed_capacity_beyond_the_device_is_refused(memory, compute, match):
    _bad(claim(results=[result(memory=memory, compute=compute)]), match)


@pytest.mark.parametrize("memory", [None, "4Gi"])
@pytest.mark.parametrize("compute", ["1n", "1m", "0.001", "0.5", "999m"])
def test_compute_below_one_percent_is_refused_not_prepared_as_zero(memory, compute):
    # 1m alone used to give CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=0 and a 0=0 memory limit; the
    # slices publish compute with validRange min 1, so no scheduler allocates less
    _bad(claim(results=[result(memory=memory, compute=compute)]),
         re.escape(f"consumed compute {compute} is outside [1, 100] percent of the SMs"))


def test_results_above_the_gpu_together_are_refused():
    _bad(claim(results=[result(memory="50Gi"), result(request="b", memory="50Gi")]), "above its")


def test_unknown_capacity_is_refused():
    c = claim()
    c["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["bandwidth"] = "1"
    _bad(c, "unknown capacity 'bandwidth'; accepted: memory, compute")


@pytest.mark.parametrize("device, match", [
    ("gpu-7", "GPU 7 is not on this node"), ("gpu-0-slice-4", "slice 4 of 4 per GPU does not exist"),
    ("nvidia-0", "bad device name"),
])
def test_devices_we_never_published_are_refused(device, match):
    _bad(claim(results=[result(device=device, memory=None)]), match)


@pytest.mark.parametrize("params, match", [
    ({"apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig", "priority": 1},
     "unknown field 'priority'; accepted: apiVersion, kind, clientPriority"),
    ({"apiVersion": "gpu.mpsd.io/v2", "kind": "ClaimConfig"}, "accepted: apiVersion gpu.mpsd.io/v1alpha1"),
    ({"apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig", "clientPriority": 2}, "clientPriority 2"),
    ({"apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig", "clientPriority": True}, "clientPriority True"),
    (["x"], "expected a mapping"),
])
def test_unknown_opaque_config_is_refused(params, match):
    _bad(claim(config=[opaque(params)]), match)


def test_admin_access_is_refused():
    c = claim()
    c["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    _bad(c, "adminAccess is not supported")


@pytest.mark.parametrize("request_ref, base", [("gpu", "gpu"), ("gpu/large", "gpu"), ("a-b/c-d", "a-b")])
def test_results_name_the_base_request_of_a_subrequest(request_ref, base):
    p = plan(claim(results=[result(request=request_ref)]))
    assert [r.request for r in p.results] == [base]


def consumed_rows() -> list[str]:
    """The first cells of docs/dra.md's table of what a claim consumed."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "docs/dra.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("| the claim consumed |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip().startswith("|"):
            break
        rows.append(line.strip().split("|")[1].strip())
    return rows


def test_the_docs_list_only_what_the_scheduler_can_record():
    """The scheduler records every capacity of a device that allows several allocations
    (consumedCapacity: "All capacity entries are included, even if the consumed amount is zero",
    resource.k8s.io/v1), and none for a device given whole (slices mode, or capacity mode on an
    API server without DRAConsumableCapacity): "only memory" or "only compute" cannot happen."""
    rows = consumed_rows()
    assert not [r for r in rows if "only" in r], rows
    assert len(rows) == 3 and rows[0].startswith("`memory` and `compute`")
