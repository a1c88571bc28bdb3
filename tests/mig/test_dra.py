"""The DRA driver's MIG face: each instance a device with the instance's memory and compute as
capacities and its profile, parent GPU and UUID as attributes (the pool still passes the schema and
the API's rules), claims on an instance planned from the instance's own numbers, a claim on a
vanished instance refused in one line, and a prepared claim's CDI spec reaching the instance's
daemon with its /dev/nvidia-caps nodes."""

from __future__ import annotations

import dataclasses
import json

import kubernetes_validate
import pytest

from mpsd.dra.claims import ClaimRef, plan_claim
from mpsd.dra.slices import build_devices, build_slices
from mpsd.errors import BackendError, DraError
from mpsd.inventory.nvml import Gpu
from mpsd.inventory.mig import MIB
from mpsd.sharing import SliceRequest
from mpsd.sharing.mig import MigBackend
from tests.dra.apirules import resource_slice_errors
from tests.dra.conftest import DRIVER, NODE, claim, env, result  # noqa: F401 (fixture env)
from tests.mig.conftest import mig

GIB = 1 << 30
WHOLE = Gpu(0, "GPU-00000000-0000-0000-0000-0000000000c0", "NVIDIA H100 80GB HBM3", 80 * GIB, 0, (9, 0), False)
PARENT = Gpu(1, "GPU-00000000-0000-0000-0000-0000000000a0", "NVIDIA H100 80GB HBM3", 80 * GIB, 0, (9, 0), True)
A = dataclasses.replace(mig(1, gi=9), slices=4)
B = dataclasses.replace(mig(2, "3g.40gb", gi=2, memory=40192 * MIB, sms=60, slices=3), slices=4)
REF = ClaimRef("ns", "c1", "uid-1")
NA, NB = "gpu-1-mig-1g10gb-0-9", "gpu-1-mig-3g40gb-2-2"  # NVIDIA's form: parent minor, profile, GI profile, placement


@pytest.mark.parametrize("mode", ["capacity", "slices"])
def test_instances_are_published_next_to_whole_gpus_and_pass_the_schema(mode):
    devices = build_devices([WHOLE, PARENT, A, B], mode, 4, "580.95.05")
    names = [d["name"] for d in devices]
    if mode == "capacity":
        assert names == ["gpu-0", NB, NA]  # the MIG GPU itself is not published whole
        one = devices[2]
        assert one["capacity"]["memory"]["value"] == "9984Mi" and one["capacity"]["compute"]["value"] == "100"
        assert one["allowMultipleAllocations"] is True
    else:
        assert names[4:] == [f"{name}-slice-{k}" for name in (NB, NA) for k in range(4)]
        one = devices[-1]
    attrs = one["attributes"]
    assert attrs["uuid"] == {"string": A.uuid} and attrs["parentUUID"] == {"string": A.parent_uuid}
    assert attrs["profile"] == {"string": "1g.10gb"} and attrs["index"] == {"int": 1}
    assert attrs["multiprocessors"] == {"int": 16} and attrs["memory"] == {"int": A.memory_total}
    assert (attrs["migGpuInstance"], attrs["migComputeInstance"], attrs["mig"]) == ({"int": 9}, {"int": 0},
                                                                                    {"bool": True})
    for obj in build_slices(devices, DRIVER, NODE, 1):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert resource_slice_errors(obj) == []


def test_slices_of_an_instance_add_up_to_it_and_one_that_cannot_be_divided_is_left_out():
    devices = build_devices([A, dataclasses.replace(B, slices=0)], "slices", 4)
    assert [d["name"] for d in devices] == [f"{NA}-slice-{k}" for k in range(4)]
    from lightkube.utils.quantity import parse_quantity

    assert sum(parse_quantity(d["capacity"]["memory"]["value"]) for d in devices) == A.memory_total // MIB * MIB


def test_a_claim_on_an_instance_is_planned_from_the_instances_numbers():
    planned = plan_claim(claim(results=[result(NA, memory="4Gi")]), REF, driver=DRIVER, node=NODE,
                         pool=NODE, gpus=[WHOLE, A, B], slices_per_gpu=10)
    (share,) = planned.plan.gpus
    assert (share.uuid, share.index, share.memory_limit) == (A.uuid, 1, 4 * GIB)
    assert planned.plan.active_thread_percentage == pytest.approx(41.03)  # 4 GiB of 9984 MiB, up to a hundredth
    sliced = plan_claim(claim(results=[result(NB + "-slice-3", memory=None)]), REF, driver=DRIVER,
                        node=NODE, pool=NODE, gpus=[B], slices_per_gpu=10)
    assert sliced.plan.active_thread_percentage == 25.0  # the instance's 4 slices, not slicesPerGpu's 10


def test_two_instances_of_one_gpu_stay_two_devices_and_the_backend_refuses_the_claim(tmp_path):
    planned = plan_claim(claim(results=[result(NA, memory="1Gi"), result(NB, memory="1Gi",
                                                                                       request="b")]),
                         REF, driver=DRIVER, node=NODE, pool=NODE, gpus=[A, B], slices_per_gpu=4)
    assert [g.uuid for g in planned.plan.gpus] == [A.uuid, B.uuid]  # not merged under their GPU's index
    from mpsd.alloc.container import HostPaths

    backend = MigBackend(HostPaths(str(tmp_path), str(tmp_path), str(tmp_path)), lambda uuid: str(tmp_path / uuid))
    with pytest.raises(BackendError, match="more than one MPS daemon"):
        backend.grant(SliceRequest("claim-uid-1", planned.plan, str(tmp_path)))


def test_burst_on_an_instance_is_refused_in_one_line_and_the_whole_gpus_keep_their_backends_answer(tmp_path):
    """A ClaimConfig memoryLimit above an instance's guarantee is refused by its backend; the routed
    backend says of burst what the whole GPUs' backend says (an instance's request is refused as above)."""
    from mpsd.alloc.container import HostPaths
    from mpsd.sharing.mig import Routed
    from mpsd.sharing.v2 import BURST, V2Backend

    planned = plan_claim(claim(results=[result(NA, memory="1Gi")]), REF, driver=DRIVER, node=NODE,
                         pool=NODE, gpus=[A], slices_per_gpu=4)
    paths = HostPaths(str(tmp_path), str(tmp_path), str(tmp_path))
    backend = MigBackend(paths, lambda uuid: str(tmp_path / uuid))
    with pytest.raises(BackendError) as exc:
        backend.grant(SliceRequest("claim-uid-1", planned.plan, str(tmp_path), memory_hard={0: 2 * GIB}))
    assert str(exc.value).endswith(f"cannot be enforced here: {backend.burst_problem()}") and "\n" not in str(exc.value)
    assert "capped at their guarantee" in backend.burst_problem()
    assert Routed(V2Backend(paths), backend).burst_problem() == BURST


def test_a_claim_on_a_vanished_instance_is_refused_in_one_line():
    with pytest.raises(DraError) as exc:
        plan_claim(claim(results=[result("gpu-1-mig-1g10gb-0-5")]), REF, driver=DRIVER, node=NODE, pool=NODE,
                   gpus=[WHOLE, A], slices_per_gpu=4)
    assert "MIG instance is not served on this node" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(DraError, match="gpu-<minor>-mig-<profile>-<GI profile ID>"):
        plan_claim(claim(results=[result("gpu-1-mig-X")]), REF, driver=DRIVER, node=NODE, pool=NODE,
                   gpus=[A], slices_per_gpu=4)


def test_a_prepared_claim_reaches_the_instances_daemon_with_its_caps_nodes(env):  # noqa: F811
    caps = env.root / "dev" / "nvidia-caps"
    caps.mkdir()
    for minor in A.caps_minors:
        (caps / f"nvidia-cap{minor}").touch()
    (env.root / "dev" / "nvidia1").touch()
    pipe = str(env.root / "mig" / A.uuid)
    served = {A.uuid: pipe}
    preparer = env.preparer(gpu_list=[WHOLE, A], backend=MigBackend(env.paths, served.get))
    env.claims.put(claim(results=[result(NA, memory="2Gi")]))
    rec = preparer.prepare(REF)
    spec = json.loads((env.cdi_dir / rec.spec_name).read_text())
    edits = spec["devices"][0]["containerEdits"]
    variables = dict(e.split("=", 1) for e in edits["env"])
    assert variables["CUDA_MPS_PIPE_DIRECTORY"] == pipe and variables["NVIDIA_VISIBLE_DEVICES"] == A.uuid
    assert variables["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2G"
    assert {m["containerPath"]: m["options"][0] for m in edits["mounts"]}[pipe] == "ro"
    nodes = [n["path"] for n in edits["deviceNodes"]]
    assert nodes[-3:] == ["/dev/nvidia1", *(f"/dev/nvidia-caps/nvidia-cap{m}" for m in A.caps_minors)]

    served.clear()  # the instance vanished: a new claim on it fails in one line, nothing left behind
    env.claims.put(claim(uid="uid-2", name="c2", results=[result(NA, memory="2Gi")]))
    with pytest.raises(DraError, match="not served on this node") as exc:
        preparer.prepare(ClaimRef("ns", "c2", "uid-2"))
    assert "\n" not in str(exc.value)
    assert [p.name for p in env.cdi_dir.iterdir()] == [rec.spec_name]
