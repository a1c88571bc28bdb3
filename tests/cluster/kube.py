"""The real one-node cluster of scripts/cluster.sh, as the tests in tests/cluster drive it.

``Kube`` runs the cluster's kubectl (built with it) against its admin kubeconfig; every wait polls
a condition with a bound and fails with what was last seen. Objects are dicts, applied as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent.parent
CLUSTER = REPO / "scripts" / "cluster.sh"
T = TypeVar("T")


def cluster_env() -> dict[str, str] | None:
    """KUBECONFIG and CONTAINERD_ADDRESS of a cluster that is up, or None."""
    path = Path(os.environ.get("MPSD_CLUSTER_DIR", "/var/lib/mpsd-cluster")) / "env"
    if not path.is_file():
        return None
    status = subprocess.run([str(CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    if "kube-apiserver" not in status.stdout or "kubelet" not in status.stdout:
        return None
    env = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    return env


def component(cluster_dir: Path, want: str) -> Path:
    """Where a built component's binaries are (the cluster's $dir/components, written by up)."""
    for line in (cluster_dir / "components").read_text().splitlines():
        name, path = line.split()
        if name == want:
            return Path(path)
    raise RuntimeError(f"no {want} in {cluster_dir / 'components'}")


def kubectl_path(cluster_dir: Path) -> str:
    return str(component(cluster_dir, "kubernetes") / "kubectl")


class Kube:
    def __init__(self, kubeconfig: str, kubectl: str) -> None:
        self.kubeconfig = kubeconfig
        self.kubectl_bin = kubectl

    def run(self, *args: str, stdin: str | None = None, timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([self.kubectl_bin, "--kubeconfig", self.kubeconfig, *args], input=stdin,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def get(self, *args: str) -> Any:
        return json.loads(self.run("get", "-o", "json", *args).stdout)

    def apply(self, *objects: dict) -> None:
        self.run("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def delete(self, *args: str, wait: bool = True) -> None:
        self.run("delete", "--ignore-not-found", f"--wait={str(wait).lower()}", "--timeout=180s", *args, timeout=240)

    def logs(self, pod: str, namespace: str, container: str | None = None) -> str:
        return self.run("logs", "-n", namespace, pod, *(["-c", container] if container else []), check=False).stdout

    def exec(self, pod: str, namespace: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run("exec", "-n", namespace, pod, "--", *argv, check=False, timeout=timeout)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 180, interval: float = 1.0) -> T:
    """Poll ``probe`` until it returns something other than None or False; fail naming ``what``."""
    end = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            last = exc
        else:
            if last is not None and last is not False:
                return last
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not seen within {timeout:.0f}s (last: {last!r})")
        time.sleep(interval)


def pod_state(pod: dict) -> str:
    """Phase, unmet conditions and waiting containers' reasons of a pod: what a wait reports."""
    status = pod.get("status", {})
    parts = [status.get("phase", "?")]
    parts += [f"{c['type']}={c['status']} {c.get('reason', '')} {c.get('message', '')}".strip()
              for c in status.get("conditions", []) if c["status"] != "True"]
    for c in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
        waiting = c.get("state", {}).get("waiting")
        if waiting:
            parts.append(f"{c['name']}: {waiting.get('reason', '')} {waiting.get('message', '')}".strip())
    return "; ".join(parts)


def running(kube: Kube, name: str, namespace: str) -> Callable[[], bool]:
    def probe() -> bool:
        pod = kube.get("pod", "-n", namespace, name)
        phase = pod["status"].get("phase", "")
        if phase in ("Failed", "Succeeded"):
            raise RuntimeError(f"pod {name} ended ({phase}): {kube.logs(name, namespace)}")
        if phase != "Running":
            raise AssertionError(pod_state(pod))
        return True
    return probe


def holding(kube: Kube, pod: str, namespace: str, timeout: float = 180, container: str | None = None) -> str:
    """The log of a demo_client.py container once it says it holds its allocation."""
    def probe() -> str | None:
        text = kube.logs(pod, namespace, container)
        if "holding" in text:
            return text
        raise AssertionError(text)
    return wait_for(f"pod {pod} holding", probe, timeout=timeout)


HOLDER_OFF = {"mpsd.io/holder-stopped": "true"}  # a label no node carries


def stop_holder(kube: Kube) -> None:
    """Keep the MPS daemon down: the holder DaemonSet's pods get a node selector no node matches,
    so the DaemonSet controller deletes the node's holder pod (which quits the daemon) and makes
    no other; mpsd, which only adopts a holder's daemon, waits. Tenants' claims, regions and
    pods stay (the fake CUDA needs no daemon to keep running)."""
    patch = [{"op": "add", "path": "/spec/template/spec/nodeSelector", "value": HOLDER_OFF}]
    kube.run("-n", "mpsd-system", "patch", "daemonset", "mpsd-holder", "--type=json", "-p", json.dumps(patch))
    wait_for("the holder pod gone", lambda: not kube.get("pods", "-n", "mpsd-system", "-l",
                                                         "app.kubernetes.io/component=daemon-holder")["items"],
             timeout=180)


def start_holder(kube: Kube) -> None:
    """Undo stop_holder: the holder's pod template as the chart made it, its pod Ready again."""
    patch = [{"op": "remove", "path": "/spec/template/spec/nodeSelector"}]
    kube.run("-n", "mpsd-system", "patch", "daemonset", "mpsd-holder", "--type=json", "-p", json.dumps(patch))

    def ready() -> bool:
        holders = kube.get("pods", "-n", "mpsd-system", "-l", "app.kubernetes.io/component=daemon-holder")["items"]
        return len(holders) == 1 and all(c.get("ready") for c in holders[0]["status"].get("containerStatuses", [{}]))
    wait_for("the holder pod ready", ready, timeout=240)
