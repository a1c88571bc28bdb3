"""Invariants between the node DaemonSet, its ConfigMap and the mpsd configuration contract."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import (
    KUSTOMIZATIONS,
    REPO,
    assert_flags_known,
    config_key_known,
    config_text,
    loadable,
    one,
    rendered,
)

try:
    from mpsd import config as mpsd_config
except ImportError as exc:  # B1's module; the tests that need it say so when it is absent
    mpsd_config = None
    CONFIG_MISSING = f"mpsd.config not importable: {exc}"
else:
    CONFIG_MISSING = ""

# Config keys naming host paths the node daemon must see at the same path. shmDir is apart:
# in tmpfs mode it is the daemon's /dev/shm (the contract mounts it at /dev/shm in pods too).
HOST_PATH_KEYS = ["pipeDir", "logDir", "stateDir"]
PLUGIN_PATH_KEYS = ["kubeletDir", "regionDir", "shimHostDir"]


def pod_spec(name: str) -> dict[str, Any]:
    return one(rendered(name), "DaemonSet", "mpsd")["spec"]["template"]["spec"]


def main_container(spec: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in spec["containers"] if c["name"] == "mpsd")


def raw_config(name: str) -> dict[str, Any]:
    return yaml.safe_load(config_text(rendered(name)))


def host_path_mounts(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """mountPath → host path, for the container's hostPath mounts."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
            for m in container["volumeMounts"] if "hostPath" in volumes[m["name"]]}


def config_host_paths(cfg: dict[str, Any]) -> dict[str, str]:
    plugin = cfg["devicePlugin"]
    paths = {k: cfg[k] for k in HOST_PATH_KEYS}
    paths.update({k: plugin[k] for k in PLUGIN_PATH_KEYS})
    paths["podResourcesSocket (dir)"] = os.path.dirname(plugin["podResourcesSocket"])
    return paths


def test_every_volume_mount_names_a_volume(node_kustomization: str) -> None:
    spec = pod_spec(node_kustomization)
    names = {v["name"] for v in spec["volumes"]}
    for container in spec["containers"] + spec.get("initContainers", []):
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in names, (container["name"], mount)


def test_the_config_spells_out_every_host_path(node_kustomization: str) -> None:
    # The manifests are checked against these values, so none may come from a default.
    cfg = raw_config(node_kustomization)
    for k in HOST_PATH_KEYS + ["metricsAddress", "shutdownTimeout"]:
        assert k in cfg, k
    for k in PLUGIN_PATH_KEYS + ["podResourcesSocket", "resourceName", "ipcMode", "shmDir", "enabled"]:
        assert k in cfg["devicePlugin"], k


def test_every_host_path_of_the_config_is_mounted_at_the_same_path(node_kustomization: str) -> None:
    spec = pod_spec(node_kustomization)
    mounts = host_path_mounts(spec, main_container(spec))
    same = {path for mount_path, path in mounts.items() if mount_path == path}
    for key, path in config_host_paths(raw_config(node_kustomization)).items():
        covering = [m for m in same if path == m or path.startswith(m.rstrip("/") + "/")]
        assert covering, f"{key}={path} is not inside any hostPath mounted at its own path: {sorted(same)}"


@pytest.mark.parametrize("name, ipc_mode", sorted(KUSTOMIZATIONS.items()))
def test_ipc_mode_matches_the_pod(name: str, ipc_mode: str) -> None:
    cfg = raw_config(name)
    spec = pod_spec(name)
    mounts = host_path_mounts(spec, main_container(spec))
    assert cfg["devicePlugin"]["ipcMode"] == ipc_mode
    if ipc_mode == "hostIPC":
        assert spec["hostIPC"] is True
        assert "/dev/shm" not in mounts
    else:
        assert spec.get("hostIPC", False) is False
        shm_dir = cfg["devicePlugin"]["shmDir"]
        assert mounts["/dev/shm"] == shm_dir
        assert_shm_dir_is_a_bounded_tmpfs(spec, cfg)


def assert_shm_dir_is_a_bounded_tmpfs(spec: dict[str, Any], cfg: dict[str, Any]) -> None:
    """shmDir is every GPU pod's /dev/shm: a size-limited tmpfs of its own (mode 1777), mounted by
    an init container before mpsd starts, where the mount reaches the host (as regionDir's)."""
    shm_dir, state_dir = cfg["devicePlugin"]["shmDir"], cfg["stateDir"]
    init = {c["name"]: c for c in spec["initContainers"]}["shm-tmpfs"]
    command = init["command"]
    assert command[:4] == ["python", "-m", "mpsd.plugin.regionfs", shm_dir], command
    from mpsd.plugin import regionfs
    assert regionfs.parse_size(command[4]) > 0
    assert command[5:] == ["--inodes", command[6], "--mode", "1777", "--label", "shmDir"] and int(command[6]) > 0
    # mounted inside stateDir's volume, propagated to the host (only a privileged container may)
    assert shm_dir.startswith(state_dir.rstrip("/") + "/")
    (mount,) = [m for m in init["volumeMounts"] if m["mountPath"] == state_dir]
    assert mount["mountPropagation"] == "Bidirectional" and init["securityContext"]["privileged"] is True
    # and mpsd, started after it, sees the tmpfs (HostToContainer) as its /dev/shm
    volumes = {v["name"]: v for v in spec["volumes"]}
    (shm,) = [m for m in main_container(spec)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["hostPath"]["path"] == shm_dir


def test_configs_of_the_two_ipc_modes_differ_only_in_ipc() -> None:
    base, tmpfs = raw_config("deploy"), raw_config("deploy/overlays/tmpfs")
    for cfg in (base, tmpfs):
        cfg["devicePlugin"].pop("ipcMode")
        cfg["devicePlugin"].pop("shmDir")
    assert base == tmpfs


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_probes_hit_healthz_and_readyz_on_the_metrics_port(node_kustomization: str) -> None:
    cfg = raw_config(node_kustomization)
    metrics_port = int(cfg["metricsAddress"].rpartition(":")[2])
    container = main_container(pod_spec(node_kustomization))
    live, ready = container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"]
    assert (live["path"], resolve_port(container, live["port"])) == ("/healthz", metrics_port)
    assert (ready["path"], resolve_port(container, ready["port"])) == ("/readyz", metrics_port)
    svc = one(rendered(node_kustomization), "Service", "mpsd-metrics")
    (port,) = svc["spec"]["ports"]
    assert resolve_port(container, port["targetPort"]) == metrics_port
    assert svc["spec"]["selector"].items() <= pod_labels(node_kustomization).items()


def pod_labels(name: str) -> dict[str, str]:
    return one(rendered(name), "DaemonSet", "mpsd")["spec"]["template"]["metadata"]["labels"]


def test_runs_mpsd_with_the_mounted_config(node_kustomization: str) -> None:
    spec = pod_spec(node_kustomization)
    container = main_container(spec)
    args = container["args"]
    assert args[0] == "run"
    config_path = args[args.index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == os.path.dirname(config_path))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    configmap = one(rendered(node_kustomization), "ConfigMap", volume["configMap"]["name"])
    assert os.path.basename(config_path) in configmap["data"]


def test_container_args_are_flags_of_mpsd_run() -> None:
    assert_flags_known(main_container(pod_spec("deploy"))["args"])


def test_grace_period_exceeds_the_shutdown_timeout(node_kustomization: str) -> None:
    from mpsd.units import parse_duration
    cfg = raw_config(node_kustomization)
    grace = pod_spec(node_kustomization)["terminationGracePeriodSeconds"]
    assert grace > parse_duration(cfg["shutdownTimeout"]) + 5


@pytest.mark.skipif(mpsd_config is None, reason=CONFIG_MISSING or "-")
def test_configmap_loads_with_mpsd_config(node_kustomization: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(loadable(config_text(rendered(node_kustomization))))
    cfg = mpsd_config.load(str(path), {}, {})
    raw = raw_config(node_kustomization)
    if config_key_known("daemonLifecycle"):
        assert cfg.daemon_lifecycle == raw["daemonLifecycle"]
    plugin = cfg.device_plugin
    assert (cfg.pipe_dir, cfg.log_dir, cfg.state_dir) == (raw["pipeDir"], raw["logDir"], raw["stateDir"])
    assert (plugin.kubelet_dir, plugin.region_dir, plugin.shim_host_dir, plugin.shm_dir, plugin.ipc_mode) == (
        raw["devicePlugin"]["kubeletDir"], raw["devicePlugin"]["regionDir"],
        raw["devicePlugin"]["shimHostDir"], raw["devicePlugin"]["shmDir"], raw["devicePlugin"]["ipcMode"])
    assert plugin.enabled is True
    assert cfg.metrics_address == raw["metricsAddress"]


def test_namespaced_objects_live_in_mpsd_system(node_kustomization: str) -> None:
    for obj in rendered(node_kustomization):
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "mpsd-system", obj["metadata"]


def test_service_account_exists_and_no_rbac_is_granted(node_kustomization: str) -> None:
    objects = rendered(node_kustomization)
    spec = pod_spec(node_kustomization)
    one(objects, "ServiceAccount", spec["serviceAccountName"])
    assert spec["automountServiceAccountToken"] is False
    assert not [o for o in objects if o["kind"] in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}]


REGION_TMPFS = "region-tmpfs"  # the one init container that mounts regionDir's tmpfs (privileged)


def region_tmpfs(spec: dict[str, Any]) -> dict[str, Any]:
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] == REGION_TMPFS]
    return init


def test_region_dir_gets_a_size_limited_tmpfs_that_reaches_the_host(node_kustomization: str) -> None:
    # What pods write in their allocation directories (0777) is bounded by a tmpfs at regionDir,
    # mounted before mpsd starts, apart from the node's disk and from stateDir's state file.
    spec = pod_spec(node_kustomization)
    cfg = raw_config(node_kustomization)
    init = region_tmpfs(spec)
    assert spec["initContainers"][0]["name"] == REGION_TMPFS  # before anything else runs
    command = init["command"]
    assert command[:3] == ["python", "-m", "mpsd.plugin.regionfs"]
    path, size = command[3], command[4]
    assert path == cfg["devicePlugin"]["regionDir"]
    from mpsd.plugin.regionfs import parse_size

    assert 16 << 20 <= parse_size(size) <= 1 << 30
    assert "--inodes" in command
    # the mount is made inside a hostPath mounted Bidirectional, so the host (where the
    # container runtime bind-mounts each pod's directory) sees it; mpsd sees it too
    volumes = {v["name"]: v for v in spec["volumes"]}
    (carrier,) = [m for m in init["volumeMounts"] if m.get("mountPropagation") == "Bidirectional"]
    assert path.startswith(carrier["mountPath"].rstrip("/") + "/")
    assert volumes[carrier["name"]]["hostPath"]["path"] == carrier["mountPath"]
    seen = [m for m in main_container(spec)["volumeMounts"] if m["name"] == carrier["name"]]
    assert seen and seen[0]["mountPropagation"] == "HostToContainer"
    # the state file is in stateDir, outside regionDir (the plugin refuses it inside)
    state_dir = cfg["stateDir"].rstrip("/") + "/"
    assert not state_dir.startswith(path.rstrip("/") + "/")


REGIONFS = ["python", "-m", "mpsd.plugin.regionfs"]


def test_least_privilege(node_kustomization: str) -> None:
    spec = pod_spec(node_kustomization)
    # privileged only to mount one tmpfs each (mount(2), and Bidirectional propagation needs it):
    # regionDir's, and in tmpfs mode shmDir's; each runs one command and exits before mpsd starts
    mounters = [c for c in spec.get("initContainers", []) if c["command"][:3] == REGIONFS]
    assert region_tmpfs(spec) in mounters
    for init in mounters:
        assert init["securityContext"] == {"privileged": True, "runAsUser": 0}
        assert [m["name"] for m in init["volumeMounts"]] == ["state-dir"]
        assert "memory" in init["resources"]["limits"]
    for container in spec["containers"] + spec.get("initContainers", []):
        if container in mounters:
            continue
        ctx = container["securityContext"]
        assert ctx.get("privileged", False) is False, container["name"]
        assert ctx["allowPrivilegeEscalation"] is False, container["name"]
        assert ctx["capabilities"]["drop"] == ["ALL"], container["name"]
        assert "requests" in container["resources"] and "memory" in container["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in main_container(spec)["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert set(env["NVIDIA_DRIVER_CAPABILITIES"].split(",")) == {"compute", "utility"}
    assert spec["hostPID"] is True


# --- comments: every privilege is explained where it is granted --------------------------

PRIVILEGED_KEY = re.compile(r"^\s*-?\s*(hostPID|hostIPC|privileged|capabilities|runAsUser|seLinuxOptions)\s*:"
                            r"|^\s*path:\s*\S*/(hostPID|hostIPC|privileged|capabilities|seLinuxOptions)\b")
YAML_FILES = sorted([*(REPO / "deploy").rglob("*.yaml"), *(REPO / "examples").rglob("*.yaml")])


def unexplained_privileges(text: str) -> list[str]:
    """Lines granting a privilege with no comment on the line or directly above it."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if PRIVILEGED_KEY.search(line) and "#" not in line:
            above = lines[i - 1].strip() if i else ""
            if not above.startswith("#"):
                bad.append(f"{i + 1}: {line.strip()}")
    return bad


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_privilege_has_an_adjacent_comment(path: Path) -> None:
    assert unexplained_privileges(path.read_text()) == []


@pytest.mark.parametrize("text, bad", [
    ("spec:\n  hostPID: true\n", ["2: hostPID: true"]),
    ("spec:\n  # one PID namespace\n  hostPID: true\n", []),
    ("spec:\n  hostIPC: true  # shares /dev/shm\n", []),
    ("- op: replace\n  path: /spec/template/spec/hostIPC\n", ["2: path: /spec/template/spec/hostIPC"]),
    ("ctx:\n  privileged: false\n  # why\n  capabilities: {}\n", ["2: privileged: false"]),
    ("- op: add\n  path: /spec/x/securityContext/seLinuxOptions\n", ["2: path: /spec/x/securityContext/seLinuxOptions"]),
])
def test_comment_check(text: str, bad: list[str]) -> None:
    assert unexplained_privileges(text) == bad


def test_each_added_capability_is_justified_in_the_comment_above_it() -> None:
    text = (REPO / "deploy/base/daemonset.yaml").read_text()
    ctx = main_container(pod_spec("deploy"))["securityContext"]
    block = text[:text.index("            capabilities:")]
    comment = block[block.rindex("allowPrivilegeEscalation"):]
    for cap in ctx["capabilities"]["add"]:
        assert re.search(rf"#\s+.*\b{cap}\b", comment), cap


def test_the_pipe_dir_is_not_the_one_the_nvidia_runtime_mounts_read_write(node_kustomization: str) -> None:
    # libnvidia-container mounts the host's /tmp/nvidia-mps (MPS's default) into every GPU
    # container read-write (src/nvc_mount.c, mount_ipc: MS_NODEV|MS_NOSUID|MS_NOEXEC, no
    # MS_RDONLY), after the kubelet's mounts: over the device plugin's read-only pipe dir.
    # A private pipe dir is mounted into pods only by Allocate, read-only.
    assert raw_config(node_kustomization)["pipeDir"] != "/tmp/nvidia-mps"
