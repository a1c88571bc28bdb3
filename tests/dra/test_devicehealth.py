"""Device health for the kubelet (KEP-4680, DRAResourceHealth v1 and v1alpha1): what each state of
the supervisor's board makes of a device, and the stream a stand-in kubelet reads over real gRPC
on the plugin's DRA socket, from the registration to recovery."""

from __future__ import annotations

import time

import grpc
import pytest

from mpsd.dra.claims import ClaimRef
from mpsd.dra.devicehealth import HEALTHY, MAX_STREAMS, UNHEALTHY, UNKNOWN, DeviceHealth, HealthSource, device_health
from mpsd.lifecycle.health import HealthBoard, HealthState
from mpsd.registry import Metrics

from tests.dra.conftest import NODE, StandInKubelet, claim, gpus, result

UP = HealthState(daemon_up=True, configured=True)


@pytest.mark.parametrize("state, want", [
    (UP, [(HEALTHY, ""), (HEALTHY, "")]),
    (HealthState(daemon_up=False, last_error="daemon pid=7 hung: no answer (3 health checks in a row)"),
     [(UNHEALTHY, "MPS daemon down: daemon pid=7 hung: no answer (3 health checks in a row)")] * 2),
    (HealthState(), [(UNHEALTHY, "MPS daemon down: starting")] * 2),
    (HealthState(daemon_up=True), [(UNHEALTHY, "MPS daemon not configured yet")] * 2),
    (HealthState(daemon_up=True, configured=True, faulted_gpus=frozenset({1}), last_error="MPS server(s) 9 in FAULT"),
     [(HEALTHY, ""), (UNHEALTHY, "MPS server of GPU 1 in FAULT: MPS server(s) 9 in FAULT")]),
    (HealthState(daemon_up=True, configured=True, unverified="held by pid 5 for 31s"),
     [(UNKNOWN, "no health verdict: held by pid 5 for 31s")] * 2),
])
def test_each_board_state_gives_each_gpus_device_its_health(state, want):
    rows = device_health(state, gpus(80, 40), [], "capacity", 4)
    assert [r.device for r in rows] == ["gpu-0", "gpu-1"]
    assert [(r.health, r.message) for r in rows] == want


def test_slices_mode_reports_every_slice_and_a_long_message_is_cut_as_the_kubelet_would():
    state = HealthState(daemon_up=False, last_error="x" * 2000)
    rows = device_health(state, gpus(80), [], "slices", 3)
    assert [r.device for r in rows] == ["gpu-0-slice-0", "gpu-0-slice-1", "gpu-0-slice-2"]
    assert all(len(r.message) == 1024 and r.message.endswith("...") for r in rows)


def test_a_gpu_nvml_no_longer_lists_is_unhealthy_for_the_claims_on_it(env):
    env.claims.put(claim(results=[result(device="gpu-1", memory="4Gi", compute="10")]))
    p = env.loaded()
    rec = p.prepare(ClaimRef("ns", "c1", "uid-1"))
    rows = device_health(UP, gpus(80), [rec], "capacity", 4)  # GPU 1 gone from NVML's list
    gone = gpus(80, 40)[1].uuid
    assert rows == [DeviceHealth("gpu-0", HEALTHY), DeviceHealth("gpu-1", UNHEALTHY, f"NVML no longer lists GPU 1 ({gone})")]


@pytest.fixture
def health_plugin(env):
    """A started plugin serving health from a board (daemon up), resending every 0.2 s; yields
    (plugin, board, metrics, kubelet registered)."""
    board, metrics = HealthBoard(), Metrics()
    board.update(daemon_up=True, configured=True)
    preparer = env.preparer()
    source = HealthSource(board, lambda: preparer.gpus, preparer.prepared, "capacity", 4, metrics)
    from mpsd.dra.kubeletplugin import DraPlugin

    plugin = DraPlugin(preparer, plugins_dir=str(env.plugins_dir), registry_dir=str(env.registry_dir),
                       poll_interval=0.05, health=source, health_options={"resend_interval": 0.2,
                                                                           "wake_interval": 0.05})
    plugin.start()
    kubelet = StandInKubelet(plugin.registration_path)
    kubelet.register()
    yield plugin, board, metrics, kubelet
    kubelet.close()
    plugin.stop()


def test_the_kubelet_follows_a_hung_daemon_and_its_recovery(health_plugin):
    plugin, board, metrics, kubelet = health_plugin
    assert list(kubelet.info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
    watch = kubelet.watch_health()
    assert watch.pb2.DESCRIPTOR.package == "v1"
    assert watch.wait(lambda w: w.health(NODE, "gpu-0") == (HEALTHY, "") and w.health(NODE, "gpu-1")[0] == HEALTHY)

    board.update(daemon_up=False, configured=False, last_error="daemon pid=7 hung: no answer")
    assert watch.wait(lambda w: w.health(NODE, "gpu-1") == (UNHEALTHY, "MPS daemon down: daemon pid=7 hung: no answer"))
    assert watch.health(NODE, "gpu-0")[0] == UNHEALTHY

    board.update(daemon_up=True, configured=True, last_error="")
    assert watch.wait(lambda w: w.health(NODE, "gpu-0") == (HEALTHY, "") == w.health(NODE, "gpu-1"))

    board.update(faulted_gpus={0}, last_error="MPS server(s) 9 in FAULT")
    assert watch.wait(lambda w: w.health(NODE, "gpu-0")[0] == UNHEALTHY)
    assert watch.health(NODE, "gpu-1") == (HEALTHY, "")


def test_the_list_is_sent_again_before_the_kubelets_timeout_and_states_it(health_plugin):
    """Unchanged health is sent again (the kubelet takes a device not heard of within
    health_check_timeout_seconds as unknown); each device says its timeout, 30 s."""
    plugin, board, metrics, kubelet = health_plugin
    watch = kubelet.watch_health()
    assert watch.wait(lambda w: w.responses >= 3, timeout=30)
    assert {entry[2] for entry in watch.cache.values()} == {30.0}
    assert metrics.registry.get_sample_value("mpsd_dra_health_updates_total") >= 3
    assert metrics.registry.get_sample_value("mpsd_dra_health_streams") == 1


def test_a_kubelet_that_knows_only_v1alpha1_gets_the_same_health(health_plugin):
    plugin, board, metrics, kubelet = health_plugin
    board.update(faulted_gpus={1}, last_error="MPS server(s) 9 in FAULT")
    watch = kubelet.watch_health(known=("v1alpha1.DRAResourceHealth",))
    assert watch.pb2.DESCRIPTOR.package == "v1alpha1"
    assert watch.wait(lambda w: w.health(NODE, "gpu-1")[0] == UNHEALTHY and w.health(NODE, "gpu-0")[0] == HEALTHY)


def test_a_kubelet_without_the_health_service_opens_no_stream_and_still_prepares(health_plugin, env):
    plugin, board, metrics, kubelet = health_plugin
    assert kubelet.watch_health(known=()) is None
    env.claims.put(claim())
    assert kubelet.prepare(("ns", "c1", "uid-1")).claims["uid-1"].error == ""


def test_streams_beyond_the_limit_are_refused_and_prepare_still_answers(health_plugin, env):
    plugin, board, metrics, kubelet = health_plugin
    watches = [kubelet.watch_health() for _ in range(MAX_STREAMS + 1)]
    # the streams open at once: whichever the server reaches last is the one refused
    deadline = time.monotonic() + 30
    while not [w for w in watches if w.ended is not None] and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = [w for w in watches if w.ended is not None]
    assert len(refused) == 1 and refused[0].ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    env.claims.put(claim())
    assert kubelet.prepare(("ns", "c1", "uid-1")).claims["uid-1"].error == ""
    assert all(w.wait(lambda w: w.responses >= 1) for w in watches if w is not refused[0])


def test_device_health_is_on_metrics(health_plugin):
    plugin, board, metrics, kubelet = health_plugin
    board.update(faulted_gpus={1}, last_error="MPS server(s) 9 in FAULT")
    rows = plugin.health.publish_metrics()
    assert [(r.device, r.health) for r in rows] == [("gpu-0", HEALTHY), ("gpu-1", UNHEALTHY)]
    value = metrics.registry.get_sample_value
    assert value("mpsd_dra_device_health", {"device": "gpu-1", "health": "unhealthy"}) == 1
    assert value("mpsd_dra_device_health", {"device": "gpu-1", "health": "healthy"}) is None
    board.update(faulted_gpus=set(), last_error="")
    plugin.health.publish_metrics()
    assert value("mpsd_dra_device_health", {"device": "gpu-1", "health": "unhealthy"}) is None
    assert value("mpsd_dra_device_health", {"device": "gpu-1", "health": "healthy"}) == 1


def test_the_stream_ends_when_the_plugin_stops(health_plugin):
    plugin, board, metrics, kubelet = health_plugin
    watch = kubelet.watch_health()
    assert watch.wait(lambda w: w.responses >= 1)
    plugin.stop()
    assert watch.wait(lambda w: w.done, timeout=30)
