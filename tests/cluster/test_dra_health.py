"""Device health of mpsd's DRA driver on the real node: the MPS daemon kept down (the holder
stopped, tests/cluster/kube.py stop_holder) shows, through the real kubelet, as resource health
in the tenant pod's status (`allocatedResourcesStatus`, ResourceHealthStatus) and, after
dra.taintAfter (30 s), as mpsd's taint on the device in the node's ResourceSlice; both clear when
the daemon is back. The tenant keeps running throughout. A FAULT cannot be made here: the fake
GPU has no MPS server (tests/dra covers FAULT with the stand-in kubelet)."""

from __future__ import annotations

from typing import Any

from tests.cluster.conftest import client_pod
from tests.cluster.kube import Kube, holding, running, start_holder, stop_holder, wait_for
from tests.cluster.test_dra import DRIVER, claim, exactly


def claim_health(kube: Kube, pod: str, ns: str) -> list[dict[str, Any]]:
    """The pod's container's resource health entries for its claim `gpu` (the kubelet names
    them claim:<pod's claim name>, each device by its first CDI device ID)."""
    status = kube.get("pod", "-n", ns, pod)["status"]["containerStatuses"][0]
    entries = [s for s in status.get("allocatedResourcesStatus") or [] if s["name"] == "claim:gpu"]
    return entries[0]["resources"] if entries else []


def taints(kube: Kube) -> list[dict[str, Any]]:
    return [t for s in kube.get("resourceslices")["items"] if s["spec"]["driver"] == DRIVER
            for d in s["spec"].get("devices", []) for t in d.get("taints") or []]


def test_daemon_down_is_device_health_and_a_taint_until_it_is_back(dra: Kube, ns: str) -> None:
    kube = dra
    kube.apply(claim("c", ns, exactly("gpu", "1Gi")))
    kube.apply(client_pod("t", ns, "256M", claims=[{"name": "gpu", "resourceClaimName": "c"}]))
    wait_for("pod t Running", running(kube, "t", ns), timeout=240)
    holding(kube, "t", ns)
    uid = kube.get("resourceclaim", "-n", ns, "c")["metadata"]["uid"]

    def health(want: str):
        def probe() -> list[dict[str, Any]] | None:
            rows = claim_health(kube, "t", ns)
            return rows if rows and all(r["health"] == want for r in rows) else None
        return probe

    [row] = wait_for("claim healthy in the pod's status", health("Healthy"), timeout=120)
    assert row["resourceID"].startswith(f"mpsd.io/claim={uid}"), row  # mpsd's CDI device of the claim
    assert taints(kube) == []
    container = kube.get("pod", "-n", ns, "t")["status"]["containerStatuses"][0]["containerID"]
    stop_holder(kube)
    try:
        [row] = wait_for("claim unhealthy in the pod's status", health("Unhealthy"), timeout=180)
        assert "MPS daemon down" in row.get("message", ""), row
        [taint] = wait_for("mpsd's taint on the device", lambda: taints(kube) or None, timeout=240)
        assert (taint["key"], taint["value"], taint["effect"]) == (f"{DRIVER}/unhealthy", "MPSDaemonDown", "NoSchedule")
        status = kube.get("pod", "-n", ns, "t")["status"]
        assert status["phase"] == "Running" and status["containerStatuses"][0]["containerID"] == container
    finally:
        start_holder(kube)
    wait_for("claim healthy again", health("Healthy"), timeout=180)
    wait_for("the taint removed", lambda: taints(kube) == [], timeout=180)
    status = kube.get("pod", "-n", ns, "t")["status"]
    assert status["phase"] == "Running" and status["containerStatuses"][0]["containerID"] == container
