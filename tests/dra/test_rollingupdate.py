"""A rolling update of mpsd's DRA face with maxSurge: the old and the new run_dra serve one node
side by side, a stand-in kubelet (tests/dra/kubelet.py: the plugin watcher and DRA plugin
manager of 1.33+) moves to the new instance, Prepare and Unprepare keep being answered, nothing
prepared is lost or unprepared, and no ResourceSlice is deleted: the scheduler never sees the
node's GPUs go."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from mpsd import config as cfg
from mpsd.dra import service
from mpsd.dra.kubeletplugin import registration_socket_name
from mpsd.lifecycle.health import HealthBoard
from mpsd.inventory.nvml import Gpu

from tests.dra.conftest import DRIVER, GIB, NODE, claim, result
from tests.dra.kubelet import PluginWatcher

GPUS = [Gpu(i, f"GPU-0000000{i}-aaaa-bbbb-cccc-00000000000{i}", "Fake H100", 80 * GIB, 0, (9, 0), False)
        for i in range(2)]
OLD, NEW = "0b5d9a62-1f2e-4c3d-8e9f-0a1b2c3d4e5f", "7c1e2d3f-4a5b-4c6d-9e8f-1a2b3c4d5e6f"


class Instance:
    """One mpsd pod's run_dra in a thread, its sockets named after ``uid``."""

    def __init__(self, env, library, uid: str) -> None:
        self.uid, self.stop_event, self.errors = uid, threading.Event(), []
        config = cfg.load(None, {}, {
            "dra": "true", "dra-plugins-dir": str(env.plugins_dir), "dra-registry-dir": str(env.registry_dir),
            "dra-cdi-dir": str(env.cdi_dir), "region-dir": env.paths.region_dir,
            "shim-host-dir": env.paths.shim_host_dir, "state-dir": str(env.root / "state"),
        })
        self.thread = threading.Thread(target=self._serve, args=(env, config, library), daemon=True)
        self.thread.start()

    def _serve(self, env, config, library) -> None:
        try:
            service.run_dra(config, pipe_dir=env.paths.pipe_dir, gpus=GPUS, board=HealthBoard(), metrics=None,
                            shim_library=str(library), stop=self.stop_event, instance=self.uid)
        except Exception as exc:  # noqa: BLE001 (checked by stop)
            self.errors.append(exc)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.errors and not self.thread.is_alive()


@pytest.fixture
def rollout(env, apiserver, kubeconfig, monkeypatch, tmp_path):
    monkeypatch.setenv("NODE_NAME", NODE)
    monkeypatch.setattr(service, "PUBLISH_INTERVAL", 0.2)
    library = tmp_path / "libmpsshim.so"
    library.write_bytes(b"\x7fELF")

    def wipe(driver: str) -> None:  # what the kubelet's DeleteCollection does
        for name, s in list(apiserver.slices.items()):
            if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == NODE:
                apiserver.answer("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{name}", None)

    kubelet = PluginWatcher(str(env.registry_dir), wipe=wipe, wiping_delay=1.0).start()  # 1 s: any gap shows
    instances: list[Instance] = []

    def start(uid: str) -> Instance:
        instances.append(Instance(env, library, uid))
        return instances[-1]

    yield kubelet, start
    for i in instances:
        if i.thread.is_alive():
            i.stop()
    kubelet.stop()


def slices(apiserver):
    return sorted((s["metadata"]["name"], s["metadata"]["resourceVersion"]) for s in apiserver.pool_slices(DRIVER, NODE))


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_old_and_new_overlap_and_the_kubelet_moves_without_a_gap(env, apiserver, rollout):
    kubelet, start = rollout
    claims = [("ns", f"c{i}", f"uid-{i}") for i in range(12)]
    for i, (_, name, uid) in enumerate(claims):
        apiserver.put_claim(claim(uid=uid, name=name, results=[result(device=f"gpu-{i % 2}", memory="1Gi")]))
    old = start(OLD)
    (first,) = kubelet.wait_registered(DRIVER, 1)
    assert first.endpoint == str(env.plugins_dir / DRIVER / f"dra-{OLD}.sock")
    assert wait_for(lambda: len(slices(apiserver)) == 2)
    published = slices(apiserver)
    for c in claims[:4]:
        assert kubelet.prepare(DRIVER, c).claims[c[2]].error == ""

    new = start(NEW)  # maxSurge: the new pod starts while the old one serves
    old_plugin, new_plugin = kubelet.wait_registered(DRIVER, 2)
    assert new_plugin.endpoint == str(env.plugins_dir / DRIVER / f"dra-{NEW}.sock")
    assert kubelet.get(DRIVER) is new_plugin  # the most recent connected one

    errors: list[str] = []
    done = threading.Event()

    def traffic() -> None:  # the node's pods keep coming and going during the handover
        for c in claims[4:]:
            errors.extend(e.error for e in kubelet.prepare(DRIVER, c).claims.values() if e.error)
        for c in claims[:2]:  # prepared by the old instance, unprepared by the new one
            errors.extend(e.error for e in kubelet.unprepare(DRIVER, c).claims.values() if e.error)
        done.set()

    thread = threading.Thread(target=traffic)
    thread.start()
    old.stop()  # the DaemonSet controller deletes the old pod
    thread.join(60)
    assert done.is_set() and errors == []
    assert kubelet.wait_registered(DRIVER, 1) == [new_plugin]
    assert all(c.error == "" for c in kubelet.calls)

    cdi = sorted(os.listdir(env.cdi_dir))
    assert cdi == sorted(f"mpsd.io-claim_{u}.json" for _, _, u in claims[2:])  # nothing else unprepared
    time.sleep(1.5)  # past the kubelet's wiping delay
    assert kubelet.wiped == []
    assert not [u for m, u in apiserver.writes() if m == "DELETE"]
    assert slices(apiserver) == published  # not even rewritten: the new instance found its pool current
    for c in claims[2:]:  # and the new instance unprepares what the old one prepared
        assert kubelet.unprepare(DRIVER, c).claims[c[2]].error == ""
    assert os.listdir(env.cdi_dir) == []
    new.stop()


def test_a_claim_the_old_instance_prepared_after_the_new_one_started_is_unprepared_by_the_new_one(
        env, apiserver, rollout):
    """Between the new instance's start (its state read) and its registration, the kubelet still
    calls the old one: the new one must not answer "not prepared here" for that claim and leave
    its CDI spec and directory behind."""
    kubelet, start = rollout
    apiserver.put_claim(claim(uid="uid-late", name="late", results=[result(memory="1Gi")]))
    start(OLD)
    kubelet.wait_registered(DRIVER, 1)
    kubelet.paused.set()  # the kubelet has not seen the new socket yet
    start(NEW)
    assert wait_for(lambda: (env.registry_dir / registration_socket_name(DRIVER, NEW)).exists())
    assert kubelet.prepare(DRIVER, ("ns", "late", "uid-late")).claims["uid-late"].error == ""  # by the old one
    assert kubelet.calls[-1].endpoint.endswith(f"dra-{OLD}.sock")
    kubelet.paused.clear()
    kubelet.wait_registered(DRIVER, 2)
    assert kubelet.unprepare(DRIVER, ("ns", "late", "uid-late")).claims["uid-late"].error == ""
    assert kubelet.calls[-1].endpoint.endswith(f"dra-{NEW}.sock")
    assert os.listdir(env.cdi_dir) == []
    assert [d for d in os.listdir(env.paths.region_dir) if not d.startswith(".")] == []


def test_a_restart_without_overlap_leaves_the_slices_to_the_kubelets_grace(env, apiserver, rollout):
    """maxUnavailable instead of maxSurge: mpsd no longer deletes its slices on the way out, so
    a new instance back within the kubelet's wiping delay (30 s; 1 s here) finds them in place."""
    kubelet, start = rollout
    kubelet.wiping_delay = 5.0
    old = start(OLD)
    kubelet.wait_registered(DRIVER, 1)
    assert wait_for(lambda: len(slices(apiserver)) == 2)
    published = slices(apiserver)
    old.stop()
    new = start(NEW)
    kubelet.wait_registered(DRIVER, 1)
    time.sleep(0.5)
    assert kubelet.wiped == [] and slices(apiserver) == published
    new.stop()


def test_a_driver_gone_for_good_has_its_slices_wiped_by_the_kubelet(env, apiserver, rollout):
    """dra.enabled turned off, or mpsd uninstalled: the last instance deregisters on its way out
    and the kubelet wipes the node's slices after its delay (mpsd dra-remove-slices does it at once)."""
    kubelet, start = rollout
    old = start(OLD)
    kubelet.wait_registered(DRIVER, 1)
    assert wait_for(lambda: len(slices(apiserver)) == 2)
    old.stop()
    assert wait_for(lambda: kubelet.wiped == [DRIVER], timeout=10)
    assert slices(apiserver) == []


def test_sockets_of_a_killed_instance_are_removed_and_a_live_ones_are_kept(env, apiserver, rollout):
    kubelet, start = rollout
    env.registry_dir.mkdir(parents=True)
    (env.plugins_dir / DRIVER).mkdir(parents=True)
    dead = []
    for path in (env.registry_dir / registration_socket_name(DRIVER, "dead-pod"), env.plugins_dir / DRIVER / "dra-dead-pod.sock"):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()  # bound, nobody listens: what a SIGKILLed instance leaves
        dead.append(path)
    other = env.registry_dir / "other.example.com-reg.sock"  # another driver's: never ours to judge
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(other))
    s.close()
    old = start(OLD)
    kubelet.wait_registered(DRIVER, 1)
    assert not any(p.exists() for p in dead) and other.exists()
    new = start(NEW)
    kubelet.wait_registered(DRIVER, 2)  # the new one left the old one's live sockets alone
    new.stop()
    old.stop()
