"""The Grafana dashboard (deploy/components/grafana-dashboard) asks only for series mpsd exports.

What mpsd exports is read from live /metrics scrapes: a real `mpsd run` (the real control
binary, the fake NVML with one GPU and one MPS client, a region under <stateDir>/exec held by
a real client under the shim), and the exporter fed the series such a node cannot show without
a kubelet or a fault (per-pod allocations, a last error, a server in FAULT). Every panel's
PromQL is read for its metric names, label matchers, grouping labels and legend labels; each
must be one mpsd exports (or one Prometheus adds: instance, job, and the ServiceMonitor's
relabelings), so a renamed metric or label fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mpsd.inventory import Client, Gpu
from mpsd.metrics import AllocationUsage, Metrics, serve
from tests.deploy.conftest import REPO, one, rendered
from tests.deploy.promql import legend_labels, refs, template_refs

COMPONENT = REPO / "deploy/components/grafana-dashboard"
DASHBOARD = COMPONENT / "mpsd-dashboard.json"
SERVICEMONITOR = REPO / "deploy/components/servicemonitor/servicemonitor.yaml"
G = 1 << 30
Exported = dict[str, set[str]]  # sample name -> label names


def parse(text: str) -> Exported:
    out: Exported = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return resp.read().decode()


def target_labels() -> set[str]:
    """Labels Prometheus puts on every series: instance, job, and the ServiceMonitor's."""
    sm = yaml.safe_load(SERVICEMONITOR.read_text())
    relabelled = {r["targetLabel"] for e in sm["spec"]["endpoints"] for r in e.get("relabelings", [])}
    return {"instance", "job"} | relabelled


@pytest.fixture(scope="module")
def live_node(fake_cuda_dir: Path, shim_lib: Path) -> Iterator[Exported]:
    """Scrape a real `mpsd run` once its region and NVML series are there."""
    from tests.mpsbin import FetchError, ensure_mps_control

    try:
        control = ensure_mps_control()
    except FetchError as exc:  # CI has the network: a failed fetch is a failure, not a skip
        pytest.fail(f"could not fetch nvidia-cuda-mps-control: {exc}")
    work = Path(tempfile.mkdtemp(prefix="mpsd-dash-", dir="/tmp"))  # short: the pipe dir holds sockets
    work.chmod(0o711)
    nvml_conf = work / "nvml.conf"
    nvml_conf.write_text(
        f"gpu 0 GPU-face0000-0000-0000-0000-000000000000 {16 * G} {3 * G} 9 0 0 Fake GPU\nproc 0 4242 {3 * G}\n"
    )
    (work / "state/exec/web").mkdir(parents=True)
    client_env = dict(
        os.environ,
        LD_LIBRARY_PATH=str(fake_cuda_dir),
        LD_PRELOAD=str(shim_lib),
        FAKE_CUDA_DEVICES="16G",
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=4G",
        MPSSHIM_REGION=str(work / "state/exec/web/region"),
    )
    client = subprocess.Popen(
        [sys.executable, str(REPO / "scripts/demo_client.py"), "web", "--allocate", "1G", "--hold"],
        env=client_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    port = _free_port()
    mpsd = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpsd",
            "run",
            f"--control-binary={control}",
            f"--pipe-dir={work}/pipe",
            f"--log-dir={work}/log",
            f"--state-dir={work}/state",
            f"--nvml-library={fake_cuda_dir}/libnvidia-ml.so.1",
            f"--metrics-address=127.0.0.1:{port}",
            "--health-interval=0.5s",
            f"--shim-library={shim_lib}",
        ],
        env=dict(os.environ, FAKE_NVML_CONFIG=str(nvml_conf)),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [client.stdout.readline() for _ in range(4)]  # 3 lines of memory info, then "holding"
        assert lines[-1].endswith("holding\n"), lines
        deadline, text = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            try:
                text = get(port, "/metrics")
            except OSError:
                text = ""
            if "mpsd_region_process_memory_bytes{" in text and "mpsd_client_memory_bytes{" in text:
                break
            time.sleep(0.2)
        assert "mpsd_region_process_memory_bytes{" in text, f"no region series in:\n{text}"
        yield parse(text)
    finally:
        for proc in (client, mpsd):
            proc.send_signal(signal.SIGTERM)
        client.wait(10)
        _, err = mpsd.communicate(timeout=20)
        shutil.rmtree(work, ignore_errors=True)
    assert mpsd.returncode == 0, err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fed_exporter() -> Exported:
    """The exporter fed what the live node cannot show, scraped over HTTP."""
    m = Metrics()
    m.update_supervisor(
        daemon_up=True,
        restarts=2,
        health_latency=0.01,
        last_error="daemon pid=7 hung",
        servers={0: 1},
        config_generation=3,
    )
    m.set_faulted_servers(1)
    m.set_device_health({0: False})
    m.observe_inventory([Gpu(0, "GPU-1", "H100", 80 * G, 3 * G, (9, 0), False)], [Client(0, 4242, G)])
    m.set_allocations([AllocationUsage("a1", "web-0", "serving", "vllm", 0, 8 * G, 3 * G)])
    with serve("127.0.0.1:0", m, lambda: True, lambda: True) as server:
        return parse(get(server.port, "/metrics"))


@pytest.fixture(scope="module")
def exported(live_node: Exported) -> Exported:
    union: Exported = {}
    for part in (live_node, fed_exporter()):
        for name, labels in part.items():
            union.setdefault(name, set()).update(labels)
    return union


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> Iterator[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target."""
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"], t.get("legendFormat", "")


def problems(dash: dict, exported: Exported, extra_labels: set[str]) -> list[str]:
    found = []
    for title, expr, legend in queries(dash):
        r = refs(expr)
        known: set[str] = set(extra_labels)
        for name, matchers in r.selectors:
            if name not in exported:
                found.append(f"{title}: metric {name} is not exported")
                continue
            known |= exported[name]
            found += [
                f"{title}: {name} has no label {lb}" for lb in matchers if lb not in exported[name] | extra_labels
            ]
        found += [f"{title}: no metric of {expr!r} has label {lb}" for lb in r.grouping if lb not in known]
        found += [
            f"{title}: legend label {lb} is on no metric of {expr!r}" for lb in legend_labels(legend) if lb not in known
        ]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            r, label = template_refs(var["query"]["query"])
            for name, _ in r.selectors:
                if name not in exported:
                    found.append(f"variable {var['name']}: metric {name} is not exported")
                elif label not in exported[name] | extra_labels:
                    found.append(f"variable {var['name']}: {name} has no label {label}")
    return found


def test_every_panel_asks_only_for_exported_metrics_and_labels(exported: Exported) -> None:
    assert problems(dashboard(), exported, target_labels()) == []


def test_the_dashboard_shows_what_operators_need(exported: Exported) -> None:
    used = {name for _, expr, _ in queries(dashboard()) for name in refs(expr).metrics}
    needed = {
        "mpsd_gpu_memory_used_bytes", "mpsd_gpu_memory_total_bytes",  # per GPU used vs total
        "mpsd_allocation_memory_used_bytes", "mpsd_allocation_memory_limit_bytes",  # per pod used vs cap
        "mpsd_region_memory_used_bytes", "mpsd_region_memory_cap_bytes", "mpsd_region_process_memory_bytes",
        "mpsd_mps_clients", "mpsd_mps_servers", "mpsd_client_memory_bytes",  # clients and servers
        "mpsd_daemon_up", "mpsd_daemon_restarts_total", "mpsd_health_check_seconds_bucket",
        "mpsd_mps_servers_faulted", "mpsd_device_healthy", "mpsd_last_error_info", "mpsd_config_generation",
        "mpsd_fault_terminations_total",  # what faultPolicy terminate did
    }  # fmt: skip
    assert needed - used == set()
    assert {p["type"] for p in dashboard()["panels"]} <= {
        "row",
        "stat",
        "timeseries",
        "table",
        "state-timeline",
        "bargauge",
    }


def test_a_renamed_metric_or_label_fails_the_check(exported: Exported) -> None:
    renamed = {("mpsd_daemon_running" if k == "mpsd_daemon_up" else k): v for k, v in exported.items()}
    assert "Control daemon up: metric mpsd_daemon_up is not exported" in problems(dashboard(), renamed, target_labels())
    relabelled = {
        k: ({"device"} | v - {"gpu"} if k == "mpsd_gpu_memory_used_bytes" else v) for k, v in exported.items()
    }
    assert problems(dashboard(), relabelled, target_labels()) == [
        "GPU memory used vs total: legend label gpu is on no metric of 'mpsd_gpu_memory_used_bytes{node=~\"$node\"}'"
    ]
    assert "Control daemon up: mpsd_daemon_up has no label node" in problems(dashboard(), exported, {"instance", "job"})


def test_panels_do_not_overlap_and_fit_the_grid() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_the_component_ships_the_json_as_a_sidecar_configmap() -> None:
    cm = one(rendered("deploy/overlays/monitoring"), "ConfigMap", "mpsd-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "mpsd-system"
    assert json.loads(cm["data"]["mpsd-dashboard.json"]) == dashboard()
    assert not [o for o in rendered("deploy") if o["metadata"]["name"] == "mpsd-grafana-dashboard"]


def test_every_exported_metric_is_in_the_operations_table(exported: Exported) -> None:
    doc = (REPO / "docs/operations.md").read_text()
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in exported if not name.endswith("_created")}
    assert sorted(f for f in families if f"`{f}`" not in doc) == []
