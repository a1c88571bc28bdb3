"""The DRA kubelet plugin over real gRPC on unix sockets, driven by a stand-in kubelet built from
the same protos: registration, NodePrepareResources, NodeUnprepareResources."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from mpsd.dra import pluginregistration_pb2, pluginregistration_pb2_grpc

from tests.dra.conftest import DRIVER, StandInKubelet, claim, gpus, result

CLAIM = ("ns", "c1", "uid-1")


@pytest.fixture
def served(env):
    plugins = []

    def start(**kw):
        p = env.plugin(**kw)
        p.start()
        plugins.append(p)
        return p

    kubelets = []

    def kubelet(p, services=("v1.DRAPlugin", "v1beta1.DRAPlugin")):
        k = StandInKubelet(p.registration_path, services)
        kubelets.append(k)
        return k

    yield start, kubelet
    for k in kubelets:
        k.close()
    for p in plugins:
        p.stop()


def test_registration_as_the_kubelet_sees_it(env, served):
    start, kubelet = served
    p = start()
    assert p.registration_path == str(env.registry_dir / "gpu.mpsd.io-reg.sock")
    k = kubelet(p)
    assert k.register() == "v1.DRAPlugin"
    assert k.info.endpoint == str(env.plugins_dir / DRIVER / "dra.sock")
    assert list(k.info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert p.registration.notified.wait(10) and p.registration.status == (True, "")


def test_prepare_and_unprepare_through_v1(env, served):
    start, kubelet = served
    env.claims.put(claim(results=[result(memory="20Gi"), result(device="gpu-1", request="b", memory="4Gi")]))
    k = kubelet(start())
    k.register()
    reply = k.prepare(CLAIM)
    entry = reply.claims["uid-1"]
    assert entry.error == ""
    assert [(d.request_names[0], d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in entry.devices] == [
        ("gpu", "node-a", "gpu-0", ["mpsd.io/claim=uid-1_gpu"]),
        ("b", "node-a", "gpu-1", ["mpsd.io/claim=uid-1_b"]),
    ]
    assert (env.cdi_dir / "mpsd.io-claim_uid-1.json").exists()
    assert k.prepare(CLAIM) == reply  # the kubelet's retry: the same answer
    unprep = k.unprepare(CLAIM)
    assert "uid-1" in unprep.claims and unprep.claims["uid-1"].error == ""
    assert os.listdir(env.cdi_dir) == []


def test_a_kubelet_that_knows_only_v1beta1_is_served_too(env, served):
    start, kubelet = served
    env.claims.put(claim())
    k = kubelet(start(), services=("v1beta1.DRAPlugin",))
    assert k.register() == "v1beta1.DRAPlugin"
    entry = k.prepare(CLAIM).claims["uid-1"]
    assert list(entry.devices[0].cdi_device_ids) == ["mpsd.io/claim=uid-1_gpu"]
    assert k.unprepare(CLAIM).claims["uid-1"].error == ""


def test_one_bad_claim_fails_alone_in_one_line(env, served):
    start, kubelet = served
    env.claims.put(claim())
    env.claims.put(claim(uid="uid-2", name="c2", node="node-b"))
    k = kubelet(start())
    k.register()
    reply = k.prepare(CLAIM, ("ns", "c2", "uid-2"), ("ns", "gone", "uid-3"))
    assert set(reply.claims) == {"uid-1", "uid-2", "uid-3"}
    assert reply.claims["uid-1"].error == "" and reply.claims["uid-1"].devices
    assert "allocated to another node" in reply.claims["uid-2"].error
    assert "404 Not Found" in reply.claims["uid-3"].error
    for uid in ("uid-2", "uid-3"):
        assert "\n" not in reply.claims[uid].error and not reply.claims[uid].devices
    assert os.listdir(env.cdi_dir) == ["mpsd.io-claim_uid-1.json"]


def test_a_slow_api_server_is_bounded_by_the_client_and_nothing_is_half_written(env, served):
    """The API client's own timeout ends the wait (kubeapi bounds every call); the claim's entry
    says so and nothing is written. Here the stand-in client times out after 0.5 s."""
    from mpsd.errors import MpsdError

    start, kubelet = served
    release = threading.Event()

    def slow(namespace, name):
        release.wait(0.5)
        raise MpsdError(f"resourceclaims {namespace}/{name}: API server did not answer within 0.5s")

    p = start()
    p.preparer.get_claim = slow
    k = kubelet(p)
    k.register()
    t0 = time.monotonic()
    reply = k.prepare(CLAIM)
    assert "did not answer within 0.5s" in reply.claims["uid-1"].error
    assert time.monotonic() - t0 < 25  # bounded: well inside the kubelet's 45 s call timeout
    assert os.listdir(env.cdi_dir) == [] and p.preparer.store.all() == []


def test_a_claim_prepared_before_a_restart_is_unprepared_after_it(env, served):
    start, kubelet = served
    env.claims.put(claim())
    p = start()
    k = kubelet(p)
    k.register()
    assert k.prepare(CLAIM).claims["uid-1"].error == ""
    p.stop()
    k2 = kubelet(start())
    k2.register()
    assert k2.unprepare(CLAIM).claims["uid-1"].error == ""
    assert os.listdir(env.cdi_dir) == [] and os.listdir(env.paths.region_dir) == []


def test_sockets_deleted_while_running_are_served_again(env, served):
    start, kubelet = served
    p = start()
    os.unlink(p.registration_path)
    os.unlink(p.socket_path)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (os.path.exists(p.registration_path) and os.path.exists(p.socket_path)):
        time.sleep(0.05)
    k = kubelet(p)
    assert k.register() == "v1.DRAPlugin"


def test_stop_removes_the_registration_socket(env, served):
    start, _ = served
    p = start()
    p.stop()
    assert not os.path.exists(p.registration_path) and not os.path.exists(p.socket_path)


def test_a_symlinked_cdi_dir_stops_the_start_in_one_line(env):
    from mpsd.errors import DraError

    (env.root / "elsewhere").mkdir()
    env.cdi_dir.symlink_to(env.root / "elsewhere")
    p = env.plugin()
    with pytest.raises(DraError, match="is a symlink"):
        p.start()
    p.stop()


def test_prepares_waiting_on_a_hanging_api_server_leave_unprepare_answering(env, served, apiserver, tmp_path):
    """Twelve Prepares whose claims the API server never sends (each call bounded at 10 s) used
    to take every gRPC worker: Unprepare of an unrelated claim, which needs no API call, waited
    for them and missed its deadline. Prepares beyond the plugin's slots are answered "busy" at
    once, and Unprepare and the registration socket answer while the others wait."""
    from mpsd.dra.kubeapi import KubeAPI, load_config
    from tests.dra.apiserver import write_kubeconfig

    start, kubelet = served
    apiserver.delay = 60  # accepts, never answers (until the test ends)
    api = KubeAPI(load_config({"KUBECONFIG": str(write_kubeconfig(tmp_path / "kc", apiserver))}), timeout=10)
    p = start()
    p.preparer.get_claim = api.get_resource_claim
    k = kubelet(p)
    k.register()
    calls = [k.stub.NodePrepareResources.future(k.pb2.NodePrepareResourcesRequest(
        claims=[k.pb2.Claim(namespace="ns", name=f"c{i}", uid=f"uid-{i}")]), timeout=60) for i in range(12)]
    deadline = time.monotonic() + 20
    while apiserver.arrived < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert apiserver.arrived >= 8  # the plugin's workers all wait on the API server
    t0 = time.monotonic()
    unprep = k.stub.NodeUnprepareResources(k.pb2.NodeUnprepareResourcesRequest(
        claims=[k.pb2.Claim(namespace="ns", name="other", uid="uid-other")]), timeout=5)
    assert unprep.claims["uid-other"].error == ""
    reg = pluginregistration_pb2_grpc.RegistrationStub(k._channel(p.registration_path))
    assert reg.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5).name == DRIVER
    assert time.monotonic() - t0 < 5
    busy = [c.result() for c in calls if c.done() and "busy" in next(iter(c.result().claims.values())).error]
    assert busy, "Prepares beyond the slots are answered at once"
    apiserver.stop()  # the waiting calls end
    for c in calls:
        entry = next(iter(c.result(timeout=60).claims.values()))
        assert entry.error and "\n" not in entry.error and not entry.devices
    api.close()
UID = "0b5d9a62-1f2e-4c3d-8e9f-0a1b2c3d4e5f"


@pytest.mark.parametrize("registry_dir, name", [
    ("/var/lib/kubelet/plugins_registry", "gpu.mpsd.io-reg.sock"),  # no instance: one at a time
])
def test_the_fixed_registration_name(registry_dir, name):
    from mpsd.dra.kubeletplugin import registration_socket_name

    assert registration_socket_name(DRIVER, "", registry_dir) == name


def test_an_instances_socket_names_fit_a_socket_address():
    """<driver>-<uid>-reg.sock where it fits; a hash of the uid, then of driver and uid, where
    the registry's path is long (as the DRA helper's RollingUpdateRegistrarSocketFile chooses)."""
    from mpsd.dra.kubeletplugin import dra_socket_name, registration_socket_name

    assert registration_socket_name(DRIVER, UID, "/var/lib/kubelet/plugins_registry") == f"{DRIVER}-{UID}-reg.sock"
    mid = "/" + "d" * 50
    short = registration_socket_name(DRIVER, UID, mid)
    assert short.startswith(f"{DRIVER}-") and UID not in short and len(short) == len(DRIVER) + 1 + 11 + 9
    long_driver = "gpu." + "x" * 50 + ".example.com"  # its own name leaves no room for even a hash
    deep = "/" + "d" * 60
    hashed = registration_socket_name(long_driver, UID, deep)
    assert hashed.startswith("dra-") and hashed.endswith("-reg.sock") and len(deep) + 1 + len(hashed) <= 107
    assert registration_socket_name(long_driver, "other-pod", deep) != hashed
    assert dra_socket_name(UID) == f"dra-{UID}.sock" and dra_socket_name("") == "dra.sock"


@pytest.mark.parametrize("value, ok", [(UID, True), ("", True), ("../etc", False), ("a" * 64, False),
                                       ("pod uid", False)])
def test_pod_uid_must_be_a_file_name_part(value, ok):
    from mpsd.errors import PluginError
    from mpsd.alloc.served import instance_id

    if ok:
        assert instance_id({"POD_UID": value}) == value
    else:
        with pytest.raises(PluginError, match="^bad POD_UID .*expected a pod UID"):
            instance_id({"POD_UID": value})
def test_a_subrequest_of_a_prioritized_list_gives_its_container_the_claims_device(env, served):
    """firstAvailable (prioritized list: beta in 1.34-1.35, GA in 1.36): the scheduler records the
    alternative it picked as ``gpu/large``. The kubelet matches a container's
    ``resources.claims[].request`` (``gpu``) literally against the request names of each device,
    so the answer must name the base request (what the DRA helper's BaseRequestRef returns), or
    that container starts with no CDI device at all: no MPS limits, no shim, no pipe dir."""
    start, kubelet = served
    env.claims.put(claim(results=[result(request="gpu/large", memory="40Gi", compute="50")]))
    k = kubelet(start())
    k.register()
    entry = k.prepare(CLAIM).claims["uid-1"]
    assert entry.error == ""
    assert [list(d.request_names) for d in entry.devices] == [["gpu"]]
    ids = k.container_cdi_ids(entry, "gpu")
    assert ids and ids == k.container_cdi_ids(entry)  # the container naming request gpu, and the whole claim
    spec = json.loads((env.cdi_dir / "mpsd.io-claim_uid-1.json").read_text())
    env_vars = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert env_vars["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40G" and env_vars["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_the_share_id_of_a_result_is_answered_on_v1(env, served):
    """A device allocated several times (capacity mode) has a shareID per allocation; 1.35's v1
    API carries it back (Device.share_id); a result without one leaves the field unset."""
    start, kubelet = served
    shared = {**result(memory="4Gi", compute="5"), "shareID": "5d3c0e0a-8a38-4a8e-9c1f-2b7f0b1e9a10"}
    env.claims.put(claim(results=[shared, result(device="gpu-1", request="b", memory="4Gi", compute="10")]))
    k = kubelet(start())
    k.register()
    devices = k.prepare(CLAIM).claims["uid-1"].devices
    assert [(d.device_name, d.HasField("share_id"), d.share_id) for d in devices] == [
        ("gpu-0", True, "5d3c0e0a-8a38-4a8e-9c1f-2b7f0b1e9a10"), ("gpu-1", False, "")]


def spec_devices(env, uid="uid-1") -> dict[str, dict]:
    """The CDI devices of a claim's spec by CDI ID, each as {env var: value, "mounts": ..., "nodes": ...}."""
    spec = json.loads((env.cdi_dir / f"mpsd.io-claim_{uid}.json").read_text())
    out = {}
    for d in spec["devices"]:
        edits = d["containerEdits"]
        out[f"{spec['kind']}={d['name']}"] = {
            **dict(e.split("=", 1) for e in edits["env"]),
            "mounts": {m["containerPath"]: m["hostPath"] for m in edits["mounts"]},
            "nodes": [n["path"] for n in edits.get("deviceNodes", [])],
        }
    return out


def test_each_request_of_a_claim_is_its_own_cdi_device_with_its_own_gpus_and_limits(env, served):
    """A container naming request b gets b's GPU and b's limits only, not a's; one naming the
    whole claim gets every request's device. Each request's processes share a region of their
    own (its cap), in the claim's directory."""
    start, kubelet = served
    for name in ("nvidiactl", "nvidia0", "nvidia1"):
        (env.root / "dev" / name).touch()
    env.claims.put(claim(results=[result(memory="20Gi", compute="30"),
                                  result(device="gpu-1", request="b", memory="4Gi", compute="10")]))
    k = kubelet(start())
    k.register()
    entry = k.prepare(CLAIM).claims["uid-1"]
    assert entry.error == ""
    ids_gpu, ids_b = k.container_cdi_ids(entry, "gpu"), k.container_cdi_ids(entry, "b")
    assert len(ids_gpu) == len(ids_b) == 1 and ids_gpu != ids_b
    assert sorted(k.container_cdi_ids(entry)) == sorted(ids_gpu + ids_b)
    devices = spec_devices(env)
    a, b = devices[ids_gpu[0]], devices[ids_b[0]]
    gpu0, gpu1 = (g.uuid for g in gpus(80, 40))
    assert (a["NVIDIA_VISIBLE_DEVICES"], a["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], a["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) \
        == (gpu0, "0=20G", "30")
    assert (b["NVIDIA_VISIBLE_DEVICES"], b["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], b["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) \
        == (gpu1, "0=4G", "10")
    assert str(env.root / "dev" / "nvidia1") not in a["nodes"] and str(env.root / "dev" / "nvidia0") not in b["nodes"]
    assert a["MPSSHIM_REGION"] != b["MPSSHIM_REGION"]  # a cap each
    assert a["mounts"]["/run/mpsd"] == b["mounts"]["/run/mpsd"]  # one claim directory
