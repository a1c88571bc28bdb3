"""Fixtures for the deploy/ tests: rendered kustomizations and the config they carry."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kustomize import render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# Every kustomization a user can apply, and the IPC mode its config must name.
KUSTOMIZATIONS = {
    "deploy": "hostIPC",
    "deploy/base": "hostIPC",
    "deploy/overlays/tmpfs": "tmpfs",
    "deploy/overlays/monitoring": "hostIPC",
}
NODE_KUSTOMIZATIONS = list(KUSTOMIZATIONS)
# deploy/overlays/dra is a node install too, but with the device plugin off, RBAC and a token:
# tests/deploy/test_dra.py holds its invariants.
ALL_KUSTOMIZATIONS = NODE_KUSTOMIZATIONS + ["deploy/sidecar", "deploy/overlays/dra"]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kubectl_kustomize(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([kubectl() or "kubectl", "kustomize", str(directory)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


_CACHE: dict[str, list[dict[str, Any]]] = {}


def rendered(name: str) -> list[dict[str, Any]]:
    """Objects of one kustomization (rendered once per session by tests/deploy/kustomize.py)."""
    if name not in _CACHE:
        _CACHE[name] = render(REPO / name)
    return _CACHE[name]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def config_text(objects: list[dict[str, Any]], configmap: str = "mpsd-config") -> str:
    return one(objects, "ConfigMap", configmap)["data"]["config.yaml"]


@pytest.fixture(params=NODE_KUSTOMIZATIONS)
def node_kustomization(request: pytest.FixtureRequest) -> str:
    return request.param


def mpsd_run_help() -> str:
    """`mpsd run --help` of the mpsd in this tree; skips the test while the CLI is absent."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("mpsd.cli") is None:
        pytest.skip("mpsd.cli not present yet: `mpsd run --help` cannot be asked")
    proc = subprocess.run([sys.executable, "-c", "import sys; from mpsd.cli import main; sys.exit(main())",
                           "run", "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def assert_flags_known(argv: list[str]) -> None:
    import re
    help_text = mpsd_run_help()
    assert argv[0] == "run"
    for flag in [a.split("=")[0] for a in argv if a.startswith("--")]:
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_text), f"{flag} not in `mpsd run --help`"
