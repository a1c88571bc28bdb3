"""mpsd's DRA driver on the real node: claims allocated by the real scheduler (consumable capacity
of one shared device per GPU), prepared through the real kubelet, mpsd's CDI device and NVIDIA's
nvidia.com/gpu device applied by containerd; unprepared when the pods and claims go."""

from __future__ import annotations

import glob
import os

from tests.cluster.conftest import client_container, client_namespace, client_pod
from tests.cluster.kube import Kube, holding, running, wait_for
from tests.cluster.test_device_plugin import mem_total

DRIVER = "gpu.mpsd.io"
CDI_DIR = "/var/run/cdi"
REGION_DIR = "/var/lib/mpsd/regions"


def claim(name: str, namespace: str, *requests: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": list(requests)}}}


def exactly(name: str, memory: str, compute: str | None = None) -> dict:
    caps = {"memory": memory} | ({"compute": compute} if compute else {})
    return {"name": name, "exactly": {"deviceClassName": DRIVER, "capacity": {"requests": caps}}}


def claim_tenant(kube: Kube, ns: str) -> None:
    """In a new namespace ``ns``: claim ``t`` (4Gi, compute 25) and pod ``tenant`` holding 1G of it,
    Running and holding when this returns."""
    client_namespace(kube, ns)
    kube.apply(claim("t", ns, exactly("gpu", "4Gi", "25")))
    kube.apply(client_pod("tenant", ns, "1G", claims=[{"name": "gpu", "resourceClaimName": "t"}]))
    wait_for("tenant Running", running(kube, "tenant", ns), timeout=240)
    holding(kube, "tenant", ns)


def claim_spec_files(uid: str) -> list[str]:
    return glob.glob(os.path.join(CDI_DIR, f"mpsd.io-claim_{uid}*"))


def test_resource_slice_published(dra: Kube) -> None:
    slices = wait_for("mpsd's ResourceSlice", lambda: [s for s in dra.get("resourceslices")["items"]
                                                    if s["spec"]["driver"] == DRIVER] or None)
    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    assert [d["name"] for d in devices] == ["gpu-0"], devices
    assert devices[0].get("allowMultipleAllocations") is True, devices[0]
    assert devices[0]["capacity"]["memory"]["value"] == "16Gi", devices[0]


def test_two_claims_share_one_gpu_each_capped(dra: Kube, ns: str) -> None:
    kube = dra
    kube.apply(claim("c1", ns, exactly("gpu", "4Gi", "25")), claim("c2", ns, exactly("gpu", "2Gi", "25")))
    kube.apply(client_pod("a", ns, "1G", claims=[{"name": "gpu", "resourceClaimName": "c1"}]),
               client_pod("b", ns, "1G", claims=[{"name": "gpu", "resourceClaimName": "c2"}]))
    for pod, cap in (("a", 4.0), ("b", 2.0)):
        wait_for(f"pod {pod} Running", running(kube, pod, ns), timeout=240)
        assert abs(mem_total(holding(kube, pod, ns)) - cap) < 0.02
    results = [kube.get("resourceclaim", "-n", ns, c)["status"]["allocation"]["devices"]["results"] for c in ("c1", "c2")]
    assert [r[0]["device"] for r in results] == ["gpu-0", "gpu-0"], results
    # the cap holds for a second process in a's container: 1G held, 3.5G more would pass 4Gi
    refused = kube.exec("a", ns, "python3", "/client/demo_client.py", "a2", "--allocate", "3584M")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    fits = kube.exec("a", ns, "python3", "/client/demo_client.py", "a3", "--allocate", "2G")
    assert fits.returncode == 0, fits.stdout + fits.stderr


def test_claim_too_large_stays_pending(dra: Kube, ns: str) -> None:
    kube = dra
    kube.apply(claim("huge", ns, exactly("gpu", "32Gi")))
    kube.apply(client_pod("big", ns, "1G", claims=[{"name": "gpu", "resourceClaimName": "huge"}]))

    def unschedulable() -> str | None:
        for cond in kube.get("pod", "-n", ns, "big")["status"].get("conditions", []):
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return cond.get("message", "")
        return None

    message = wait_for("pod big unschedulable", unschedulable, timeout=120)
    assert "cannot allocate all claims" in message, message
    assert "allocation" not in kube.get("resourceclaim", "-n", ns, "huge").get("status", {})


def test_two_requests_and_first_available_subrequest(dra: Kube, ns: str) -> None:
    """One claim, two requests, each named by one container (a container may name one request of
    one mpsd claim, docs/dra.md); the first request's 64Gi subrequest cannot be had, its 2Gi one can."""
    kube = dra
    first = {"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": DRIVER, "capacity": {"requests": {"memory": "64Gi"}}},
        {"name": "small", "deviceClassName": DRIVER, "capacity": {"requests": {"memory": "2Gi"}}}]}
    kube.apply(claim("two", ns, first, exactly("extra", "1Gi")))
    pod = client_pod("c", ns, "512M", claims=[{"name": "two", "resourceClaimName": "two"}])
    main, extra = pod["spec"]["containers"][0], client_container("extra", "512M")
    main["resources"] = {"claims": [{"name": "two", "request": "gpu"}]}
    extra["resources"] = {"claims": [{"name": "two", "request": "extra"}]}
    pod["spec"]["containers"].append(extra)
    kube.apply(pod)
    wait_for("pod c Running", running(kube, "c", ns), timeout=240)
    results = kube.get("resourceclaim", "-n", ns, "two")["status"]["allocation"]["devices"]["results"]
    assert sorted(r["request"] for r in results) == ["extra", "gpu/small"], results
    assert abs(mem_total(holding(kube, "c", ns)) - 2.0) < 0.02
    assert abs(mem_total(holding(kube, "c", ns, container="extra")) - 1.0) < 0.02


def test_deleting_pod_and_claim_unprepares(dra: Kube, ns: str) -> None:
    kube = dra
    kube.apply(claim("gone", ns, exactly("gpu", "1Gi")))
    kube.apply(client_pod("d", ns, "256M", claims=[{"name": "gpu", "resourceClaimName": "gone"}]))
    wait_for("pod d Running", running(kube, "d", ns), timeout=240)
    uid = kube.get("resourceclaim", "-n", ns, "gone")["metadata"]["uid"]
    assert claim_spec_files(uid), os.listdir(CDI_DIR)
    regions = glob.glob(os.path.join(REGION_DIR, f"claim-{uid}-*"))
    assert regions, os.listdir(REGION_DIR)
    kube.delete("pod", "-n", ns, "d")
    kube.delete("resourceclaim", "-n", ns, "gone")
    wait_for("claim's CDI spec removed", lambda: not claim_spec_files(uid), timeout=120)
    wait_for("claim's region removed", lambda: not any(os.path.exists(r) for r in regions), timeout=120)
