"""A stand-in Kubernetes API server for `helm template --dry-run=server`: enough discovery for
the kinds the chart renders, and GET of the objects a test puts in (404 for any other), so that
the chart's `lookup` sees a live release. Plain HTTP on 127.0.0.1; nothing is ever written."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# groupVersion -> [(plural, kind, namespaced)]
RESOURCES = {
    "v1": [("namespaces", "Namespace", False), ("serviceaccounts", "ServiceAccount", True),
           ("configmaps", "ConfigMap", True), ("services", "Service", True), ("secrets", "Secret", True)],
    "apps/v1": [("daemonsets", "DaemonSet", True)],
    "rbac.authorization.k8s.io/v1": [("clusterroles", "ClusterRole", False),
                                     ("clusterrolebindings", "ClusterRoleBinding", False)],
    "admissionregistration.k8s.io/v1": [("validatingadmissionpolicies", "ValidatingAdmissionPolicy", False),
                                        ("validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding", False)],
    "resource.k8s.io/v1": [("deviceclasses", "DeviceClass", False)],
}


def _discovery(path: str) -> dict[str, Any] | None:
    if path == "/api":
        return {"kind": "APIVersions", "versions": ["v1"]}
    if path == "/apis":
        groups = []
        for gv in RESOURCES:
            if "/" in gv:
                group, version = gv.split("/")
                ref = {"groupVersion": gv, "version": version}
                groups.append({"name": group, "versions": [ref], "preferredVersion": ref})
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
    gv = path.removeprefix("/api/").removeprefix("/apis/")
    if gv in RESOURCES and path.count("/") == (2 if path.startswith("/api/") else 3):
        return {"kind": "APIResourceList", "groupVersion": gv,
                "resources": [{"name": n, "singularName": "", "namespaced": ns, "kind": k, "verbs": ["get", "list"]}
                              for n, k, ns in RESOURCES[gv]]}
    return None


class FakeAPI:
    def __init__(self, minor: int = 34) -> None:
        self.objects: dict[str, dict[str, Any]] = {}  # request path -> object
        self.version = {"major": "1", "minor": str(minor), "gitVersion": f"v1.{minor}.0"}

    def put(self, obj: dict[str, Any]) -> None:
        gv, meta = obj["apiVersion"], obj["metadata"]
        (plural,) = [n for n, k, _ in RESOURCES[gv] if k == obj["kind"]]
        root = "/api/v1" if gv == "v1" else f"/apis/{gv}"
        ns = f"/namespaces/{meta['namespace']}" if "namespace" in meta else ""
        self.objects[f"{root}{ns}/{plural}/{meta['name']}"] = obj

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/version":
            return 200, self.version
        found = _discovery(path) or self.objects.get(path)
        if found is not None:
            return 200, found
        if path.rsplit("/", 1)[-1] in {n for rs in RESOURCES.values() for n, _, _ in rs}:  # a list
            return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                     "message": f"{path} not found"}


@contextmanager
def serving(api: FakeAPI, directory: Path) -> Iterator[Path]:
    """Serve ``api`` until the block ends; yields a kubeconfig naming it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            code, body = api.answer(self.path.split("?")[0])
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
    try:
        yield kubeconfig
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
