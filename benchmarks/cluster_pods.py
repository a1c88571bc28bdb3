"""Pod create -> Running with a ResourceClaim on the real one-node cluster (scripts/cluster.sh up
--mode dra), and NodePrepareResources as the kubelet measures it.

    .venv/bin/python benchmarks/cluster_pods.py [--pods 20]

Each round creates a claim (memory 512Mi, compute 2: 20 fit the 16 GiB fake GPU) and a pod
naming it (the mpsd image running `sleep`), and times from the pod's create call until kubectl
sees it Running (polled every 0.1 s; scheduling, allocation, NodePrepareResources, sandbox, CDI
and container start). Pods are made one after another and deleted at the end. The kubelet's histogram
dra_operations_duration_seconds{operation_name="PrepareResources"} is read from its /metrics
(through the API server's node proxy) before and after: the mean of this run's calls is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.cluster.conftest import CLUSTER_DIR, image  # noqa: E402
from tests.cluster.kube import Kube, cluster_env, kubectl_path  # noqa: E402


def prepare_histogram(kube: Kube) -> tuple[float, float]:
    """(sum, count) of the kubelet's PrepareResources durations."""
    text = kube.run("get", "--raw", "/api/v1/nodes/mpsd-node/proxy/metrics").stdout
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("dra_operations_duration_seconds_") and 'operation_name="PrepareResources"' in line:
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith("dra_operations_duration_seconds_sum"):
                total += value
            elif line.startswith("dra_operations_duration_seconds_count"):
                count += value
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=20)
    args = ap.parse_args()
    env = cluster_env()
    if env is None:
        print("no cluster: scripts/cluster.sh up --mode dra", file=sys.stderr)
        return 1
    kube = Kube(env["KUBECONFIG"], kubectl_path(CLUSTER_DIR))
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    kube.run("create", "namespace", ns)
    before = prepare_histogram(kube)
    times = []
    try:
        for i in range(args.pods):
            claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": f"c{i}", "namespace": ns},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.mpsd.io",
                              "capacity": {"requests": {"memory": "512Mi", "compute": "2"}}}}]}}}
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{i}", "namespace": ns},
                   "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                            "resourceClaims": [{"name": "gpu", "resourceClaimName": f"c{i}"}],
                            "containers": [{"name": "c", "image": image(), "imagePullPolicy": "Never",
                                            "command": ["sleep", "3600"], "resources": {"claims": [{"name": "gpu"}]}}]}}
            kube.apply(claim)
            start = time.monotonic()
            kube.run("create", "-f", "-", stdin=json.dumps(pod))
            while kube.run("get", "pod", "-n", ns, f"p{i}", "-o", "jsonpath={.status.phase}").stdout != "Running":
                if time.monotonic() - start > 300:
                    raise SystemExit(f"p{i} not Running after 300 s")
                time.sleep(0.1)
            times.append(time.monotonic() - start)
        after = prepare_histogram(kube)
    finally:
        kube.delete("namespace", ns)
    times.sort()
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    print(f"pods {len(times)}: create->Running p50 {statistics.median(times):.2f} s, p99 {p99:.2f} s, "
          f"max {times[-1]:.2f} s")
    calls = after[1] - before[1]
    if calls:
        print(f"kubelet PrepareResources: {calls:.0f} calls, mean {1000 * (after[0] - before[0]) / calls:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
