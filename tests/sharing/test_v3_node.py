"""mpsd's supervisor, device plugin and DRA driver on the MPS v3 stand-in, end to end: namespaces
made at Allocate and Prepare, read back and put back each health round, re-created after a
daemon restart (from the file mpsd writes) and after an mpsd restart (from the journals),
deleted at release; FAULT per GPU; a configuration the daemon refuses, one line."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import grpc
import pytest

from mpsd import config as cfg
from mpsd.daemon.control3 import Limits3
from mpsd.dra.cdi import CdiDir
from mpsd.dra.prepared import PreparedClaim, Preparer
from mpsd.lifecycle.health import HealthBoard
from mpsd.plugin import DevicePlugin
from mpsd.alloc.state import StateStore
from mpsd.lifecycle.v3 import supervision_for
from mpsd.sharing.build import build, host_paths
from mpsd.sharing.detect import Choice
from mpsd.sharing.toml3 import namespace_name

from tests.dra.conftest import Claims, claim, result
from tests.plugin.conftest import FakeKubelet, allocate, gpus, stub
from tests.mpsfixtures import Running
from tests.sharing.conftest import wait_for

GPUS = gpus(80, 40)


@pytest.fixture
def node(fake_v3_binary, short_tmp):
    """make(**overrides) -> (config, backend, running supervisor); everything stopped at teardown."""
    started: list[Running] = []

    def make(**overrides):
        values = {
            "control-binary": str(fake_v3_binary), "pipe-dir": str(short_tmp / "p"), "log-dir": str(short_tmp / "log"),
            "state-dir": str(short_tmp / "state"), "metrics-address": "", "health-interval": "0.2s",
            "health-timeout": "5s", "restart-backoff-initial": "0.1s", "restart-backoff-max": "1s",
            "shutdown-timeout": "5s", "region-dir": str(short_tmp / "regions"), "shim-host-dir": str(short_tmp / "lib"),
            "mps-protocol": "3",
        }
        values.update(overrides)
        config = cfg.load(None, {}, values)
        backend = build(config, Choice(3, "test"), lambda: GPUS)
        v3 = supervision_for(backend, config)
        running = Running(config, v3=v3)
        started.append(running)
        return config, backend, running

    yield make
    for r in started:
        if r.thread.is_alive():
            r.stop()


def up(running: Running):
    return running.wait_for(lambda s: s.daemon_up and s.configured, what="daemon up and configured")


def namespaces(backend, server="g0") -> dict[str, Limits3]:
    return {n.name: n.limits for n in backend.control().namespace_list(server)}


@pytest.fixture
def plugin(short_tmp):
    made: list[tuple[DevicePlugin, FakeKubelet]] = []

    def start(config, backend) -> DevicePlugin:
        kubelet_dir = short_tmp / "kubelet"
        kubelet_dir.mkdir(exist_ok=True)
        kubelet = FakeKubelet(str(kubelet_dir / "kubelet.sock"))
        p = DevicePlugin(gpus=GPUS, resource_name="mpsd.io/gpu", slices_per_gpu=10, kubelet_dir=str(kubelet_dir),
                         paths=host_paths(config), state_path=str(short_tmp / "state" / "dp.json"),
                         board=HealthBoard(), usage_interval=0,
                         poll_interval=0.05, wake_interval=0.05, backend=backend)
        p.start()
        made.append((p, kubelet))
        return p

    yield start
    for p, k in made:
        p.stop()
        k.stop()


def test_device_plugin_allocations_are_namespaces_kept_as_allocated(node, plugin):
    config, backend, running = node()
    up(running)
    dp = plugin(config, backend)
    channel, s = stub(dp)
    with channel:
        reply = allocate(s, [f"{GPUS[0].uuid}::0", f"{GPUS[0].uuid}::1"]).container_responses[0]
        ns = namespace_name(dp.store.all()[0].allocation_id)
        pipe = Path(config.pipe_dir)
        assert reply.envs["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe / "g0" / ns)
        assert reply.envs["NVIDIA_VISIBLE_DEVICES"] == GPUS[0].uuid
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in reply.envs  # the namespace carries it
        assert {m.container_path: m.read_only for m in reply.mounts}[config.pipe_dir] is True
        assert (pipe / "g0" / ns / "control").exists()
        assert namespaces(backend)[ns] == Limits3("16G", "20", "")

        with pytest.raises(grpc.RpcError) as err:  # one client reaches one server: one GPU
            allocate(s, [f"{GPUS[0].uuid}::2", f"{GPUS[1].uuid}::0"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "spans GPUs" in err.value.details() and "\n" not in err.value.details()

        # deleted behind mpsd's back: created again at the next health round, and counted
        before = running.sup.status().defaults_restored
        backend.control().namespace_delete("g0", ns)
        assert wait_for(lambda: (pipe / "g0" / ns / "control").exists())
        assert wait_for(lambda: running.sup.status().defaults_restored > before)
        # its limits changed: put back
        backend.control().namespace_set("g0", ns, Limits3(pinned_memory_limit="70G", active_thread_percentage="100"))
        assert wait_for(lambda: namespaces(backend)[ns] == Limits3("16G", "20", ""))
        # a namespace mpsd's journal names that no allocation does: deleted; an operator's, even of
        # mpsd's name shape: left alone
        backend.owned.add("g0", "m00000000000000f")
        backend.control().namespace_create("g0", "m00000000000000f")
        backend.control().namespace_create("g0", "m0123456789abcde")
        backend.control().namespace_create("g0", "operator")
        assert wait_for(lambda: "m00000000000000f" not in namespaces(backend))
        assert {"operator", "m0123456789abcde"} <= set(namespaces(backend))
        assert wait_for(lambda: not backend.owned.has("g0", "m00000000000000f"))  # after its read-back

        # the daemon killed: restarted with the namespace in its file, before any health round
        pid = running.sup.status().pid
        os.kill(pid, signal.SIGKILL)
        running.wait_for(lambda st: running.sup.status().pid not in (None, pid) and st.configured, what="restart")
        assert ns in namespaces(backend)
        assert f"[servers.g0.namespaces.{ns}]" in Path(config.state_dir, "mps-v3.toml").read_text()

        # released (the pod gone, garbage collection): deleted
        dp.tracker.collect(dp.store.all())
        assert ns not in namespaces(backend) and not (pipe / "g0" / ns).exists()


def test_a_restarted_mpsd_recreates_the_journaled_namespaces(node, plugin, short_tmp):
    config, backend, running = node()
    up(running)
    dp = plugin(config, backend)
    channel, s = stub(dp)
    with channel:
        allocate(s, [f"{GPUS[1].uuid}::3"])
    ns = namespace_name(dp.store.all()[0].allocation_id)
    dp.stop()
    running.stop()  # -q: the daemon and its namespaces are gone
    config, backend, running = node()
    up(running)
    assert ns not in namespaces(backend, "g1")
    plugin(config, backend)  # loads its journal: adopts the allocation
    assert wait_for(lambda: ns in namespaces(backend, "g1"))
    assert namespaces(backend, "g1")[ns] == Limits3("4G", "10", "")


def preparer_for(config, backend, tmp: Path) -> tuple[Preparer, Claims]:
    """A DRA Preparer on ``backend`` with claim u1 (10Gi on gpu-1, clientPriority 1) to prepare."""
    claims = Claims()
    p = Preparer(driver="gpu.mpsd.io", node="node-a", pool="node-a", gpus=GPUS, slices_per_gpu=4,
                 paths=host_paths(config), cdi_dir=CdiDir(str(tmp / "cdi")),
                 store=StateStore(str(tmp / "state" / "dra.json"), record=PreparedClaim),
                 get_claim=claims, dev_dir=str(tmp), backend=backend)
    p.store.load()
    claims.put(claim(uid="u1", results=[result(device="gpu-1", memory="10Gi")],
                     config=[{"source": "FromClaim", "opaque": {"driver": "gpu.mpsd.io", "parameters": {
                         "apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig", "clientPriority": 1}}}]))
    return p, claims


def test_dra_claims_get_a_namespace_and_lose_it_at_unprepare(node, short_tmp):
    config, backend, running = node()
    up(running)
    preparer, claims = preparer_for(config, backend, short_tmp)
    from mpsd.dra.claims import ClaimRef

    rec = preparer.prepare(ClaimRef("ns", "c1", "u1"))
    ns = namespace_name(preparer.slices(rec)[0].key)
    assert namespaces(backend, "g1")[ns] == Limits3("10G", "25", "1")
    spec = preparer.cdi.read(rec.spec_name)
    env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == os.path.join(config.pipe_dir, "g1", ns)
    # two GPUs in one request: refused in one line, nothing left behind (a client reaches one
    # server; two requests on two GPUs are two slices, each its own namespace)
    claims.put(claim(uid="u2", name="c2", results=[result(device="gpu-0", memory="1Gi"),
                                                   result(device="gpu-1", memory="1Gi")]))
    with pytest.raises(Exception) as exc:
        preparer.prepare(ClaimRef("ns", "c2", "u2"))
    assert "spans GPUs" in str(exc.value) and "\n" not in str(exc.value)
    assert preparer.cdi.ours() == [rec.spec_name]
    preparer.unprepare(ClaimRef("ns", "c1", "u1"))
    assert ns not in namespaces(backend, "g1")


def test_a_server_in_fault_marks_only_its_gpu(node):
    config, backend, running = node()
    up(running)
    backend.control().run("_fake", "status", "--server=g1", "--status=FAULT")
    state = running.wait_for(lambda st: st.faulted_gpus, what="FAULT seen")
    assert state.faulted_gpus == frozenset({1}) and state.gpu_healthy(0) and not state.gpu_healthy(1)
    assert "g1 in FAULT" in state.last_error
    backend.control().run("_fake", "status", "--server=g1", "--status=Ready")
    running.wait_for(lambda st: not st.faulted_gpus, what="FAULT cleared")


def test_a_configuration_the_daemon_refuses_is_one_line_and_retried(node, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_DEVICES", GPUS[0].uuid)  # the daemon does not see NVML's second GPU
    config, backend, running = node()
    state = running.wait_for(lambda st: "not found" in st.last_error, what="refusal reported")
    assert not state.daemon_up and "\n" not in state.last_error
    assert "Configuration error" in state.last_error and "servers.g1.allowed_devices" in state.last_error
    assert wait_for(lambda: running.sup.status().restarts >= 1) and running.thread.is_alive()  # tried again
    log = Path(config.log_dir, "control.log").read_text()
    assert "Configuration error" in log and "servers.g1.allowed_devices" in log


def test_a_namespace_socket_served_by_another_process_restarts_the_daemon(node, plugin):
    config, backend, running = node()
    up(running)
    dp = plugin(config, backend)
    channel, s = stub(dp)
    with channel:
        allocate(s, [f"{GPUS[0].uuid}::0"])
    ns = namespace_name(dp.store.all()[0].allocation_id)
    path = Path(config.pipe_dir, "g0", ns, "control")
    path.unlink()
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # this process listens: not the daemon
    fake.bind(str(path))
    fake.listen(1)
    pid = running.sup.status().pid
    try:
        assert wait_for(lambda: running.sup.status().impostors >= 1, timeout=20)
        running.wait_for(lambda st: running.sup.status().pid not in (None, pid) and st.configured, what="restart")
    finally:
        fake.close()
    assert ns in namespaces(backend)
