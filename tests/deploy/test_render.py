"""Every kustomization renders with the real `kubectl kustomize` and passes the Kubernetes schema.

Schema: kubernetes-validate's newest bundled release, strict (unknown fields rejected).
"""
from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.conftest import ALL_KUSTOMIZATIONS, REPO, one, rendered, tools
from tests.kubetools import HELM_VERSION, KUBECTL_VERSION, versions

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


def test_the_tools_are_the_ones_the_wheel_carries() -> None:
    assert versions(tools()) == {"helm": HELM_VERSION, "kubectl": KUBECTL_VERSION}
    assert K8S_VERSION.rsplit(".", 1)[0] == KUBECTL_VERSION.lstrip("v").rsplit(".", 1)[0]


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
    assert images == {f"localhost/mpsd:{version}"}  # as scripts/image.sh tags it
