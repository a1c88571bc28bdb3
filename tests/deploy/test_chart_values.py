"""The chart's values as operators set them (issue 31): the holder's own image and a pod template
that ordinary upgrades leave alone, values refused in one line or working (nulls included), the
values every DaemonSet takes (runtimeClassName, nodeSelector, affinity, podAnnotations), the
cluster checks (.Capabilities), the runbook base, the labels and the files the chart carries.

Rendered by the real `helm` (tests/deploy/conftest.py); the upgrade guard, which needs the live
objects, is in tests/deploy/test_chart_upgrade.py."""
from __future__ import annotations

import hashlib
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import CHART, NAMESPACE, PROFILES, RELEASE, REPO, helm, helm_template, one

VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def render(*args: str | Path, chart: Path = CHART, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    out = helm("template", RELEASE, chart, "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def refusal(*args: str | Path) -> str:
    proc = helm("template", RELEASE, CHART, "--namespace", NAMESPACE, *args, check=False)
    assert proc.returncode != 0, f"helm template {args} rendered"
    return proc.stderr


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def holder_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "DaemonSet", "mpsd-holder")["spec"]


def pod_meta(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return one(objects, "DaemonSet", name)["spec"]["template"]["metadata"]


# 1. An image operators can build and set, and a README `helm show readme` prints.

def test_the_default_image_is_the_one_scripts_image_sh_builds() -> None:
    for name in ("mpsd", "mpsd-holder"):
        pod = one(helm_template(None), "DaemonSet", name)["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["image"] == f"localhost/mpsd:{VERSION}", (name, c["name"])


def test_helm_show_readme_covers_image_values_upgrade_and_uninstall() -> None:
    readme = helm("show", "readme", CHART).stdout
    for needle in ("scripts/image.sh", "image.repository", "image.tag", "holder.image.tag", "helm upgrade",
                   "helm uninstall", "helm.sh/resource-policy"):
        assert needle in readme, needle
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for top in values:
        assert f"`{top}" in readme, f"values.yaml's {top} is not in the chart README"


# 2. Nothing an ordinary upgrade changes reaches the holder's pod template.

def test_an_ordinary_upgrade_leaves_the_holders_spec_alone(tmp_path: Path) -> None:
    before = holder_spec(render())
    helm("package", CHART, "--destination", tmp_path, "--version", "9.9.9", "--app-version", "9.9.9")
    (archive,) = tmp_path.glob("mpsd-*.tgz")
    after = render(*sets("image.tag=9.9.9", "config.healthInterval=7s", "resources.limits.memory=3Gi"), chart=archive)
    assert holder_spec(after) == before
    mpsd = one(after, "DaemonSet", "mpsd")["spec"]["template"]["spec"]["containers"][0]
    assert mpsd["image"] == "localhost/mpsd:9.9.9"  # mpsd did move


def test_the_holder_has_its_own_image() -> None:
    objects = render(*sets("holder.image.repository=registry.example/mpsd", "holder.image.tag=0.0.9"),
                     "-f", CHART / "ci/tmpfs-values.yaml")
    pod = holder_spec(objects)["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {"registry.example/mpsd:0.0.9"}
    assert one(objects, "DaemonSet", "mpsd")["spec"]["template"]["spec"]["containers"][0]["image"] == \
        f"localhost/mpsd:{VERSION}"


# 3. Every value works or is refused by the schema.

@pytest.mark.parametrize("pairs, message", [
    (["holder.updateStrategy.type=RollingUpdate"], "at '/holder/updateStrategy/type'"),
    (["holder.updateStrategy=null"], "missing property 'updateStrategy'"),
    (["config=null"], "missing property 'config'"),
    (["nodeSelectorTerms=null"], "missing property 'nodeSelectorTerms'"),
    (["regionTmpfs=null"], "missing property 'regionTmpfs'"),
    (["shmTmpfs=null"], "missing property 'shmTmpfs'"),
    (["holder.image=null"], "missing property 'image'"),
    (["affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms=null"],
     "additional properties 'requiredDuringSchedulingIgnoredDuringExecution' not allowed"),
    (["runtimeClassName=Nvidia_GPU"], "at '/runtimeClassName'"),
    (["nodeSelector.gpu=true"], "at '/nodeSelector/gpu'"),  # --set makes a boolean: labels are strings
    (["config.metricsAddress=:99999"], "at '/config/metricsAddress': ':99999' does not match pattern"),
    (["config.metricsAddress=:0"], "config.metricsAddress: \":0\": port 0 is outside 1-65535"),  # mpsd's free port
    (["regionTmpfs.size=999999999999999Gi"], "regionTmpfs.size: 999999999999999Gi is over 1Ti (1024Gi)"),
    (["ipcMode=tmpfs", "shmTmpfs.size=1025G"], "shmTmpfs.size: 1025G is over 1Ti (1024Gi)"),
])
def test_bad_values_are_refused_in_one_line(pairs: list[str], message: str) -> None:
    assert message in refusal(*sets(*pairs))


def test_the_holder_notes_follow_the_strategy() -> None:
    proc = helm("install", RELEASE, CHART, "--namespace", NAMESPACE, "--dry-run=client")
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "updateStrategy OnDelete" in notes and "holder.image.tag" in notes and "resource-policy: keep" in notes


# 5. mpsd's pods carry their config's checksum; the holder's do not.

def test_a_config_change_rolls_mpsd_only() -> None:
    before, after = render(), render(*sets("config.healthInterval=7s"))
    key = "checksum/config"
    assert pod_meta(before, "mpsd")["annotations"][key] != pod_meta(after, "mpsd")["annotations"][key]
    config = one(before, "ConfigMap", "mpsd-config")["data"]["config.yaml"]
    assert pod_meta(before, "mpsd")["annotations"][key] == hashlib.sha256(config.encode()).hexdigest()
    assert key not in pod_meta(after, "mpsd-holder").get("annotations", {})


# 6. Values operators set everywhere.

@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_pod_values_reach_every_daemonset(profile: str) -> None:
    objects = render("-f", CHART / "ci" / f"{profile}-values.yaml", *sets(
        "runtimeClassName=nvidia", "nodeSelector.pool=gpu", "podAnnotations.team=infer",
        "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
        "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.topologyKey=x"))
    daemonsets = [o for o in objects if o["kind"] == "DaemonSet"]
    assert len(daemonsets) == (1 if profile == "owned" else 2)
    for ds in daemonsets:
        pod = ds["spec"]["template"]
        assert pod["spec"]["runtimeClassName"] == "nvidia"
        assert pod["spec"]["nodeSelector"] == {"pool": "gpu"}
        assert pod["metadata"]["annotations"]["team"] == "infer"
        affinity = pod["spec"]["affinity"]
        assert affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 1
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][0] == {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}


def test_nodes_are_selected_by_the_gpu_operators_label_by_default() -> None:
    for name in ("mpsd", "mpsd-holder"):
        spec = one(helm_template(None), "DaemonSet", name)["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {e["key"] for e in term["matchExpressions"]} == {"nvidia.com/gpu.present", "kubernetes.io/os"}
        assert "runtimeClassName" not in spec and "nodeSelector" not in spec


# 7. Cluster checks.

def test_dra_mode_refuses_kubernetes_older_than_1_34() -> None:
    err = refusal("-f", CHART / "ci/dra-values.yaml", "--kube-version", "1.33.5")
    assert "mode dra needs Kubernetes 1.34 or later (resource.k8s.io/v1); this cluster is v1.33.5" in err
    assert render("-f", CHART / "ci/dra-values.yaml", "--kube-version", "1.34.0")
    assert render("--kube-version", "1.33.5")  # the device plugin runs there


def test_prometheus_operator_objects_only_where_their_api_is_served() -> None:
    on = sets("monitoring.serviceMonitor.enabled=true", "monitoring.prometheusRule.enabled=true")
    kinds = {o["kind"] for o in render(*on)}
    assert not {"ServiceMonitor", "PrometheusRule"} & kinds
    served = {o["kind"] for o in render(*on, "--api-versions", "monitoring.coreos.com/v1")}
    assert {"ServiceMonitor", "PrometheusRule"} <= served
    forced = {o["kind"] for o in render(*on, *sets("monitoring.renderWithoutCRDs=true"))}
    assert {"ServiceMonitor", "PrometheusRule"} <= forced


def test_the_default_namespace_is_refused() -> None:
    proc = helm("template", RELEASE, CHART, "--namespace", "default", check=False)
    assert proc.returncode != 0
    assert "namespace default: install mpsd in a namespace of its own" in proc.stderr


# 8. Runbook links.

PROJECT = "https://github.com/mpsd-project/mpsd"  # the repository: Chart.yaml's home and sources
DOCS = f"{PROJECT}/blob/main/docs"  # its docs/ as GitHub shows them


def test_chart_names_the_project_and_its_docs() -> None:
    """Before: home and sources were the placeholder https://mpsd.example/, and every default
    runbook link with them; now the repository, and the links its docs/operations.md there."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["home"].rstrip("/") == PROJECT
    assert [s.rstrip("/") for s in chart["sources"]] == [PROJECT]
    for path in (REPO / "deploy" / "components" / "alerts").glob("*.y*ml"):
        assert "mpsd.example" not in path.read_text(), path
    for path in (REPO / "tests" / "deploy" / "alerts").glob("*.yml"):
        assert "mpsd.example" not in path.read_text(), path


def test_runbook_links_take_the_base_value() -> None:
    on = sets("monitoring.prometheusRule.enabled=true", "monitoring.renderWithoutCRDs=true")
    base = "https://wiki.example/mpsd/runbooks"
    for value, expected in (("", f"{DOCS}/operations.md"), (base, base), (f"{base}/", base)):
        rule = one(render(*on, *sets(f"monitoring.prometheusRule.runbookUrl={value}")), "PrometheusRule")
        alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
        assert alerts
        for r in alerts:
            assert r["annotations"]["runbook_url"] == f"{expected}#{r['alert'].lower()}"


# 9. Labels.

@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_pod_carries_the_instance_label(profile: str) -> None:
    objects = render("-f", CHART / "ci" / f"{profile}-values.yaml")
    for ds in (o for o in objects if o["kind"] == "DaemonSet"):
        assert ds["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert "app.kubernetes.io/instance" not in ds["spec"]["selector"]["matchLabels"]  # immutable


# 10. The holder outlives `helm uninstall` unless told otherwise.

def test_the_holder_is_kept_on_uninstall_by_default() -> None:
    for kind, name in (("DaemonSet", "mpsd-holder"), ("ServiceAccount", "mpsd-holder")):
        assert one(render(), kind, name)["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        dropped = one(render(*sets("holder.keepOnUninstall=false")), kind, name)["metadata"]
        assert "helm.sh/resource-policy" not in dropped.get("annotations", {})


# 12. The chart folder copied alone still renders.

def test_the_chart_folder_copied_alone_renders(tmp_path: Path) -> None:
    copy = tmp_path / "mpsd"
    shutil.copytree(CHART, copy, symlinks=True)
    assert render(chart=copy) == render()


def test_the_packaged_chart_holds_no_symbolic_links(tmp_path: Path) -> None:
    helm("package", CHART, "--destination", tmp_path)
    (archive,) = tmp_path.glob("mpsd-*.tgz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert "mpsd/README.md" in names and "mpsd/values.schema.json" in names
        assert not [m.name for m in tar.getmembers() if not m.isfile()]
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]


def test_the_charts_files_are_deploys_files() -> None:
    # One source: the chart carries copies of deploy/'s files; a change to one of them fails here
    # until it is copied (cp deploy/<source> deploy/helm/mpsd/files/<name>).
    sources = {"config.yaml": "base/config.yaml", "dra-config.yaml": "overlays/dra/config.yaml",
               "dra-rbac.yaml": "overlays/dra/rbac.yaml", "dra-admission.yaml": "overlays/dra/admission.yaml",
               "dra-deviceclass.yaml": "overlays/dra/deviceclass.yaml",
               "mpsd.rules.yml": "components/alerts/mpsd.rules.yml",
               "mpsd-dashboard.json": "components/grafana-dashboard/mpsd-dashboard.json",
               "servicemonitor.yaml": "components/servicemonitor/servicemonitor.yaml"}
    assert sorted(p.name for p in (CHART / "files").iterdir()) == sorted(sources)
    for name, source in sources.items():
        assert (CHART / "files" / name).read_bytes() == (REPO / "deploy" / source).read_bytes(), \
            f"cp deploy/{source} deploy/helm/mpsd/files/{name}"
