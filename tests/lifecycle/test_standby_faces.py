"""The surge rollout of issue 19 end to end, kubelet faces included: a new ``mpsd run`` (its own
POD_UID) starts beside the old one on one node, stands by and becomes Ready, the kubelet moves
to its plugin instance, the old one gets SIGTERM and the new one adopts the control daemon
(same PID, no ``quit``). Real ``mpsd run`` and ``mpsd holder`` processes, the real control
daemon, the stand-in API server (tests/dra/apiserver.py), the stand-in kubelet's plugin watcher
and DRA plugin manager (tests/dra/kubelet.py) and its device manager
(tests/plugin/devicemanager.py), the fake NVML with two GPUs. Prepare and Allocate calls run
during the whole sequence: each succeeds, or is retried as the kubelet retries it and then
succeeds; nothing is unprepared, no ResourceSlice deleted."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.dra.apiserver import apiserver, write_kubeconfig  # noqa: F401 (fixture)
from tests.dra.conftest import claim, result
from tests.dra.kubelet import PluginWatcher
from tests.fakes.nvml_build import nvml_config_text
from tests.inventory.conftest import fake_nvml_lib  # noqa: F401 (fixture)
from tests.plugin.devicemanager import StandInDeviceManager
from tests.rollout import Node, free_port, read, stop, wait_until

pytestmark = pytest.mark.mps_binary
DRIVER, NODE, RESOURCE = "gpu.mpsd.io", "node-a", "mpsd.io/gpu"
OLD, NEW = "0b5d9a62-1f2e-4c3d-8e9f-0a1b2c3d4e5f", "7c1e2d3f-4a5b-4c6d-9e8f-1a2b3c4d5e6f"
GIB = 1 << 30
GPUS = [(f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}", 80 * GIB, 0, (9, 0), False, "Fake H100") for i in range(2)]


class Surge:
    """One node: a holder's daemon, and ``mpsd run`` instances with the given faces."""

    def __init__(self, node: Node, env: dict[str, str], faces: dict[str, str]) -> None:
        self.node, self.env, self.faces = node, env, faces

    def start(self, uid: str, port: int | None = None):
        return self.node.start_timed({**self.env, "POD_UID": uid}, port=port, **self.faces)


@pytest.fixture
def surge(mps_control, shim_lib, fake_cuda_dir, fake_nvml_lib, apiserver, tmp_path_factory):  # noqa: F811
    node = Node(tmp_path_factory.mktemp("f"), mps_control, shim_lib, fake_cuda_dir)
    k = node.work / "k"
    (node.work / "nvml.conf").write_text(nvml_config_text(gpus=GPUS, driver="580.95.05"))
    env = {"KUBECONFIG": str(write_kubeconfig(node.work / "kubeconfig", apiserver)), "NODE_NAME": NODE,
           "FAKE_NVML_CONFIG": str(node.work / "nvml.conf")}
    faces = {"nvml-library": str(fake_nvml_lib), "dra-plugins-dir": str(k / "plugins"),
             "dra-registry-dir": str(k / "registry"), "dra-cdi-dir": str(k / "cdi"), "kubelet-dir": str(k / "dp"),
             "pod-resources-socket": str(k / "pod-resources.sock"), "region-dir": str(node.work / "regions"),
             "shim-host-dir": str(node.work / "lib"), "slices-per-gpu": "4"}
    for d in ("plugins", "registry", "cdi", "dp"):
        (k / d).mkdir(parents=True)
    node.spawn("holder")
    wait_until(node.daemon_pid, "the holder's daemon")
    yield Surge(node, env, faces)
    node.close()


class Traffic:
    """The node's pods coming and going while mpsd rolls: ``call()`` in a loop in a thread,
    each failure retried (the kubelet's pod workers retry a pod's sync) until it succeeds."""

    def __init__(self, call) -> None:
        self.call, self.done, self.retried, self.failed = call, 0, [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            deadline = time.monotonic() + 45
            while True:
                try:
                    self.call(n)
                    break
                except Exception as exc:  # noqa: BLE001 (collected, asserted on by the test)
                    if time.monotonic() > deadline:
                        self.failed.append(f"call {n}: {exc}")
                        break
                    self.retried.append(f"call {n}: {exc}")
                    time.sleep(0.1)
            n += 1
            self.done = n
            time.sleep(0.05)

    def finish(self) -> None:
        self._stop.set()
        self.thread.join(120)
        assert not self.thread.is_alive()


def test_a_dra_surge_rollout_keeps_every_claim_and_slice_and_adopts_the_daemon(surge, apiserver):  # noqa: F811
    node = surge.node
    surge.faces["dra"] = "true"

    def wipe(driver: str) -> None:  # what the kubelet's DeleteCollection does
        for name, s in list(apiserver.slices.items()):
            if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == NODE:
                apiserver.answer("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}", None)

    kubelet = PluginWatcher(surge.faces["dra-registry-dir"], wipe=wipe, wiping_delay=1.0).start()
    try:
        old, _ = surge.start(OLD)
        kubelet.wait_registered(DRIVER, 1)
        daemon = node.daemon_pid()
        assert wait_until(lambda: len(apiserver.pool_slices(DRIVER, NODE)) == 2, "the node's slices")
        published = sorted(s["metadata"]["name"] for s in apiserver.pool_slices(DRIVER, NODE))
        prepared: list[tuple[str, str, str]] = []

        def prepare(n: int) -> None:
            ref = ("ns", f"c{n}", f"uid-{n}")
            uid = ref[2]
            apiserver.put_claim(claim(uid=uid, name=ref[1], results=[result(device=f"gpu-{n % 2}", memory="1Gi")]))
            entry = kubelet.prepare(DRIVER, ref).claims[uid]
            if entry.error:
                raise AssertionError(entry.error)
            if n % 3 == 0:  # a pod gone: its claim unprepared, by whichever instance is current
                gone = kubelet.unprepare(DRIVER, ref).claims[uid]
                if gone.error:
                    raise AssertionError(gone.error)
            else:
                prepared.append(ref)

        traffic = Traffic(prepare)
        wait_until(lambda: traffic.done >= 3, "claims prepared by the old instance")
        port = free_port()
        new, _ = surge.start(NEW, port)  # ready while the old one runs: the DaemonSet may delete the old pod
        old_plugin, new_plugin = kubelet.wait_registered(DRIVER, 2)
        assert new_plugin.endpoint.endswith(f"dra-{NEW}.sock") and kubelet.get(DRIVER) is new_plugin
        assert "standing by" in read(new) and node.metric("mpsd_standby", port) == {"": 1.0}
        for first, then in ((old_plugin, new_plugin), (new_plugin, old_plugin)):  # a call in flight on either
            ref = ("ns", f"x-{first.endpoint[-9:-5]}", f"uid-x-{first.endpoint[-9:-5]}")
            apiserver.put_claim(claim(uid=ref[2], name=ref[1], results=[result(device="gpu-1", memory="2Gi")]))
            assert direct(first, "NodePrepareResources", ref).claims[ref[2]].error == ""
            assert os.path.exists(os.path.join(surge.faces["dra-cdi-dir"], f"mpsd.io-claim_{ref[2]}.json"))
            assert direct(then, "NodeUnprepareResources", ref).claims[ref[2]].error == ""
            assert not os.path.exists(os.path.join(surge.faces["dra-cdi-dir"], f"mpsd.io-claim_{ref[2]}.json"))
        before = traffic.done
        wait_until(lambda: traffic.done >= before + 3, "claims prepared by the standby")
        assert stop(old) == 0, read(old)
        wait_until(lambda: f"adopted the running control daemon pid={daemon}" in read(new), "the adoption")
        assert kubelet.wait_registered(DRIVER, 1) == [new_plugin]
        before = traffic.done
        wait_until(lambda: traffic.done >= before + 3, "claims prepared by the new supervisor")
        traffic.finish()

        assert traffic.failed == [], traffic.failed
        assert node.daemon_pid() == daemon and node.quits() == 0
        on_old = [c for c in kubelet.calls if c.endpoint.endswith(f"dra-{OLD}.sock") and not c.error]
        on_new = [c for c in kubelet.calls if c.endpoint.endswith(f"dra-{NEW}.sock") and not c.error]
        assert on_old and on_new
        cdi = sorted(os.listdir(surge.faces["dra-cdi-dir"]))
        assert cdi == sorted(f"mpsd.io-claim_{u}.json" for _, _, u in prepared)  # nothing else unprepared
        time.sleep(1.5)  # past the stand-in kubelet's wiping delay
        assert kubelet.wiped == [] and not [u for m, u in apiserver.writes() if m == "DELETE"]
        assert sorted(s["metadata"]["name"] for s in apiserver.pool_slices(DRIVER, NODE)) == published
        for ref in prepared:  # what the old instance prepared too, unprepared by the new one
            assert kubelet.unprepare(DRIVER, ref).claims[ref[2]].error == ""
        assert os.listdir(surge.faces["dra-cdi-dir"]) == []
        assert stop(new) == 0 and node.daemon_pid() == daemon and node.quits() == 0
    finally:
        kubelet.stop()


def direct(plugin, method: str, ref: tuple[str, str, str]):
    """One call to this plugin instance, whichever the kubelet would pick (a call in flight)."""
    kind = "NodePrepareResourcesRequest" if method == "NodePrepareResources" else "NodeUnprepareResourcesRequest"
    request = getattr(plugin.pb2, kind)(claims=[plugin.pb2.Claim(namespace=ref[0], name=ref[1], uid=ref[2])])
    return getattr(plugin.stub, method)(request, timeout=45)


def test_a_device_plugin_surge_rollout_keeps_allocating_and_adopts_the_daemon(surge):
    node = surge.node
    surge.faces["device-plugin"] = "true"
    manager = StandInDeviceManager(Path(surge.faces["kubelet-dir"]))
    try:
        old, _ = surge.start(OLD)
        daemon = node.daemon_pid()

        def healthy() -> list[str]:
            with manager.lock:
                return sorted(manager.healthy.get(RESOURCE, set()))

        wait_until(lambda: len(healthy()) == 8, "the old instance's 8 slices healthy")

        def allocate(n: int) -> None:
            ids = healthy()
            if not ids:
                raise AssertionError("no healthy device")
            response = manager.allocate(RESOURCE, [ids[n % len(ids)]])
            assert response.container_responses[0].envs["CUDA_MPS_PIPE_DIRECTORY"] == str(node.pipe)

        traffic = Traffic(allocate)
        wait_until(lambda: traffic.done >= 3, "allocations by the old instance")
        port = free_port()
        new, _ = surge.start(NEW, port)
        wait_until(lambda: manager.registrations[-1:] == [f"mpsd-mpsd.io_gpu-{NEW}.sock"], "the new registration")
        assert node.metric("mpsd_standby", port) == {"": 1.0}
        before = traffic.done
        wait_until(lambda: traffic.done >= before + 3, "allocations by the standby")
        assert stop(old, signal.SIGTERM) == 0, read(old)
        wait_until(lambda: f"adopted the running control daemon pid={daemon}" in read(new), "the adoption")
        wait_until(lambda: len(healthy()) == 8, "the slices healthy again")
        before = traffic.done
        wait_until(lambda: traffic.done >= before + 3, "allocations by the new supervisor")
        traffic.finish()
        assert traffic.failed == [], traffic.failed
        assert node.daemon_pid() == daemon and node.quits() == 0
        assert stop(new) == 0 and node.daemon_pid() == daemon
    finally:
        manager.stop()


def test_sigterm_to_a_standby_leaves_the_daemon_and_every_claim_to_the_old_instance(surge, apiserver):  # noqa: F811
    """The rollout undone (the new pod deleted while it stands by): it deregisters its own
    plugin instance and exits 0; what it prepared stays prepared, the old instance unprepares
    it; no slice deleted, the daemon untouched."""
    node = surge.node
    surge.faces["dra"] = "true"
    kubelet = PluginWatcher(surge.faces["dra-registry-dir"], wiping_delay=1.0).start()
    try:
        old, _ = surge.start(OLD)
        (old_plugin,) = kubelet.wait_registered(DRIVER, 1)
        daemon = node.daemon_pid()
        assert wait_until(lambda: len(apiserver.pool_slices(DRIVER, NODE)) == 2, "the node's slices")
        refs = [("ns", f"c{n}", f"uid-{n}") for n in range(2)]
        for n, ref in enumerate(refs):
            apiserver.put_claim(claim(uid=ref[2], name=ref[1], results=[result(device=f"gpu-{n}", memory="1Gi")]))
        assert kubelet.prepare(DRIVER, refs[0]).claims[refs[0][2]].error == ""  # by the old instance
        new, _ = surge.start(NEW, free_port())
        _, new_plugin = kubelet.wait_registered(DRIVER, 2)
        assert kubelet.prepare(DRIVER, refs[1]).claims[refs[1][2]].error == ""  # by the standby
        assert kubelet.calls[-1].endpoint == new_plugin.endpoint
        assert stop(new) == 0, read(new)
        assert "stopped while standing by" in read(new)
        assert kubelet.wait_registered(DRIVER, 1) == [old_plugin]
        cdi = surge.faces["dra-cdi-dir"]
        assert sorted(os.listdir(cdi)) == sorted(f"mpsd.io-claim_{u}.json" for _, _, u in refs)
        for ref in refs:
            assert kubelet.unprepare(DRIVER, ref).claims[ref[2]].error == ""
        assert os.listdir(cdi) == []
        time.sleep(1.5)
        assert kubelet.wiped == [] and not [u for m, u in apiserver.writes() if m == "DELETE"]
        assert node.daemon_pid() == daemon and node.quits() == 0 and old.poll() is None
    finally:
        kubelet.stop()
