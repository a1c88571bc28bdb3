"""The real one-node cluster (scripts/cluster.sh) for tests/cluster: opt in with MPSD_CLUSTER=1.

- ``kube`` (session): a cluster that is up, brought up here (``up --mode dra``) when none is and
  taken down at the end unless MPSD_CLUSTER_KEEP=1. A cold machine builds the components first
  (docs/benchmarks.md: about half an hour), so these tests have an hour each.
- ``device_plugin`` / ``dra`` (module): the chart installed in that mode (``cluster.sh install``,
  skipped when this session's ``up`` or last install left that mode; ``forget_install`` for a
  module that changes the release itself).
- ``ns`` (function): a fresh namespace holding the ConfigMap ``client`` (scripts/demo_client.py),
  deleted with everything in it afterwards.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.kube import CLUSTER, REPO, Kube, cluster_env, kubectl_path

CLUSTER_DIR = Path(os.environ.get("MPSD_CLUSTER_DIR", "/var/lib/mpsd-cluster"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.timeout(3600))
            if os.environ.get("MPSD_CLUSTER") != "1":
                item.add_marker(pytest.mark.skip(reason="the real one-node cluster: set MPSD_CLUSTER=1 (root, ~30 min cold build)"))


def _cluster(*args: str, timeout: float = 3000) -> str:
    proc = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"scripts/cluster.sh {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    env = cluster_env()
    started = env is None
    if started:
        try:
            _cluster("up", "--mode", "dra")
        except AssertionError:
            _cluster("down", timeout=600)
            raise
        env = cluster_env()
        assert env is not None, "scripts/cluster.sh up returned but the cluster is not up"
        _installed["mode"] = "dra"
    assert env is not None
    yield Kube(env["KUBECONFIG"], kubectl_path(CLUSTER_DIR))
    if started and os.environ.get("MPSD_CLUSTER_KEEP") != "1":
        _cluster("down", timeout=600)


_installed: dict[str, str] = {}  # "mode": what `up` or the last install of this session left


def forget_install() -> None:
    """A module that uninstalls or reinstalls mpsd itself: the next fixture installs again."""
    _installed.clear()


def _install(kube: Kube, mode: str) -> Kube:
    """The chart in ``mode``: `cluster.sh install` (the image rebuilt, helm upgrade --install)
    unless this session's `up` or last install left that mode (about a minute saved a module)."""
    if _installed.get("mode") != mode:
        _installed.clear()
        _cluster("install", "--mode", mode, timeout=900)
        _installed["mode"] = mode
    return kube


@pytest.fixture(scope="module")
def device_plugin(kube: Kube) -> Kube:
    return _install(kube, "device-plugin")


@pytest.fixture(scope="module")
def dra(kube: Kube) -> Kube:
    return _install(kube, "dra")


def client_namespace(kube: Kube, name: str) -> str:
    """Namespace ``name`` with the ConfigMap ``client`` (scripts/demo_client.py) the client pods run."""
    kube.run("create", "namespace", name)
    kube.run("create", "configmap", "client", "-n", name, f"--from-file={REPO / 'scripts' / 'demo_client.py'}")
    return name


@pytest.fixture
def ns(kube: Kube) -> Iterator[str]:
    name = client_namespace(kube, f"t-{uuid.uuid4().hex[:8]}")
    yield name
    kube.delete("namespace", name)


def image() -> str:
    for line in (REPO / "deploy" / "helm" / "mpsd" / "Chart.yaml").read_text().splitlines():
        if line.startswith("appVersion:"):
            return "localhost/mpsd:" + line.split(":", 1)[1].strip().strip('"')
    raise AssertionError("no appVersion in Chart.yaml")


def client_container(name: str, allocate: str) -> dict:
    """A container running scripts/demo_client.py NAME --allocate SIZE --hold in the mpsd image."""
    return {
        "name": name, "image": image(), "imagePullPolicy": "Never",
        "command": ["python3", "/client/demo_client.py", name, "--allocate", allocate, "--hold"],
        "volumeMounts": [{"name": "client", "mountPath": "/client"}],
    }


def client_pod(name: str, namespace: str, allocate: str, *, limits: dict | None = None,
               claims: list[dict] | None = None, host_ipc: bool = False) -> dict:
    """A pod of one client_container ("client") and the ConfigMap it reads."""
    container = client_container(name, allocate)
    container["name"] = "client"
    spec: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5, "hostIPC": host_ipc,
                  "containers": [container], "volumes": [{"name": "client", "configMap": {"name": "client"}}]}
    if limits:
        container["resources"] = {"limits": limits}
    if claims:
        spec["resourceClaims"] = claims
        container["resources"] = {"claims": [{"name": c["name"]} for c in claims]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}
