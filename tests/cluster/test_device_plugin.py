"""mpsd's device plugin on the real node: the real kubelet admits `mpsd.io/gpu` pods, containerd
applies mpsd's env and mounts and NVIDIA's CDI device (from NVIDIA_VISIBLE_DEVICES, as the NVIDIA
runtime does), the shim caps each container, and the real scheduler keeps what does not fit Pending."""

from __future__ import annotations

import re

from tests.cluster.conftest import client_pod
from tests.cluster.kube import Kube, holding, running, wait_for

GIB = 1 << 30
GPU_BYTES = 16 * GIB  # the fake GPU of scripts/cluster.sh
SLICES = 10  # the chart's devicePlugin.slicesPerGpu


def mem_total(log: str) -> float:
    """GiB of the first cuMemGetInfo line of demo_client.py."""
    m = re.search(r"cuMemGetInfo: total ([0-9.]+) GiB", log)
    assert m, f"no cuMemGetInfo line in:\n{log}"
    return float(m.group(1))


def test_pod_is_capped_and_refused_past_its_cap(device_plugin: Kube, ns: str) -> None:
    kube = device_plugin
    kube.apply(client_pod("a", ns, "1G", limits={"mpsd.io/gpu": "2"}, host_ipc=True))
    wait_for("pod a Running", running(kube, "a", ns), timeout=180)
    log = holding(kube, "a", ns)
    cap = 2 * GPU_BYTES / SLICES / GIB
    assert abs(mem_total(log) - cap) < 0.02, log
    # a second process in the same container shares its cap: 1G held, 3G more would pass 3.2G
    second = kube.exec("a", ns, "python3", "/client/demo_client.py", "a2", "--allocate", "3G")
    assert second.returncode == 3, second.stdout + second.stderr
    assert "refused" in second.stdout, second.stdout
    fits = kube.exec("a", ns, "python3", "/client/demo_client.py", "a3", "--allocate", "2G")
    assert fits.returncode == 0, fits.stdout + fits.stderr


def test_second_pod_shares_the_gpu(device_plugin: Kube, ns: str) -> None:
    kube = device_plugin
    for name in ("p", "q"):
        kube.apply(client_pod(name, ns, "3G", limits={"mpsd.io/gpu": "2"}, host_ipc=True))
    for name in ("p", "q"):
        wait_for(f"pod {name} Running", running(kube, name, ns), timeout=180)
        log = holding(kube, name, ns)
        assert abs(mem_total(log) - 2 * GPU_BYTES / SLICES / GIB) < 0.02, log
    node = kube.get("nodes")["items"][0]
    assert node["status"]["allocatable"]["mpsd.io/gpu"] == str(SLICES)


def test_pod_that_does_not_fit_stays_pending(device_plugin: Kube, ns: str) -> None:
    kube = device_plugin
    kube.apply(client_pod("big", ns, "1G", limits={"mpsd.io/gpu": str(SLICES + 1)}, host_ipc=True))

    def unschedulable() -> str | None:
        pod = kube.get("pod", "-n", ns, "big")
        for cond in pod["status"].get("conditions", []):
            if cond["type"] == "PodScheduled" and cond["status"] == "False":
                return cond.get("message", "")
        return None

    message = wait_for("pod big unschedulable", unschedulable, timeout=120)
    assert "Insufficient mpsd.io/gpu" in message, message
    assert kube.get("pod", "-n", ns, "big")["status"]["phase"] == "Pending"
