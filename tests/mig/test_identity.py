"""MIG instances as NVIDIA's own tools see them, at the faces: DRA names that a new instance does not
inherit, a prepared claim whose instance's UUID is gone refused, attributes and capacities as NVIDIA's
DRA driver publishes them, an instance without its /dev/nvidia-caps node not offered, mpsd exec of a
destroyed instance refused, no device for the node daemon of an all-MIG node, and the instance daemons
paused for a layout change."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import kubernetes_validate
import pytest

from mpsd.dra.claims import ClaimRef
from mpsd.dra.migdevices import device_name
from mpsd.dra.slices import build_devices, build_slices
from mpsd.errors import DraError
from mpsd.inventory.nvml import Gpu
from mpsd.lifecycle.health import HealthBoard
from mpsd.mig.fleet import MigFleet, whole_gpus_only
from mpsd.sharing.mig import MigBackend
from tests.dra.apirules import resource_slice_errors
from tests.dra.conftest import DRIVER, NODE, claim, env, result  # noqa: F401 (fixture env)
from tests.mig.conftest import MIB, mig

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
A = dataclasses.replace(mig(1, gi=9), slices=4, engines=(1, 1, 0, 1, 0))


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_new_instance_with_reused_ids_is_a_new_device_unless_it_is_the_same_profile_in_the_same_place():
    other = dataclasses.replace(A, uuid="MIG-ffffffff-1111-2222-3333-444444444444", profile="1g.10gb+me",
                                gi_profile_id=7)  # GI 9, CI 0 again: destroyed and created as another profile
    assert device_name(A) == "gpu-1-mig-1g10gb-0-9" and device_name(other) == "gpu-1-mig-1g10gbme-7-9"
    moved = dataclasses.replace(A, placement_start=5)  # same profile, same GI ID, another place
    assert device_name(moved) != device_name(A)
    nameless = dataclasses.replace(A, placement_start=None)  # unprivileged: the GI ID stands in
    assert device_name(nameless) == "gpu-1-mig-1g10gb-0-gi9"
    split = dataclasses.replace(A, profile="1c.3g.40gb", gi_profile_id=2, gi_slices=3, compute_instance=2)
    assert device_name(split) == "gpu-1-mig-1c3g40gb-2-9-ci2"  # compute instances of one GPU instance differ


def test_a_prepared_claim_whose_instance_uuid_is_gone_is_refused_though_its_name_is_served(env):  # noqa: F811
    served = {A.uuid: str(env.root / "mig" / A.uuid)}
    preparer = env.preparer(gpu_list=[A], backend=MigBackend(env.paths, served.get))
    env.claims.put(claim(results=[result(device_name(A), memory="2Gi")]))
    ref = ClaimRef("ns", "c1", "uid-1")
    preparer.prepare(ref)
    again = dataclasses.replace(A, uuid="MIG-eeeeeeee-1111-2222-3333-444444444444")  # re-created in place
    assert device_name(again) == device_name(A)
    served[again.uuid] = served.pop(A.uuid)
    preparer.gpus = [again]
    with pytest.raises(DraError) as exc:
        preparer.prepare(ref)  # the kubelet's retry of the same claim
    assert f"MIG instance {A.uuid} it was prepared onto is gone" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("mode", ["capacity", "slices"])
def test_attributes_and_capacities_are_nvidias(mode):
    parent = Gpu(1, A.parent_uuid, "NVIDIA H100 80GB HBM3", 0, 0, (9, 0), True)
    devices = build_devices([parent, A], mode, 4, "580.95.05")
    one = devices[0]
    attrs, caps = one["attributes"], one["capacity"]
    assert attrs["type"] == {"string": "mig"} and attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["profile"] == {"string": "1g.10gb"} and attrs["uuid"] == {"string": A.uuid}
    values = {name: c["value"] for name, c in caps.items()}
    assert {k: values[k] for k in ("multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines",
                                   "ofaEngines", "memorySlice9")} == {
        "multiprocessors": "16", "copyEngines": "1", "decoders": "1", "encoders": "0", "jpegEngines": "1",
        "ofaEngines": "0", "memorySlice9": "1"}
    if mode == "capacity":  # shared: a claim consumes none of them unless it asks
        assert caps["multiprocessors"]["requestPolicy"]["default"] == "0"
    for obj in build_slices(devices, DRIVER, NODE, 1):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert resource_slice_errors(obj) == []



@pytest.mark.mps_binary
def test_an_instance_without_its_caps_node_is_not_offered_and_listed_unhealthy(mig_config, caplog):
    config = mig_config()
    fleet = MigFleet(config, HealthBoard())
    ok, late = mig(1), mig(30)  # mig(30)'s caps nodes (160, 161) are not in mig.capsDir
    try:
        for _ in range(2):
            fleet.reconcile([ok, late])
        assert fleet.get(late.uuid) is None and fleet.get(ok.uuid) is not None  # no daemon that cannot open it
        assert [d.uuid for d in fleet.devices()] == [ok.uuid]
        (listed,) = [d for d in fleet.devices(unserved=True) if d.uuid == late.uuid]
        assert "nvidia-cap160, nvidia-cap161 is missing" in listed.problem
        wait_until(lambda: fleet.board.current().mig_healthy == {ok.uuid}, what="the served instance healthy")
        assert not fleet.board.current().device_healthy(listed)
        assert build_devices([dataclasses.replace(listed, slices=4)], "capacity", 4) == []
        assert sum("not offered" in r.getMessage() and late.uuid in r.getMessage() for r in caplog.records) == 1
        for minor in late.caps_minors:  # the host's node appears (the mount shows it): served next round
            Path(config.mig.caps_dir, f"nvidia-cap{minor}").touch()
        fleet.reconcile([ok, late])
        assert fleet.get(late.uuid) is not None
    finally:
        fleet.stop()


@pytest.mark.mps_binary
def test_exec_of_a_destroyed_instance_is_refused_though_its_socket_file_remains(mig_config):
    config = mig_config()
    fleet = MigFleet(config, HealthBoard())
    a = mig(1)
    try:
        fleet.reconcile([a])
        wait_until(lambda: fleet.board.current().mig_healthy == {a.uuid}, what="the instance healthy")
        run = fleet.get(a.uuid)
        fleet.reconcile([])  # destroyed: its daemon quits
        run.thread.join(30)
        assert not run.thread.is_alive()
        assert os.path.exists(os.path.join(config.mig.pipe_root, a.uuid, "control"))  # left behind by quit
        proc = subprocess.run(
            [sys.executable, "-m", "mpsd", "exec", f"--mig-pipe-root={config.mig.pipe_root}",
             f"--state-dir={config.state_dir}", f"--mig-instance={a.uuid}", "--no-shim", "--", "true"],
            cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
        assert "no MPS daemon of mpsd serves that instance" in line and "served: none" in line
    finally:
        fleet.stop()


def test_the_node_daemon_of_an_all_mig_node_sees_no_device(mig_config):
    """Unset, CUDA_VISIBLE_DEVICES would let a client of the node's pipe dir land on a MIG device;
    CUDA stops at the first invalid entry, so "-1" names none."""
    config = mig_config()
    parent = Gpu(0, "GPU-0", "NVIDIA H100 80GB HBM3", 0, 0, (9, 0), True)
    whole = Gpu(1, "GPU-1", "NVIDIA H100 80GB HBM3", 80 * GIB, 0, (9, 0), False)
    assert whole_gpus_only(config, [parent]).visible_devices == "-1"
    assert whole_gpus_only(config, [parent, whole]).visible_devices == "GPU-1"
    assert whole_gpus_only(config, [whole]).visible_devices is None


@pytest.mark.mps_binary
def test_pause_quits_the_instance_daemons_until_resumed(mig_config):
    from mpsd.mig import pause

    config = mig_config()
    fleet = MigFleet(config, HealthBoard())
    a, b = mig(1), mig(2, memory=4864 * MIB)
    stop = threading.Event()

    def rounds() -> None:  # mpsd run's inventory rounds
        while not stop.wait(0.2):
            fleet.reconcile([a, b])

    pump = threading.Thread(target=rounds, daemon=True)
    try:
        fleet.reconcile([a, b])
        wait_until(lambda: fleet.board.current().mig_healthy == {a.uuid, b.uuid}, what="both healthy")
        pump.start()
        message = pause.pause(config, timeout=60)
        assert "change the MIG layout, then run mpsd mig-resume" in message
        assert fleet.devices() == [] and pause.serving(config) == []
        time.sleep(1)  # further rounds start nothing while paused
        assert fleet.devices() == []
        assert "resume" in pause.resume(config)
        wait_until(lambda: fleet.board.current().mig_healthy == {a.uuid, b.uuid}, what="served again")
        assert pause.resume(config) == "MIG instance daemons were not paused"
    finally:
        stop.set()
        if pump.is_alive():
            pump.join(10)
        fleet.stop()
