"""docs/operations.md "Uninstalling" and docs/kubernetes.md "From Kustomize to Helm", run on the
real node as the docs write them (their `sh` blocks, with this node's name, overlay and values):

- uninstall (DRA mode, a tenant first, ended "your way"): after `helm uninstall` the holder's
  DaemonSet and ServiceAccount are kept and its MPS daemon runs on, with the same PID; mpsd's
  DaemonSet, DeviceClass and config are gone; after step 3 nothing is left in mpsd-system and
  the host keeps the paths the docs name;
- migration: `kubectl apply -k deploy/overlays/dra`, then the documented adoption and `helm
  install` (the `dra` profile): the release owns the objects, mpsd's pod is the chart's, the
  holder's pod is not replaced (its daemon keeps its PID) until it is deleted on purpose, which
  the test does last, as the chart's README says, leaving a release like `cluster.sh install`'s."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.cluster.conftest import CLUSTER_DIR, client_pod, forget_install
from tests.cluster.kube import REPO, Kube, component, holding, running, wait_for
from tests.cluster.test_dra import claim, exactly
from tests.cluster.test_upgrade import CACHE, daemon_pids, pods
from tests.kubetools import ensure_tools

NODE = "mpsd-node"
VALUES = ["-f", "deploy/helm/mpsd/ci/dra-values.yaml", "--set", "image.repository=localhost/mpsd",
          "--set", "image.pullPolicy=Never"]


def doc_block(doc: str, heading: str) -> str:
    """The first ```sh block under ``heading`` of docs/DOC."""
    text = (REPO / "docs" / doc).read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, f"no sh block under {heading} in docs/{doc}"
    return match.group(1)


def run_doc(kube: Kube, script: str) -> str:
    """``script`` in bash -e from the repository, with the cluster's kubectl and helm on PATH."""
    helm = Path(ensure_tools(CACHE / "kubetools")["helm"]).parent
    path = f"{component(CLUSTER_DIR, 'kubernetes')}{os.pathsep}{helm}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PATH": path, "KUBECONFIG": kube.kubeconfig})
    assert proc.returncode == 0, f"{script}\nexited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


def names(kube: Kube, kind: str, namespace: str | None = "mpsd-system") -> list[str]:
    args = ["-n", namespace] if namespace else []
    return sorted(o["metadata"]["name"] for o in kube.get(kind, *args)["items"])


def test_uninstall_as_documented(dra: Kube, ns: str) -> None:
    kube = dra
    forget_install()  # whatever this module leaves, the next module installs again
    kube.apply(claim("c", ns, exactly("gpu", "1Gi")))
    kube.apply(client_pod("t", ns, "256M", claims=[{"name": "gpu", "resourceClaimName": "c"}]))
    wait_for("pod t Running", running(kube, "t", ns), timeout=240)
    holding(kube, "t", ns)
    [holder] = pods(kube, "daemon-holder")
    pids = daemon_pids(holder)
    assert pids
    script = doc_block("operations.md", "Uninstalling").replace("gpu-node-1", NODE)
    step3 = script.index("# 3.")
    kube.delete("namespace", ns)  # step 1, "your way": the tenant ended (drain refuses bare pods)
    try:
        run_doc(kube, script[:step3])
        assert names(kube, "daemonsets") == ["mpsd-holder"]
        assert "mpsd-holder" in names(kube, "serviceaccounts")
        [kept] = pods(kube, "daemon-holder")
        assert kept["metadata"]["uid"] == holder["metadata"]["uid"] and daemon_pids(kept) == pids
        assert "gpu.mpsd.io" not in names(kube, "deviceclasses", None)
        assert "mpsd-config" not in names(kube, "configmaps")
        run_doc(kube, script[step3:])
        assert kube.get("pods", "-n", "mpsd-system")["items"] == []
        assert names(kube, "daemonsets") == [] and "mpsd-holder" not in names(kube, "serviceaccounts")
        wait_for("the MPS daemon gone", lambda: daemon_pids(holder) == [], timeout=60)
        for path in ("/var/lib/mpsd", "/run/mpsd-pipe", "/var/log/nvidia-mps"):
            assert os.path.isdir(path), path
    finally:
        kube.run("uncordon", NODE)


def test_kustomize_to_helm_as_documented(kube: Kube) -> None:
    """Runs after test_uninstall_as_documented: nothing of mpsd on the node."""
    assert names(kube, "daemonsets") == []
    kube.run("apply", "-k", str(REPO / "deploy" / "overlays" / "dra"), timeout=300)
    wait_for("the Kustomize install ready", lambda: len(pods(kube, "node-daemon")) == 1 and all(
        c.get("ready") for p in pods(kube, "node-daemon") + pods(kube, "daemon-holder")
        for c in p["status"].get("containerStatuses", [{}])) and len(pods(kube, "daemon-holder")) == 1, timeout=300)
    [holder] = pods(kube, "daemon-holder")
    [old_mpsd] = pods(kube, "node-daemon")
    wait_for("the Kustomize holder's daemon", lambda: daemon_pids(holder) or None, timeout=120)
    pids = daemon_pids(holder)
    script = doc_block("kubernetes.md", "From Kustomize to Helm").replace(
        "kubectl kustomize deploy/", "kubectl kustomize deploy/overlays/dra").replace(
        "# + your values", " ".join(VALUES))
    run_doc(kube, script)
    releases = run_doc(kube, "helm list -n mpsd-system -q")
    assert releases.split() == ["mpsd"]

    def rolled() -> bool:
        now = pods(kube, "node-daemon")
        return (len(now) == 1 and now[0]["metadata"]["uid"] != old_mpsd["metadata"]["uid"]
                and all(c.get("ready") for c in now[0]["status"].get("containerStatuses", [{}])))
    wait_for("mpsd's pod the chart's", rolled, timeout=300)
    upgraded = run_doc(kube, "helm upgrade mpsd deploy/helm/mpsd -n mpsd-system " + " ".join(VALUES)
                       + " --set image.tag=0.1.0-migrated -o json")  # a changed image: no field conflict
    assert '"status":"deployed"' in upgraded.replace(" ", ""), upgraded[-1000:]
    run_doc(kube, "helm upgrade mpsd deploy/helm/mpsd -n mpsd-system " + " ".join(VALUES))  # back: an image that exists
    [kept] = pods(kube, "daemon-holder")
    assert kept["metadata"]["uid"] == holder["metadata"]["uid"] and daemon_pids(kept) == pids
    # the holder, OnDelete, is replaced when its clients can stop (the chart's README): now
    kube.delete("pod", "-n", "mpsd-system", holder["metadata"]["name"])
    wait_for("the chart's holder pod ready", lambda: len(pods(kube, "daemon-holder")) == 1 and all(
        p["metadata"]["uid"] != holder["metadata"]["uid"] and all(
            c.get("ready") for c in p["status"].get("containerStatuses", [{}])) for p in pods(kube, "daemon-holder")),
        timeout=300)
