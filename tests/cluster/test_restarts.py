"""Restarts on the real node, DRA mode, with a tenant holding 1G of a 4Gi claim: the kubelet
restarted (it registers mpsd's DRA plugin again and unprepares nothing), containerd restarted,
mpsd's pod deleted (the DaemonSet makes a new one). After each the tenant runs in the same
container, its claim stays prepared (CDI spec, region), the MPS daemon keeps its PID; after all
of them the tenant's accounting is intact and a new claim is prepared through the new kubelet."""

from __future__ import annotations

import glob
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.cluster.conftest import client_pod
from tests.cluster.kube import CLUSTER, Kube, holding, running, wait_for
from tests.cluster.test_dra import REGION_DIR, claim, claim_spec_files, claim_tenant, exactly
from tests.cluster.test_upgrade import daemon_pids, pods

REGISTERED = "registered with the kubelet"


@dataclass
class Tenant:
    ns: str
    uid: str  # its claim's
    container: str
    pids: list[int]  # the holder's MPS daemon


@pytest.fixture(scope="module")
def tenant(dra: Kube) -> Iterator[Tenant]:
    kube = dra
    ns = f"t-restarts-{os.getpid()}"
    claim_tenant(kube, ns)
    [holder] = pods(kube, "daemon-holder")
    container = kube.get("pod", "-n", ns, "tenant")["status"]["containerStatuses"][0]["containerID"]
    yield Tenant(ns, kube.get("resourceclaim", "-n", ns, "t")["metadata"]["uid"], container, daemon_pids(holder))
    kube.delete("namespace", ns)


def restart(which: str) -> None:
    proc = subprocess.run([str(CLUSTER), "restart", which], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def mpsd_log(kube: Kube) -> str:
    [pod] = pods(kube, "node-daemon")
    return kube.logs(pod["metadata"]["name"], "mpsd-system", "mpsd")


def assert_tenant_kept(kube: Kube, tenant: Tenant) -> None:
    status = kube.get("pod", "-n", tenant.ns, "tenant")["status"]
    assert status["phase"] == "Running", status
    [c] = status["containerStatuses"]
    assert (c["containerID"], c["restartCount"]) == (tenant.container, 0), c
    assert claim_spec_files(tenant.uid), os.listdir("/var/run/cdi")
    assert glob.glob(os.path.join(REGION_DIR, f"claim-{tenant.uid}-*")), os.listdir(REGION_DIR)
    [holder] = pods(kube, "daemon-holder")
    assert tenant.pids and daemon_pids(holder) == tenant.pids


def test_kubelet_restart_registers_again_and_unprepares_nothing(dra: Kube, tenant: Tenant) -> None:
    before = mpsd_log(dra).count(REGISTERED)
    restart("kubelet")
    wait_for("mpsd's DRA plugin registered with the new kubelet", lambda: mpsd_log(dra).count(REGISTERED) > before,
             timeout=180)
    wait_for("the node Ready", lambda: any(c["type"] == "Ready" and c["status"] == "True" for c in
                                           dra.get("nodes")["items"][0]["status"]["conditions"]), timeout=180)
    log = mpsd_log(dra)
    assert f"uid={tenant.uid}" not in "".join(line for line in log.splitlines() if "claim unprepared" in line)
    # the kubelet wiped the slice at registration and mpsd wrote it again: its own, not someone else's
    assert "added by someone else" not in log, log[-3000:]
    assert_tenant_kept(dra, tenant)


def test_containerd_restart_keeps_the_tenant(dra: Kube, tenant: Tenant) -> None:
    restart("containerd")
    wait_for("the tenant's container seen through the new containerd",
             lambda: dra.exec("tenant", tenant.ns, "true").returncode == 0, timeout=180)
    assert_tenant_kept(dra, tenant)


def test_mpsd_pod_deleted_keeps_the_tenant(dra: Kube, tenant: Tenant) -> None:
    [old] = pods(dra, "node-daemon")
    dra.delete("pod", "-n", "mpsd-system", old["metadata"]["name"])

    def replaced() -> bool:
        now = pods(dra, "node-daemon")
        return (len(now) == 1 and now[0]["metadata"]["uid"] != old["metadata"]["uid"]
                and all(c.get("ready") for c in now[0]["status"].get("containerStatuses", [{}])))
    wait_for("a new mpsd pod ready", replaced, timeout=240)
    assert_tenant_kept(dra, tenant)


def test_after_the_restarts_accounting_holds_and_a_new_claim_is_prepared(dra: Kube, tenant: Tenant) -> None:
    refused = dra.exec("tenant", tenant.ns, "python3", "/client/demo_client.py", "t2", "--allocate", "3584M")
    assert refused.returncode == 3, refused.stdout + refused.stderr  # 1G still charged: 3.5G passes 4Gi
    fits = dra.exec("tenant", tenant.ns, "python3", "/client/demo_client.py", "t3", "--allocate", "2G")
    assert fits.returncode == 0, fits.stdout + fits.stderr
    dra.apply(claim("n", tenant.ns, exactly("gpu", "2Gi")))
    dra.apply(client_pod("new", tenant.ns, "256M", claims=[{"name": "gpu", "resourceClaimName": "n"}]))
    wait_for("pod new Running", running(dra, "new", tenant.ns), timeout=240)
    holding(dra, "new", tenant.ns)
