"""Every kustomization renders, matches `kubectl kustomize`, and passes the Kubernetes schema.

Schema: kubernetes-validate's newest bundled release, strict (unknown fields rejected).
"""
from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import ALL_KUSTOMIZATIONS, REPO, kubectl, kubectl_kustomize, one, rendered
from tests.deploy.kustomize import KustomizeError, json_patch, key, render

K8S_VERSION = kubernetes_validate.latest_version()
NO_SCHEMA = {"monitoring.coreos.com/v1"}  # CRDs: checked by hand in test_servicemonitor_shape


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", ALL_KUSTOMIZATIONS)
def test_renders_and_every_object_passes_the_schema(name: str) -> None:
    objects = rendered(name)
    assert objects
    for obj in objects:
        if obj["apiVersion"] not in NO_SCHEMA:
            validate(obj)


@pytest.mark.parametrize("name", ALL_KUSTOMIZATIONS)
def test_renderer_agrees_with_kubectl_kustomize(name: str) -> None:
    if kubectl() is None:
        pytest.skip("kubectl not on PATH: the Python renderer alone renders deploy/ here")
    ours = {key(o): o for o in rendered(name)}
    theirs = {key(o): o for o in kubectl_kustomize(REPO / name)}
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k] == theirs[k], k


def test_schema_validation_is_strict() -> None:
    ds = copy.deepcopy(one(rendered("deploy"), "DaemonSet", "mpsd"))
    validate(ds)
    ds["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContxt"):
        validate(ds)
    ds = copy.deepcopy(one(rendered("deploy"), "DaemonSet", "mpsd"))
    ds["spec"]["template"]["spec"]["hostPID"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(ds)


def test_servicemonitor_shape() -> None:
    objects = rendered("deploy/overlays/monitoring")
    sm = one(objects, "ServiceMonitor", "mpsd")
    svc = one(objects, "Service", "mpsd-metrics")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    labels = svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "honorLabels"}
        assert endpoint["honorLabels"] is True  # per-pod series keep the client's pod and namespace labels
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    # The base alone carries no CRD object, so it applies on clusters without the operator.
    assert not [o for o in rendered("deploy") if o["apiVersion"] in NO_SCHEMA]


@pytest.mark.parametrize("kustomization, message", [
    ({"resources": ["a.yaml"], "images": []}, "unsupported keys"),
    ({"configMapGenerator": [{"name": "c", "files": ["a.yaml"]}]}, "disableNameSuffixHash"),
    ({"resources": ["a.yaml"], "patches": [{"patch": "x"}]}, "path \\+ target"),
    ({"resources": ["missing.yaml"]}, "does not exist"),
    ({"resources": ["a.yaml", "a.yaml"]}, "duplicate object"),
])
def test_renderer_rejects_what_it_does_not_implement(tmp_path: Path, kustomization: dict, message: str) -> None:
    (tmp_path / "a.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(KustomizeError, match=message):
        render(tmp_path)


@pytest.mark.parametrize("ops, expected", [
    ([{"op": "replace", "path": "/a/b", "value": 2}], {"a": {"b": 2}, "l": [1, 2]}),
    ([{"op": "add", "path": "/l/-", "value": 3}], {"a": {"b": 1}, "l": [1, 2, 3]}),
    ([{"op": "add", "path": "/l/0", "value": 0}], {"a": {"b": 1}, "l": [0, 1, 2]}),
    ([{"op": "remove", "path": "/l/1"}], {"a": {"b": 1}, "l": [1]}),
    ([{"op": "add", "path": "/a/c~1d", "value": "x"}], {"a": {"b": 1, "c/d": "x"}, "l": [1, 2]}),
    ([{"op": "remove", "path": "/a/b"}], {"a": {}, "l": [1, 2]}),
])
def test_json_patch(ops: list, expected: dict) -> None:
    doc = {"a": {"b": 1}, "l": [1, 2]}
    assert json_patch(doc, ops) == expected
    assert doc == {"a": {"b": 1}, "l": [1, 2]}  # the input is left alone


def test_json_patch_refuses_replacing_a_missing_member() -> None:
    with pytest.raises(KustomizeError, match="no such member"):
        json_patch({"a": {}}, [{"op": "replace", "path": "/a/zz", "value": 1}])


def test_every_mpsd_image_carries_the_project_version() -> None:
    import tomllib
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    images = set()
    for name in ALL_KUSTOMIZATIONS:
        for obj in rendered(name):
            pod = obj.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                if c["image"].split(":")[0].endswith("mpsd"):
                    images.add(c["image"])
    assert images == {f"mpsd:{version}"}
