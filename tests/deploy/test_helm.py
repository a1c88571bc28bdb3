"""The Helm chart (deploy/helm/mpsd) under the real `helm` 4.3.1 (from the PyPI wheel, see
tests/kubetools.py): `helm lint --strict`, every values profile rendered and validated strictly
against the newest Kubernetes schema kubernetes-validate knows, and the same objects as the
Kustomize tree for the same settings.

Chart and Kustomize are compared object by object after normalising only:
- Helm's own labels in ``metadata.labels`` (helm.sh/chart, app.kubernetes.io/managed-by,
  app.kubernetes.io/instance, app.kubernetes.io/version): Helm adds them to every object it
  owns; selectors and pod template labels are not normalised (they carry none of them);
- mpsd-config's ``config.yaml``, compared as the YAML it parses to: the Kustomize file carries
  comments, the chart writes the merged settings with toYaml;
- the Namespace: rendered by the chart only with ``namespace.create=true``, which the
  comparison sets (Helm usually leaves the release namespace to ``--create-namespace``);
- Helm's own machinery, in ``metadata.annotations``: helm.sh/resource-policy (the holder kept on
  uninstall) and mpsd.io/node-settings (the upgrade check of templates/checks.yaml); and the pod
  template's checksum/config (a config-only upgrade rolls mpsd; the Kustomize tree applies the
  ConfigMap and leaves the roll to ``kubectl rollout restart``).
"""
from __future__ import annotations

import copy
import difflib
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import (
    CHART,
    NAMESPACE,
    PROFILES,
    RELEASE,
    REPO,
    config_key_known,
    config_text,
    helm,
    helm_template,
    key,
    loadable,
    one,
    rendered,
)

K8S_VERSION = kubernetes_validate.latest_version()
NO_SCHEMA = {"monitoring.coreos.com/v1"}  # CRDs: test_render.py checks the ServiceMonitor's shape
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version"}
HELM_ANNOTATIONS = {"helm.sh/resource-policy", "mpsd.io/node-settings"}
POD_ANNOTATIONS = {"checksum/config"}
COMPARED = sorted((p, k) for p, k in PROFILES.items() if k)


def normalised(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for obj in copy.deepcopy(objects):
        labels = obj["metadata"].get("labels", {})
        for label in HELM_LABELS & set(labels):
            del labels[label]
        dropped(obj["metadata"], HELM_ANNOTATIONS)
        if "template" in obj.get("spec", {}):
            dropped(obj["spec"]["template"]["metadata"], POD_ANNOTATIONS)
        if obj["kind"] == "ConfigMap" and "config.yaml" in obj.get("data", {}):
            obj["data"]["config.yaml"] = yaml.safe_load(obj["data"]["config.yaml"])
        out[key(obj)] = obj
    return out


def dropped(meta: dict[str, Any], names: set[str]) -> None:
    annotations = meta.get("annotations", {})
    for name in names & set(annotations):
        del annotations[name]
    if "annotations" in meta and not annotations:
        del meta["annotations"]


def differences(chart: list[dict[str, Any]], kustomized: list[dict[str, Any]]) -> list[str]:
    ours, theirs = normalised(chart), normalised(kustomized)
    found = [f"only in the chart: {k}" for k in sorted(set(ours) - set(theirs))]
    found += [f"only in Kustomize: {k}" for k in sorted(set(theirs) - set(ours))]
    for k in sorted(set(ours) & set(theirs)):
        if ours[k] != theirs[k]:
            diff = difflib.unified_diff(yaml.safe_dump(theirs[k]).splitlines(), yaml.safe_dump(ours[k]).splitlines(),
                                        "kustomize", "helm", lineterm="", n=1)
            found.append(f"{k}:\n" + "\n".join(diff))
    return found


def test_every_profile_is_mapped() -> None:
    assert sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml")) == sorted(PROFILES)


@pytest.mark.parametrize("profile", [None, *sorted(PROFILES)])
def test_helm_lint_strict(profile: str | None) -> None:
    # in the namespace: lint does not fail on the chart's refusal of `default`, it skips past it
    args = ["lint", "--strict", CHART, "--namespace", NAMESPACE] + (["-f", CHART / "ci" / f"{profile}-values.yaml"] if profile else [])
    proc = helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_object_of_every_profile_passes_the_schema(profile: str) -> None:
    objects = helm_template(profile)
    assert {"DaemonSet", "ConfigMap", "ServiceAccount", "Service"} <= {o["kind"] for o in objects}
    for obj in objects:
        if obj["apiVersion"] not in NO_SCHEMA:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding", "DeviceClass", "Namespace",
                               "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}:
            assert obj["metadata"]["namespace"] == NAMESPACE, key(obj)


@pytest.mark.parametrize("profile, kustomization", COMPARED)
def test_the_chart_renders_what_kustomize_renders(profile: str, kustomization: str) -> None:
    assert differences(helm_template(profile, "namespace.create=true"), rendered(kustomization)) == []


def test_the_comparison_sees_a_difference() -> None:
    # A changed value, a missing object and a Helm label where Kustomize has none all show.
    changed = helm_template("hostipc", "namespace.create=true", "resources.limits.memory=3Gi")
    found = differences(changed, rendered("deploy"))
    assert len(found) == 1 and found[0].startswith("('DaemonSet', 'mpsd-system', 'mpsd')") and "3Gi" in found[0]
    assert differences(helm_template("hostipc"), rendered("deploy")) == ["only in Kustomize: ('Namespace', '', 'mpsd-system')"]
    labelled = copy.deepcopy(helm_template("hostipc", "namespace.create=true"))
    one(labelled, "Service")["spec"]["selector"]["app.kubernetes.io/instance"] = "mpsd"
    assert len(differences(labelled, rendered("deploy"))) == 1


def test_the_packaged_chart_renders_the_same(tmp_path: Path) -> None:
    # A chart installed from its archive needs no checkout.
    helm("package", CHART, "--destination", tmp_path)
    (archive,) = tmp_path.glob("mpsd-*.tgz")
    for profile in ("monitoring", "dra"):
        assert helm_template(profile, chart=archive) == helm_template(profile)


def test_the_monitoring_objects_are_deploys_files() -> None:
    objects = helm_template("monitoring")
    rules = yaml.safe_load((REPO / "deploy/components/alerts/mpsd.rules.yml").read_text())
    assert one(objects, "PrometheusRule", "mpsd")["spec"] == rules
    dashboard = (REPO / "deploy/components/grafana-dashboard/mpsd-dashboard.json").read_text()
    assert one(objects, "ConfigMap", "mpsd-grafana-dashboard")["data"]["mpsd-dashboard.json"] == dashboard
    # files/ holds copies, checked against deploy/'s: tests/deploy/test_chart_values.py


def test_monitoring_values_reach_the_objects() -> None:
    objects = helm_template("monitoring", "monitoring.serviceMonitor.labels.release=kps",
                            "monitoring.prometheusRule.labels.release=kps", "monitoring.grafanaDashboard.namespace=grafana")
    assert one(objects, "ServiceMonitor")["metadata"]["labels"]["release"] == "kps"
    assert one(objects, "PrometheusRule")["metadata"]["labels"]["release"] == "kps"
    assert one(objects, "ConfigMap", "mpsd-grafana-dashboard")["metadata"]["namespace"] == "grafana"
    assert not [o for o in helm_template(None) if o["apiVersion"] in NO_SCHEMA]  # off by default


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_the_rendered_config_loads_with_mpsd_config(profile: str, tmp_path: Path) -> None:
    from mpsd import config as mpsd_config

    path = tmp_path / "config.yaml"
    path.write_text(loadable(config_text(helm_template(profile))))
    cfg = mpsd_config.load(str(path), {}, {})
    values = yaml.safe_load((CHART / "ci" / f"{profile}-values.yaml").read_text())
    assert cfg.device_plugin.ipc_mode == values.get("ipcMode", "hostIPC")
    assert cfg.device_plugin.enabled is (values.get("mode", "devicePlugin") == "devicePlugin")
    holder = values.get("holder", {}).get("enabled", True)
    if config_key_known("daemonLifecycle"):
        assert cfg.daemon_lifecycle == ("independent" if holder else "owned")


def test_config_values_are_merged_and_mounted() -> None:
    objects = helm_template("tmpfs", "config.pipeDir=/run/other-pipe", "config.devicePlugin.slicesPerGpu=4")
    cfg = yaml.safe_load(config_text(objects))
    assert (cfg["pipeDir"], cfg["devicePlugin"]["slicesPerGpu"], cfg["healthInterval"]) == ("/run/other-pipe", 4, "5s")
    for name in ("mpsd", "mpsd-holder"):
        spec = one(objects, "DaemonSet", name)["spec"]["template"]["spec"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "pipe-dir"]
        assert volume["hostPath"]["path"] == "/run/other-pipe"
        assert {"name": "pipe-dir", "mountPath": "/run/other-pipe"} in spec["containers"][0]["volumeMounts"]


def test_exclusive_process_adds_sys_admin_to_mpsd_only() -> None:
    objects = helm_template(None, "config.exclusiveProcess=true")
    caps = {n: one(objects, "DaemonSet", n)["spec"]["template"]["spec"]["containers"][0]["securityContext"]
            ["capabilities"]["add"] for n in ("mpsd", "mpsd-holder")}
    assert "SYS_ADMIN" in caps["mpsd"] and "SYS_ADMIN" not in caps["mpsd-holder"]


@pytest.mark.parametrize("profile", ["hostipc", "dra", "owned"])
def test_mig_privileged_gives_mpsd_only_the_mig_monitor_and_sys_admin(profile: str) -> None:
    # As deploy/components/mig: the env var and SYS_ADMIN on mpsd (never the holder), once with
    # exclusiveProcess too; nothing of it by default.
    def mpsd_and_holder(*sets: str) -> list[dict[str, Any]]:
        daemonsets = sorted((o for o in helm_template(profile, *sets) if o["kind"] == "DaemonSet"),
                            key=lambda o: o["metadata"]["name"] != "mpsd")
        return [o["spec"]["template"]["spec"]["containers"][0] for o in daemonsets]

    for sets in (["mig.privileged=true"], ["mig.privileged=true", "config.exclusiveProcess=true"]):
        mpsd, *holder = mpsd_and_holder(*sets)
        assert {"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"} in mpsd["env"]
        assert mpsd["securityContext"]["capabilities"]["add"].count("SYS_ADMIN") == 1
        for c in holder:
            assert "SYS_ADMIN" not in c["securityContext"]["capabilities"]["add"]
            assert "NVIDIA_MIG_MONITOR_DEVICES" not in {e["name"] for e in c["env"]}
    mpsd, *_ = mpsd_and_holder()
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in {e["name"] for e in mpsd["env"]}
    assert "SYS_ADMIN" not in mpsd["securityContext"]["capabilities"]["add"]


@pytest.mark.parametrize("sets, message", [
    (["mode=deviceplugin"], "at '/mode': value must be one of 'devicePlugin', 'dra'"),
    (["ipcMode=none"], "at '/ipcMode': value must be one of 'hostIPC', 'tmpfs'"),
    (["holdr.enabled=false"], "additional properties 'holdr' not allowed"),
    (["mig.privileged=yes"], "at '/mig/privileged': got string, want boolean"),
    (["regionTmpfs.size=1Tb"], "'/regionTmpfs/size': '1Tb' does not match pattern"),
    (["config.daemonLifecycle=owned"], "config.daemonLifecycle: owned contradicts holder.enabled true"),
    (["holder.enabled=false", "config.daemonLifecycle=independent"],
     "config.daemonLifecycle: independent contradicts holder.enabled false"),
    (["config.devicePlugin.enabled=false"], "config.devicePlugin.enabled: false contradicts mode devicePlugin"),
    (["config.dra.enabled=true"], "config.dra.enabled: true contradicts mode devicePlugin"),
    (["config.devicePlugin.ipcMode=tmpfs"], "config.devicePlugin.ipcMode: tmpfs contradicts ipcMode hostIPC"),
    (["ipcMode=tmpfs", "config.devicePlugin.shmDir=/dev/shm"],
     "config.devicePlugin.shmDir: /dev/shm must be inside stateDir /var/lib/mpsd"),
    (["config.devicePlugin.regionDir=/tmp/regions"], "config.devicePlugin.regionDir: /tmp/regions must be inside"),
    (["config.metricsAddress="], 'config.metricsAddress: "": the probes and the Service need a host:port'),
])
def test_bad_values_fail_the_render_naming_the_value(sets: list[str], message: str) -> None:
    args = ["template", RELEASE, CHART, "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr



def test_chart_versions_follow_the_project() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    for profile in PROFILES:
        for obj in helm_template(profile):
            pod = obj.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                assert c["image"] == f"localhost/mpsd:{version}", (profile, c["name"])


def test_the_object_names_do_not_follow_the_release_name() -> None:
    # The alert rules expect job="mpsd-metrics" (the Service's name), the admission policy the
    # account mpsd: one mpsd per cluster whatever the release is called.
    out = helm("template", "gpu-sharing", CHART, "-f", CHART / "ci/dra-values.yaml", "--namespace", "gpus").stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    assert {o["metadata"]["name"] for o in objects} == {o["metadata"]["name"] for o in helm_template("dra")}
    policy = one(objects, "ValidatingAdmissionPolicy")["spec"]
    assert policy["matchConditions"][0]["expression"] == 'request.userInfo.username == "system:serviceaccount:gpus:mpsd"'
    assert one(objects, "ClusterRoleBinding")["subjects"][0]["namespace"] == "gpus"
