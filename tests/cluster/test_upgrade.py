"""`helm upgrade --wait` to a newly built image on the real node, DRA mode, with a tenant running:
the tenant keeps running and keeps its accounting, the MPS daemon's PID is unchanged, the holder
pod is not replaced, no ResourceSlice is deleted (a watch sees no DELETED), and the upgrade
returns. The helm upgrade's duration is printed (docs/benchmarks.md). The upgrade runs with --timeout 2m
and the rest is checked whatever helm answered: before the holder had an image of its own (issue 31)
`--wait` timed out on it ("Updated: 0/1"); now it returns in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.conftest import CLUSTER_DIR
from tests.cluster.kube import REPO, Kube, component, wait_for
from tests.cluster.test_dra import claim_tenant
from tests.kubetools import ensure_tools

CACHE = Path(os.environ.get("MPSD_CLUSTER_CACHE", "/var/cache/mpsd-cluster"))
NEW_TAG = "0.1.0-upgrade"


def daemon_pids(holder: dict) -> list[int]:
    """PIDs of the holder pod's nvidia-cuda-mps-control (its cgroup names the pod): the machine may
    run other control daemons, and hostPID shows them all."""
    mark = "pod" + holder["metadata"]["uid"]
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and os.readlink(entry / "exe").endswith("/nvidia-cuda-mps-control")
                    and mark in (entry / "cgroup").read_text()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def pods(kube: Kube, component: str) -> list[dict]:
    return kube.get("pods", "-n", "mpsd-system", "-l", f"app.kubernetes.io/component={component}")["items"]


@dataclass
class Upgrade:
    ns: str
    helm: subprocess.CompletedProcess[str]
    seconds: float
    slice_events: list[dict]
    holder_before: dict
    holder_after: dict
    pids_before: list[int]
    pids_after: list[int]


@pytest.fixture(scope="module")
def upgrade(dra: Kube) -> Iterator[Upgrade]:
    """A tenant holding 1G of a 4Gi claim, then `helm upgrade --wait --timeout 2m` to a new image
    tag, under a watch of ResourceSlices; what was seen before and after."""
    kube = dra
    env = {**os.environ, "MPSD_CLUSTER_CACHE": str(CACHE),
           "PATH": f"{component(CLUSTER_DIR, 'containerd')}{os.pathsep}{os.environ['PATH']}"}
    built = subprocess.run([str(REPO / "scripts" / "image.sh"), "--tag", NEW_TAG, "--load", "containerd",
                            "--containerd-address", str(CLUSTER_DIR / "containerd" / "containerd.sock")],
                           capture_output=True, text=True, timeout=900, env=env)
    assert built.returncode == 0, built.stderr[-2000:]
    ns = f"t-upgrade-{os.getpid()}"
    claim_tenant(kube, ns)
    [holder] = pods(kube, "daemon-holder")
    before_pids = daemon_pids(holder)
    old_mpsd = [p["metadata"]["uid"] for p in pods(kube, "node-daemon")]
    watch = subprocess.Popen([kube.kubectl_bin, "--kubeconfig", kube.kubeconfig, "get", "resourceslices", "--watch",
                              "--output-watch-events", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)  # the watch's initial ADDED events
        helm = str(ensure_tools(CACHE / "kubetools")["helm"])
        start = time.monotonic()
        up = subprocess.run([helm, "upgrade", "mpsd", str(REPO / "deploy" / "helm" / "mpsd"), "-n", "mpsd-system",
                             "-f", str(REPO / "deploy" / "helm" / "mpsd" / "ci" / "dra-values.yaml"),
                             "--set", "image.repository=localhost/mpsd", "--set", f"image.tag={NEW_TAG}",
                             "--set", "image.pullPolicy=Never", "--wait", "--timeout", "2m"],
                            capture_output=True, text=True, timeout=300, env={**env, "KUBECONFIG": kube.kubeconfig})
        took = time.monotonic() - start
        print(f"helm upgrade --wait: exit {up.returncode} after {took:.1f} s", up.stderr.strip()[-1500:])

        def rolled() -> bool:
            now = pods(kube, "node-daemon")
            return (len(now) == 1 and now[0]["metadata"]["uid"] not in old_mpsd
                    and now[0]["spec"]["containers"][0]["image"].endswith(NEW_TAG)
                    and all(c.get("ready") for c in now[0]["status"].get("containerStatuses", [])))
        wait_for("the new mpsd pod ready", rolled, timeout=240)
        time.sleep(10)  # a DELETE, if any, comes while the old instance goes
    finally:
        watch.terminate()
        out, _ = watch.communicate(timeout=30)
    [after] = pods(kube, "daemon-holder")
    yield Upgrade(ns, up, took, [json.loads(c) for c in _json_objects(out)], holder, after, before_pids,
                  daemon_pids(after))
    kube.delete("namespace", ns)


def test_helm_upgrade_wait_succeeds(upgrade: Upgrade) -> None:
    assert upgrade.helm.returncode == 0, upgrade.helm.stderr[-1500:]


def test_no_resource_slice_deleted(upgrade: Upgrade) -> None:
    assert upgrade.slice_events, "the ResourceSlice watch saw nothing"
    assert [e for e in upgrade.slice_events if e["type"] == "DELETED"] == [], \
        [(e["type"], e["object"]["metadata"]["name"]) for e in upgrade.slice_events]


def test_holder_and_daemon_kept(upgrade: Upgrade) -> None:
    assert upgrade.holder_after["metadata"]["uid"] == upgrade.holder_before["metadata"]["uid"], "holder replaced"
    assert upgrade.pids_before and upgrade.pids_after == upgrade.pids_before


def test_tenant_keeps_running_and_its_accounting(upgrade: Upgrade, dra: Kube) -> None:
    tenant = dra.get("pod", "-n", upgrade.ns, "tenant")
    assert tenant["status"]["phase"] == "Running"
    assert tenant["status"]["containerStatuses"][0]["restartCount"] == 0
    # 1G still charged to its region: 3.5G more passes the 4Gi cap, 2G does not
    refused = dra.exec("tenant", upgrade.ns, "python3", "/client/demo_client.py", "t2", "--allocate", "3584M")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    fits = dra.exec("tenant", upgrade.ns, "python3", "/client/demo_client.py", "t3", "--allocate", "2G")
    assert fits.returncode == 0, fits.stdout + fits.stderr


def _json_objects(text: str) -> list[str]:
    """Split kubectl's stream of pretty-printed JSON objects."""
    objects, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = (ch == "\\") and not esc
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
            if depth == 1:
                start = i
        elif ch == "}":
            depth -= 1
            if depth == 0:
                objects.append(text[start:i + 1])
    return objects
