"""Device health of mpsd's device plugin on the real node: the MPS daemon kept down (the holder
stopped, tests/cluster/kube.py stop_holder) makes every slice Unhealthy in ListAndWatch, which
the real kubelet shows as the node's allocatable mpsd.io/gpu dropping to 0 (capacity stays), and
as resource health in the tenant's status (`allocatedResourcesStatus`, ResourceHealthStatus);
both come back with the daemon, and the tenant keeps running throughout."""

from __future__ import annotations

from typing import Any

from tests.cluster.conftest import client_pod
from tests.cluster.kube import Kube, holding, running, start_holder, stop_holder, wait_for
from tests.cluster.test_device_plugin import SLICES

RESOURCE = "mpsd.io/gpu"


def gpu_count(kube: Kube, field: str) -> str:
    return kube.get("nodes")["items"][0]["status"][field].get(RESOURCE, "")


def slice_health(kube: Kube, pod: str, ns: str) -> list[dict[str, Any]]:
    status = kube.get("pod", "-n", ns, pod)["status"]["containerStatuses"][0]
    entries = [s for s in status.get("allocatedResourcesStatus") or [] if s["name"] == RESOURCE]
    return entries[0]["resources"] if entries else []


def test_daemon_down_makes_the_slices_unhealthy_until_it_is_back(device_plugin: Kube, ns: str) -> None:
    kube = device_plugin
    kube.apply(client_pod("t", ns, "256M", limits={RESOURCE: "2"}, host_ipc=True))
    wait_for("pod t Running", running(kube, "t", ns), timeout=180)
    holding(kube, "t", ns)
    wait_for("all slices allocatable", lambda: gpu_count(kube, "allocatable") == str(SLICES), timeout=120)

    def health(want: str):
        def probe() -> list[dict[str, Any]] | None:
            rows = slice_health(kube, "t", ns)
            return rows if len(rows) == 2 and all(r["health"] == want for r in rows) else None
        return probe

    wait_for("the pod's slices healthy in its status", health("Healthy"), timeout=120)
    container = kube.get("pod", "-n", ns, "t")["status"]["containerStatuses"][0]["containerID"]
    stop_holder(kube)
    try:
        wait_for("no slice allocatable", lambda: gpu_count(kube, "allocatable") == "0", timeout=180)
        assert gpu_count(kube, "capacity") == str(SLICES)
        wait_for("the pod's slices unhealthy in its status", health("Unhealthy"), timeout=180)
        status = kube.get("pod", "-n", ns, "t")["status"]
        assert status["phase"] == "Running" and status["containerStatuses"][0]["containerID"] == container
    finally:
        start_holder(kube)
    wait_for("all slices allocatable again", lambda: gpu_count(kube, "allocatable") == str(SLICES), timeout=180)
    wait_for("the pod's slices healthy again", health("Healthy"), timeout=180)
    status = kube.get("pod", "-n", ns, "t")["status"]
    assert status["phase"] == "Running" and status["containerStatuses"][0]["containerID"] == container
