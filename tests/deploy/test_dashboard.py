"""The Grafana dashboard (deploy/components/grafana-dashboard) on a real Prometheus.

Prometheus scrapes a live `mpsd run` (device plugin on with one pod's allocation, an `mpsd
exec` client holding memory in a region; tests/deploy/livenode.py) and an exporter fed the
series such a node cannot show without a fault, through the ServiceMonitor's relabelings
(tests/deploy/conftest.py: monitored). Every panel's query, its template variables
substituted with the values Prometheus holds, must run without error and return series that
carry every label its legend names; every mpsd metric a panel names must be one Prometheus
scraped (an unknown name is no error to Prometheus, just an empty answer), so a renamed
metric or label fails here.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator

from tests.deploy.conftest import FED_NODE, LIVE_NODE, REPO, Monitored, one, rendered
from tests.deploy.prometheus import PromError, Prometheus

COMPONENT = REPO / "deploy/components/grafana-dashboard"
DASHBOARD = COMPONENT / "mpsd-dashboard.json"
METRIC = re.compile(r"\bmpsd_[A-Za-z0-9_:]*")  # every mpsd metric name in an expression
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")
LABEL_VALUES = re.compile(r"label_values\(\s*(?P<match>.*?)\s*,\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
G = 1 << 30
NEEDS_A_FAULT = {"Last error"}  # panels the live node leaves empty: it had no error


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> Iterator[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target."""
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"], t.get("legendFormat", "")


def variables(prom: Prometheus, dash: dict) -> dict[str, list[str]]:
    """Each query variable's values as Grafana would list them: label_values(<selector>, label)
    asked of Prometheus."""
    found = {}
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = LABEL_VALUES.match(var["query"]["query"])
            assert m, f"variable {var['name']}: expected label_values(<selector>, <label>), got {var['query']}"
            found[var["name"]] = prom.api(f"label/{m.group('label')}/values", {"match[]": m.group("match")})
    return found


def substitute(expr: str, values: dict[str, list[str]]) -> str:
    """Grafana's substitution of a multi-value variable in a regex matcher: (a|b)."""

    def one_variable(m: re.Match[str]) -> str:
        assert m.group(1) in values, f"unknown variable ${m.group(1)} in {expr!r}"
        return "(" + "|".join(values[m.group(1)]) + ")"

    return VARIABLE.sub(one_variable, expr)


def problems(prom: Prometheus, dash: dict, names: set[str], values: dict[str, list[str]]) -> list[str]:
    found = [f"variable {name}: no values" for name, vals in values.items() if not vals]
    for title, expr, legend in queries(dash):
        found += [f"{title}: metric {name} is not exported" for name in METRIC.findall(expr) if name not in names]
        query = substitute(expr, values)
        try:
            result = prom.query(query)
        except PromError as exc:
            found.append(f"{title}: {query!r} failed: {exc}")
            continue
        if not result:
            found.append(f"{title}: {query!r} returned no series")
        for label in LEGEND_LABEL.findall(legend):
            lacking = [s["metric"] for s in result if label not in s["metric"]]
            found += [f"{title}: legend label {label} is not on {labels}" for labels in lacking]
    return found


def test_every_panel_returns_series_with_the_labels_of_its_legend(monitored: Monitored) -> None:
    prom = monitored.prometheus
    values = variables(prom, dashboard())
    assert sorted(values["node"]) == [LIVE_NODE, FED_NODE]
    assert problems(prom, dashboard(), monitored.names, values) == []


def test_every_panel_but_the_last_error_shows_the_live_node(monitored: Monitored) -> None:
    found = problems(monitored.prometheus, dashboard(), monitored.names, {"node": [LIVE_NODE]})
    assert {f.split(":", 1)[0] for f in found} == NEEDS_A_FAULT, found
    assert all(f.endswith("returned no series") for f in found), found


def test_the_live_node_shows_its_pod_and_its_exec_client_holding_memory(monitored: Monitored) -> None:
    def value(expr: str) -> list[tuple[dict, float]]:
        return [(s["metric"], float(s["value"][1])) for s in monitored.prometheus.query(expr)]

    [(pod, used)] = value(f'mpsd_allocation_memory_used_bytes{{node="{LIVE_NODE}"}}')
    assert (pod["pod"], pod["namespace"], pod["container"], used) == ("web-0", "serving", "vllm", G)
    [(region, held)] = value(f'mpsd_region_process_memory_bytes{{node="{LIVE_NODE}"}}')
    assert (region["region"], held) == ("web", G)
    assert value(f'mpsd_region_memory_cap_bytes{{node="{LIVE_NODE}"}}')[0][1] == 4 * G


def test_an_unknown_metric_a_renamed_label_or_a_bad_query_fails_the_check(monitored: Monitored) -> None:
    prom, values = monitored.prometheus, {"node": [LIVE_NODE, FED_NODE]}
    bad = copy.deepcopy(dashboard())
    targets = {p["title"]: p["targets"] for p in bad["panels"] if "targets" in p}
    targets["Control daemon up"][0]["expr"] = 'mpsd_daemon_running{node=~"$node"}'
    targets["GPU memory used vs total"][0]["legendFormat"] = "gpu {{device}} used"
    targets["Config generation"][0]["expr"] = 'rate(mpsd_config_generation{node=~"$node"}'
    found = problems(prom, bad, monitored.names, values)
    q = "(node-a|node-b)"
    assert found[:2] == [
        "Control daemon up: metric mpsd_daemon_running is not exported",
        f"Control daemon up: 'mpsd_daemon_running{{node=~\"{q}\"}}' returned no series",
    ]
    assert [f for f in found if f.startswith("Config generation")][0].startswith(
        f"Config generation: 'rate(mpsd_config_generation{{node=~\"{q}\"}}' failed: bad_data:"
    )
    assert len([f for f in found if f.startswith("GPU memory used vs total: legend label device is not on")]) == 2
    assert len(found) == 5, found


def test_the_dashboard_shows_what_operators_need() -> None:
    used = {name for _, expr, _ in queries(dashboard()) for name in METRIC.findall(expr)}
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


def test_every_exported_metric_is_in_the_operations_table(monitored: Monitored) -> None:
    doc = (REPO / "docs/operations.md").read_text()
    exported = {n for n in monitored.names if n.startswith("mpsd_") and not n.endswith("_created")}
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in exported}
    assert sorted(f for f in families if f"`{f}`" not in doc) == []
