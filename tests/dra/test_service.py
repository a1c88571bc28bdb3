"""``mpsd run``'s DRA plugin end to end: run_dra reads claims from the stand-in API server (through
KUBECONFIG and the real client), a stand-in kubelet registers it and prepares over gRPC; the API
server slow or down gives a bounded one-line error per claim and writes nothing."""

from __future__ import annotations

import os
import threading
import time

import pytest

from mpsd import config as cfg
from mpsd.dra import service
from mpsd.lifecycle.health import HealthBoard
from mpsd.inventory.nvml import Gpu

from tests.dra.conftest import GIB, NODE, StandInKubelet, claim, result

CLAIM = ("ns", "c1", "uid-1")
GPUS = [Gpu(0, "GPU-00000000-aaaa-bbbb-cccc-000000000000", "Fake H100", 80 * GIB, 0, (9, 0), False)]


class Running:
    """run_dra in a thread, registered by a stand-in kubelet."""

    def __init__(self, env, config, library):
        self.gpus = list(GPUS)  # what the inventory lists now
        self.board = HealthBoard()  # the supervisor's: the daemon is starting
        self.stop_event = threading.Event()
        self.errors: list[Exception] = []
        self.thread = threading.Thread(target=self._serve, args=(env, config, library))
        self.thread.start()
        self.reg = env.registry_dir / "gpu.mpsd.io-reg.sock"
        deadline = time.monotonic() + 30
        while not self.reg.exists() and not self.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.errors and self.reg.exists()
        self.kubelet = StandInKubelet(str(self.reg))
        self.kubelet.register()

    def _serve(self, env, config, library):
        try:
            service.run_dra(config, pipe_dir=env.paths.pipe_dir, gpus=GPUS, board=self.board, metrics=None,
                            shim_library=str(library), stop=self.stop_event, gpu_lister=lambda: self.gpus)
        except Exception as exc:  # reported by stop()
            self.errors.append(exc)

    def stop(self):
        self.kubelet.close()
        self.stop_event.set()
        self.thread.join(30)
        assert not self.errors and not self.thread.is_alive()
        assert not self.reg.exists()  # deregistered on the way out


def dra_config(env, tmp_path):
    """(a stand-in shim library, mpsd's config with the DRA driver on, over ``env``'s directories)."""
    library = tmp_path / "libmpsshim.so"
    library.write_bytes(b"\x7fELF")
    config = cfg.load(None, {}, {
        "dra": "true", "dra-plugins-dir": str(env.plugins_dir), "dra-registry-dir": str(env.registry_dir),
        "dra-cdi-dir": str(env.cdi_dir), "region-dir": env.paths.region_dir, "shim-host-dir": env.paths.shim_host_dir,
        "state-dir": str(env.root / "state"),
    })
    return library, config


@pytest.fixture
def running(env, kubeconfig, monkeypatch, tmp_path):
    monkeypatch.setenv("NODE_NAME", NODE)
    monkeypatch.setattr(service, "API_TIMEOUT", 1.0)
    monkeypatch.setattr(service, "PUBLISH_INTERVAL", 0.1)
    library, config = dra_config(env, tmp_path)
    r = Running(env, config, library)
    yield r
    if r.thread.is_alive():
        r.stop()


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_slices_are_published_while_it_runs_and_stay_on_shutdown(apiserver, running):
    """A restart or an upgrade of mpsd must not make the node's GPUs vanish for the scheduler
    (issue 19): the old run_dra deleted the node's slices on its way out."""
    assert wait_for(lambda: apiserver.pool_slices("gpu.mpsd.io", NODE))
    (slice_,) = apiserver.pool_slices("gpu.mpsd.io", NODE)
    assert [d["name"] for d in slice_["spec"]["devices"]] == ["gpu-0"]
    running.stop()
    assert apiserver.pool_slices("gpu.mpsd.io", NODE) == [slice_]
    assert not [u for m, u in apiserver.writes() if m == "DELETE"]


def test_remove_slices_deletes_the_nodes_slices_of_the_driver(apiserver, running, capsys):
    """What an operator runs (mpsd dra-remove-slices) after turning DRA off or uninstalling."""
    from mpsd.cli import main

    assert wait_for(lambda: apiserver.pool_slices("gpu.mpsd.io", NODE))
    running.stop()
    assert main(["dra-remove-slices", "--node", NODE]) == 0
    assert capsys.readouterr().out == "1 ResourceSlice(s) of gpu.mpsd.io deleted\n"
    assert apiserver.pool_slices("gpu.mpsd.io", NODE) == []
    assert main(["dra-remove-slices", "--node", NODE]) == 0  # nothing left: still fine


def test_remove_slices_with_the_api_server_down_is_one_line(apiserver, kubeconfig, capsys):
    from mpsd.cli import main

    apiserver.stop()
    assert main(["dra-remove-slices", "--node", NODE]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mpsd: list ResourceSlices of driver gpu.mpsd.io on node node-a: cannot reach")
    assert err.count("\n") == 1
    apiserver.start()


def test_a_gpu_that_appears_is_published_and_claims_on_it_are_prepared(apiserver, running):
    assert wait_for(lambda: apiserver.pool_slices("gpu.mpsd.io", NODE))
    apiserver.put_claim(claim(results=[result(device="gpu-1", memory="4Gi")]))
    assert "GPU 1 is not on this node" in running.kubelet.prepare(CLAIM).claims["uid-1"].error
    running.gpus = [*GPUS, Gpu(1, "GPU-00000001-aaaa-bbbb-cccc-000000000001", "Fake H100", 80 * GIB, 0, (9, 0), False)]

    def published():
        return sorted(d["name"] for s in apiserver.pool_slices("gpu.mpsd.io", NODE) for d in s["spec"]["devices"])

    assert wait_for(lambda: published() == ["gpu-0", "gpu-1"])
    assert running.kubelet.prepare(CLAIM).claims["uid-1"].error == ""
    running.gpus = []  # NVML failing for a moment: the last listing stays
    time.sleep(0.5)
    assert published() == ["gpu-0", "gpu-1"]


def test_a_malformed_slice_list_is_retried_and_never_ends_the_plugin(apiserver, running, caplog):
    """Any shape the API server sends for the list is one line and a retry at the next round
    (every 5 s; tests/dra/test_kubeapi.py has every shape); the plugin keeps serving and
    publishes once the answers are right again."""
    assert wait_for(lambda: apiserver.pool_slices("gpu.mpsd.io", NODE))
    apiserver.raw["GET"] = [b'{"items": [5]}', b'{"items": [{"metadata": {"name": "a"}}]}', b"[]"]
    running.gpus = [*GPUS, Gpu(1, "GPU-00000001-aaaa-bbbb-cccc-000000000001", "Fake H100", 80 * GIB, 0, (9, 0), False)]

    def published():
        return sorted(d["name"] for s in apiserver.pool_slices("gpu.mpsd.io", NODE) for d in s["spec"]["devices"])

    assert wait_for(lambda: published() == ["gpu-0", "gpu-1"] or running.errors, timeout=60)
    assert not running.errors and running.thread.is_alive() and apiserver.raw["GET"] == []
    lines = [r.getMessage() for r in caplog.records if "resourceslices not published" in r.getMessage()]
    assert len(lines) == 3 and all("\n" not in line and "answer from the API server" in line for line in lines)
    apiserver.put_claim(claim())
    assert running.kubelet.prepare(CLAIM).claims["uid-1"].error == ""  # still serving


def test_a_claim_on_the_api_server_is_prepared_and_unprepared(env, apiserver, running):
    apiserver.put_claim(claim(results=[result(memory="20Gi", compute="25")]))
    entry = running.kubelet.prepare(CLAIM).claims["uid-1"]
    assert entry.error == "" and list(entry.devices[0].cdi_device_ids) == ["mpsd.io/claim=uid-1_gpu"]
    assert (env.cdi_dir / "mpsd.io-claim_uid-1.json").exists()
    assert os.path.exists(os.path.join(env.paths.shim_host_dir, "libmpsshim.so.3"))
    assert any(m == "GET" and "/namespaces/ns/resourceclaims/c1" in u for m, u in apiserver.requests)
    assert running.kubelet.unprepare(CLAIM).claims["uid-1"].error == ""
    assert os.listdir(env.cdi_dir) == []


def test_a_claim_the_api_server_does_not_have_is_an_error_for_it(env, apiserver, running):
    entry = running.kubelet.prepare(CLAIM).claims["uid-1"]
    assert "404" in entry.error and "ns/c1" in entry.error and "\n" not in entry.error


def test_a_slow_api_server_is_a_bounded_one_line_error_and_nothing_is_written(env, apiserver, running):
    apiserver.put_claim(claim())
    apiserver.delay = 5.0  # beyond the client's 1 s timeout
    t0 = time.monotonic()
    entry = running.kubelet.prepare(CLAIM).claims["uid-1"]
    assert "within 1s" in entry.error and "\n" not in entry.error
    assert time.monotonic() - t0 < 20
    assert os.listdir(env.cdi_dir) == [] and not os.path.exists(env.paths.region_dir)
    apiserver.delay = 0.0
    assert running.kubelet.prepare(CLAIM).claims["uid-1"].error == ""  # the kubelet's retry


def test_an_api_server_that_is_down_is_a_one_line_error(env, apiserver, running):
    apiserver.put_claim(claim())
    apiserver.stop()
    entry = running.kubelet.prepare(CLAIM).claims["uid-1"]
    assert "cannot reach the API server" in entry.error and "\n" not in entry.error
    assert os.listdir(env.cdi_dir) == []
    apiserver.start()


def test_mpsd_run_starts_the_dra_plugin_and_a_failure_makes_the_node_not_ready(tmp_path, monkeypatch):
    """node.py's wiring: with dra.enabled the DRA plugin runs in its own thread with the shim and
    the state dir; a plugin that stops makes /readyz say why (liveness is left alone)."""
    from mpsd.errors import KubeAPIError
    from mpsd.node import _ready, _start_dra

    library = tmp_path / "libmpsshim.so"
    library.write_bytes(b"")
    config = cfg.load(None, {}, {"dra": "true", "shim-library": str(library), "state-dir": str(tmp_path)})
    board = HealthBoard()
    board.update(daemon_up=True, configured=True)
    calls = []

    def failing(config, **kwargs):
        calls.append(kwargs)
        raise KubeAPIError("get Node n: cannot reach the API server: connection refused")

    monkeypatch.setattr(service, "run_dra", failing)
    run = _start_dra(config, board, None, list, threading.Event())
    run.thread.join(30)
    assert calls and calls[0]["shim_library"] == str(library) and calls[0]["state_dir"] == str(tmp_path)
    assert _ready(board, None, run) == (False, "DRA plugin stopped: get Node n: cannot reach the API server: "
                                               "connection refused")


GPU1 = Gpu(1, "GPU-00000001-aaaa-bbbb-cccc-000000000001", "Fake H100", 80 * GIB, 0, (9, 0), False)


def test_a_subrequest_claim_on_the_api_server_reaches_its_container(apiserver, running):
    """A claim with a prioritized list, validated as the API server validates it, prepared end to
    end: the container naming the request gets the CDI device of the alternative picked."""
    apiserver.put_claim(claim(results=[result(request="gpu/small", memory="8Gi", compute="10")]))
    entry = running.kubelet.prepare(CLAIM).claims["uid-1"]
    assert entry.error == "" and running.kubelet.container_cdi_ids(entry, "gpu") == ["mpsd.io/claim=uid-1_gpu"]


def test_the_kubelet_sees_the_boards_health_and_a_gpu_nvml_lost(apiserver, running):
    """mpsd run's DRA plugin serves device health from the supervisor's board: unhealthy while
    the daemon starts, healthy once it is configured; a GPU that NVML stops listing is unhealthy
    for the claim still prepared on it."""
    watch = running.kubelet.watch_health()
    assert watch.wait(lambda w: w.health(NODE, "gpu-0") == ("unhealthy", "MPS daemon down: starting"))
    running.board.update(daemon_up=True, configured=True)
    assert watch.wait(lambda w: w.health(NODE, "gpu-0") == ("healthy", ""))
    running.gpus = [*GPUS, GPU1]
    assert wait_for(lambda: watch.health(NODE, "gpu-1") == ("healthy", ""))
    apiserver.put_claim(claim(results=[result(device="gpu-1", memory="4Gi", compute="5")]))
    assert running.kubelet.prepare(CLAIM).claims["uid-1"].error == ""
    running.gpus = list(GPUS)  # NVML lists GPU 0 only
    assert watch.wait(lambda w: w.health(NODE, "gpu-1") == ("unhealthy", f"NVML no longer lists GPU 1 ({GPU1.uuid})"))
    assert watch.health(NODE, "gpu-0") == ("healthy", "")


def test_the_driver_version_nvml_reports_is_published(env, apiserver, kubeconfig, monkeypatch, tmp_path):
    """docs/dra.md lists a driverVersion attribute (NVIDIA's 580.95.05 as semver 580.95.5): run_dra
    publishes what NVML reports."""
    monkeypatch.setenv("NODE_NAME", NODE)
    library, config = dra_config(env, tmp_path)
    stop = threading.Event()
    thread = threading.Thread(target=service.run_dra, args=(config,), kwargs=dict(
        pipe_dir=env.paths.pipe_dir, gpus=GPUS, board=HealthBoard(), metrics=None, shim_library=str(library),
        stop=stop, driver_version=lambda: "580.95.05"))
    thread.start()
    try:
        assert wait_for(lambda: apiserver.pool_slices("gpu.mpsd.io", NODE))
        (slice_,) = apiserver.pool_slices("gpu.mpsd.io", NODE)
        assert slice_["spec"]["devices"][0]["attributes"]["driverVersion"] == {"version": "580.95.5"}
    finally:
        stop.set()
        thread.join(30)
