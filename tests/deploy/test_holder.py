"""The MPS daemon holder (DaemonSet mpsd-holder: deploy/components/holder, the chart's
holder.yaml) against the mpsd DaemonSet of the same install, in every Kustomize node install
and every chart profile.

The holder runs the daemon that mpsd adopts (daemonLifecycle: independent), so it must see
what the daemon needs exactly as mpsd does (config, pipe and log dirs, /dev/shm, PID
namespace, GPUs) and nothing else (no kubelet sockets, no state, no token, no ports). It is
replaced only on deletion; mpsd rolls: maxUnavailable 1 with the device plugin, and with the
DRA driver maxSurge 1 / maxUnavailable 0, so that old and new plugin instances overlap.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import KUSTOMIZATIONS, PROFILES, config_text, helm_template, one, rendered

INSTALLS = [f"kustomize:{k}" for k in [*KUSTOMIZATIONS, "deploy/overlays/dra"]] + [f"helm:{p}" for p in sorted(PROFILES)]


def objects_of(install: str) -> list[dict[str, Any]]:
    kind, _, name = install.partition(":")
    return rendered(name) if kind == "kustomize" else helm_template(name)


def pod(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return one(objects, "DaemonSet", name)["spec"]["template"]["spec"]


def host_mounts(spec: dict[str, Any]) -> dict[str, str]:
    """mountPath -> host path of the first container's hostPath mounts."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
            for m in spec["containers"][0]["volumeMounts"] if "hostPath" in volumes[m["name"]]}


@pytest.fixture(params=INSTALLS)
def install(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return objects_of(request.param)


def holder_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    cfg = yaml.safe_load(config_text(objects))
    holders = [o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "mpsd-holder"]
    if cfg["daemonLifecycle"] == "owned":
        assert holders == []  # mpsd owns the daemon: a holder's daemon would lock it out
        pytest.skip("daemonLifecycle owned: no holder")
    assert cfg["daemonLifecycle"] == "independent"
    (holder,) = holders
    return holder


def test_every_install_but_the_owned_profile_has_a_holder() -> None:
    owned = [i for i in INSTALLS if yaml.safe_load(config_text(objects_of(i)))["daemonLifecycle"] == "owned"]
    assert owned == ["helm:owned"]


def test_the_holder_is_replaced_only_on_deletion(install: list[dict[str, Any]]) -> None:
    assert holder_of(install)["spec"]["updateStrategy"] == {"type": "OnDelete"}


def test_mpsd_rolls_with_overlap_in_dra_mode_and_one_node_at_a_time_otherwise(install: list[dict[str, Any]]) -> None:
    cfg = yaml.safe_load(config_text(install))
    strategy = one(install, "DaemonSet", "mpsd")["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    if cfg.get("dra", {}).get("enabled") and cfg["daemonLifecycle"] == "independent":
        assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    else:
        assert strategy["rollingUpdate"] == {"maxUnavailable": 1}


def test_the_holder_runs_mpsd_holder_with_mpsds_config(install: list[dict[str, Any]]) -> None:
    holder = holder_of(install)["spec"]["template"]["spec"]
    mpsd = pod(install, "mpsd")
    (container,) = holder["containers"]
    assert container["args"][:1] == ["holder"]
    assert container["args"][1:] == mpsd["containers"][0]["args"][1:]  # the same --config path
    assert container["image"] == mpsd["containers"][0]["image"]
    config_volume = {v["name"]: v for v in holder["volumes"]}["config"]
    assert config_volume == {v["name"]: v for v in mpsd["volumes"]}["config"]
    assert container["env"] == mpsd["containers"][0]["env"][:2]  # NVIDIA_VISIBLE_DEVICES, _CAPABILITIES


def test_the_holder_shares_the_daemons_host_paths_and_ipc_with_mpsd(install: list[dict[str, Any]]) -> None:
    holder, mpsd = holder_of(install)["spec"]["template"]["spec"], pod(install, "mpsd")
    cfg = yaml.safe_load(config_text(install))
    ours, theirs = host_mounts(holder), host_mounts(mpsd)
    for path in (cfg["pipeDir"], cfg["logDir"]):
        assert ours[path] == theirs[path] == path
    locks = f"{cfg['stateDir'].rstrip('/')}/locks"  # mpsd's locks, the holder's included (mpsd/daemon/dirs.py)
    assert ours[locks] == locks and theirs[cfg["stateDir"]] == cfg["stateDir"]
    assert holder["hostPID"] is mpsd["hostPID"] is True
    assert holder.get("hostIPC", False) is mpsd.get("hostIPC", False)
    assert ours.get("/dev/shm") == theirs.get("/dev/shm")
    if cfg["devicePlugin"]["ipcMode"] == "tmpfs":
        assert ours["/dev/shm"] == cfg["devicePlugin"]["shmDir"]
        # the holder may start first: it mounts shmDir's tmpfs with mpsd's very init container
        (init,) = holder["initContainers"]
        assert init == {c["name"]: c for c in mpsd["initContainers"]}["shm-tmpfs"]
    else:
        assert holder["hostIPC"] is True and "initContainers" not in holder
    assert holder["affinity"] == mpsd["affinity"] and holder["tolerations"] == mpsd["tolerations"]
    assert holder["priorityClassName"] == mpsd["priorityClassName"]


def test_the_holder_gets_only_what_the_daemon_needs(install: list[dict[str, Any]]) -> None:
    holder, mpsd = holder_of(install)["spec"]["template"]["spec"], pod(install, "mpsd")
    cfg = yaml.safe_load(config_text(install))
    (container,) = holder["containers"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    shm = {"/dev/shm"} if cfg["devicePlugin"]["ipcMode"] == "tmpfs" else set()
    locks = f"{cfg['stateDir'].rstrip('/')}/locks"
    assert mounts == {"/etc/mpsd", cfg["pipeDir"], cfg["logDir"], locks} | shm  # no kubelet, CDI or other state
    assert not {"ports", "livenessProbe", "readinessProbe", "startupProbe"} & set(container)
    ctx, theirs = container["securityContext"], mpsd["containers"][0]["securityContext"]
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert set(ctx["capabilities"]["add"]) <= set(theirs["capabilities"]["add"]) - {"SYS_ADMIN"}
    assert "memory" in container["resources"]["limits"] and "cpu" not in container["resources"]["limits"]
    # no API server: an account of its own with no token and no binding
    assert holder["automountServiceAccountToken"] is False
    account = one(install, "ServiceAccount", holder["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False and holder["serviceAccountName"] != "mpsd"
    for binding in (o for o in install if o["kind"] in {"RoleBinding", "ClusterRoleBinding"}):
        assert account["metadata"]["name"] not in {s["name"] for s in binding["subjects"]}


def test_the_metrics_service_does_not_select_the_holder(install: list[dict[str, Any]]) -> None:
    labels = holder_of(install)["spec"]["template"]["metadata"]["labels"]
    selector = one(install, "Service", "mpsd-metrics")["spec"]["selector"]
    assert not selector.items() <= labels.items()
    holder_selector = holder_of(install)["spec"]["selector"]["matchLabels"]
    assert not holder_selector.items() <= pod_labels(install, "mpsd").items()  # neither adopts the other's pods


def pod_labels(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    return one(objects, "DaemonSet", name)["spec"]["template"]["metadata"]["labels"]


def test_holder_flags_are_flags_of_mpsd_holder() -> None:
    import importlib.util
    if importlib.util.find_spec("mpsd.cli") is None:
        pytest.skip("mpsd.cli not present")
    proc = subprocess.run([sys.executable, "-c", "import sys; from mpsd.cli import main; sys.exit(main())",
                           "holder", "--help"], capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0 and "invalid choice: 'holder'" in proc.stderr:
        pytest.skip("this mpsd has no `holder` subcommand yet (it comes with the daemon holder)")
    assert proc.returncode == 0, proc.stderr
    args = holder_of(rendered("deploy"))["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag in [a for a in args if a.startswith("--")]:
        assert flag in proc.stdout, f"{flag} not in `mpsd holder --help`"
