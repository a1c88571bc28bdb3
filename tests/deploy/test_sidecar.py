"""deploy/sidecar: mpsd (daemon only) next to an app in one pod, sharing the pipe dir and
/dev/shm, the app preloading the shim that an init container copied in."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mpsd.units import parse_duration, parse_limits, parse_percentage
from tests.deploy.conftest import assert_flags_known, config_text, one, rendered

NAME = "deploy/sidecar"


def spec() -> dict[str, Any]:
    return one(rendered(NAME), "Deployment", "inference-mps")["spec"]["template"]["spec"]


def containers() -> dict[str, dict[str, Any]]:
    s = spec()
    return {c["name"]: c for c in s["initContainers"] + s["containers"]}


def config() -> dict[str, Any]:
    return yaml.safe_load(config_text(rendered(NAME), "mpsd-sidecar-config"))


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def mounts(container: dict[str, Any]) -> dict[str, str]:
    """mountPath → volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volume(name: str) -> dict[str, Any]:
    return next(v for v in spec()["volumes"] if v["name"] == name)


def test_pod_shares_one_pid_namespace_and_nothing_of_the_host() -> None:
    s = spec()
    assert s["shareProcessNamespace"] is True
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        assert not s.get(key, False), key
    assert not [v for v in s["volumes"] if "hostPath" in v]


def test_every_volume_mount_names_a_volume() -> None:
    names = {v["name"] for v in spec()["volumes"]}
    for c in containers().values():
        for m in c.get("volumeMounts", []):
            assert m["name"] in names, (c["name"], m)


def test_mpsd_is_a_native_sidecar_started_after_the_shim_is_installed() -> None:
    init = [c["name"] for c in spec()["initContainers"]]
    assert init == ["install-shim", "mpsd"]
    sidecar = containers()["mpsd"]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert_flags_known(sidecar["args"])


def test_daemon_only() -> None:
    cfg = config()
    assert cfg["devicePlugin"] == {"enabled": False}


def test_pipe_dir_and_dev_shm_are_shared_by_daemon_and_app() -> None:
    cfg = config()
    sidecar, app = containers()["mpsd"], containers()["app"]
    pipe = cfg["pipeDir"]
    assert mounts(sidecar)[pipe] == mounts(app)[pipe]
    assert "emptyDir" in volume(mounts(app)[pipe])
    assert env(app)["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert mounts(sidecar)["/dev/shm"] == mounts(app)["/dev/shm"]
    assert volume(mounts(app)["/dev/shm"])["emptyDir"]["medium"] == "Memory"
    # Not the path the NVIDIA runtime may bind-mount from the host.
    assert pipe != "/tmp/nvidia-mps"
    # The app only connects to the daemon's sockets: read-only, so it cannot plant its own
    # (tests/daemon/test_pipe_dir_readonly.py shows a client needs no more).
    app_pipe = next(m for m in app["volumeMounts"] if m["mountPath"] == pipe)
    assert app_pipe.get("readOnly") is True


def test_app_environment_is_a_valid_slice() -> None:
    app_env = env(containers()["app"])
    assert parse_limits(app_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
    assert 0 < parse_percentage(app_env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) <= 100


def test_shim_is_preloaded_from_the_volume_the_init_container_fills() -> None:
    app, installer = containers()["app"], containers()["install-shim"]
    preload = env(app)["LD_PRELOAD"]
    shim_dir = os.path.dirname(preload)
    assert mounts(app)[shim_dir] == mounts(installer)[shim_dir]
    assert shim_dir in installer["command"][-1] and preload in installer["command"][-1]
    region = env(app)["MPSSHIM_REGION"]
    region_volume = mounts(app)[os.path.dirname(region)]
    # The region is the app container's own (not /dev/shm, not shared with the sidecar).
    assert region_volume not in mounts(containers()["mpsd"]).values()
    assert not region.startswith("/dev/shm")


def test_install_shim_command_copies_the_library(tmp_path: Path, shim_lib: Path) -> None:
    installer = containers()["install-shim"]
    target_dir = os.path.dirname(env(containers()["app"])["LD_PRELOAD"])
    command = [sys.executable if installer["command"][0] == "python" else installer["command"][0],
               *[arg.replace(target_dir, str(tmp_path)) for arg in installer["command"][1:]]]
    from shim import LIBRARY_ENV
    proc = subprocess.run(command, env={**os.environ, LIBRARY_ENV: str(shim_lib)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    copied = tmp_path / os.path.basename(env(containers()["app"])["LD_PRELOAD"])
    assert copied.read_bytes() == shim_lib.read_bytes()


def test_only_the_sidecar_holds_the_gpu() -> None:
    holders = [n for n, c in containers().items() if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
    assert holders == ["mpsd"]


def test_probes_use_the_metrics_port_and_grace_exceeds_shutdown() -> None:
    cfg = config()
    sidecar = containers()["mpsd"]
    port = int(cfg["metricsAddress"].rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    for probe, path in (("startupProbe", "/readyz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = sidecar[probe]["httpGet"]
        assert (get["path"], ports[get["port"]]) == (path, port)
    assert spec()["terminationGracePeriodSeconds"] > parse_duration(cfg["shutdownTimeout"]) + 5


def test_config_loads_with_mpsd_config() -> None:
    pytest.importorskip("mpsd.config", reason="mpsd.config not importable")
    from mpsd.config import load
    cfg = load(str(Path(__file__).resolve().parents[2] / NAME / "config.yaml"), {}, {})
    assert cfg.device_plugin.enabled is False
    assert cfg.pipe_dir == config()["pipeDir"]
