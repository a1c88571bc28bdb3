"""The plain alert rule file (deploy/components/alerts/mpsd.rules.yml) on a real Prometheus that
scrapes a live node (tests/deploy/conftest.py: monitored): Prometheus loads it and evaluates
every rule with health "ok", and every expression, asked through /api/v1/query, parses and
evaluates without error against the node's real series (a vector matching that is not
one-to-one on real labels fails here, not in promtool's hand-written series). An alert that
should not fire on a healthy node answers empty; on the node that shows faults the alerts for
them are pending with the node in their summary, on the healthy one none. promtool's rule tests
(tests/deploy/test_alerts.py) decide when each fires and that each metric it reads exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import DOWN_NODE, FED_NODE, RULES, Monitored
from tests.deploy.prometheus import PromError, Prometheus


def rules(path: Path = RULES) -> Iterator[tuple[str, str, str]]:
    """(group, alert or record name, expr) of every rule in every group."""
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            yield group["name"], rule.get("alert") or rule["record"], str(rule["expr"])


def problems(prom: Prometheus, found_rules: list[tuple[str, str, str]]) -> list[str]:
    found = []
    for group, name, expr in found_rules:
        try:
            prom.query(expr)
        except PromError as exc:
            found.append(f"{group}/{name}: {expr!r} failed: {exc}")
    return found


def test_the_rule_file_has_alerts() -> None:
    assert RULES.is_file(), f"{RULES} is missing"
    assert [name for _, name, _ in rules()]


def test_every_rule_expression_runs_on_prometheus(monitored: Monitored) -> None:
    found = list(rules())
    assert found
    assert problems(monitored.prometheus, found) == []


def test_prometheus_loads_the_file_and_evaluates_every_rule_without_error(monitored: Monitored) -> None:
    loaded = monitored.prometheus.evaluated_rules()
    assert sorted((r["group"], r["name"]) for r in loaded) == sorted((g, n) for g, n, _ in rules())
    assert [(r["name"], r["health"], r.get("lastError")) for r in loaded if r["health"] != "ok"] == []


# what the nodes show: the fed exporter a server in FAULT and an unhealthy GPU 0, one target
# nothing answers on; the live node is healthy and raises nothing
EXPECTED = {("MpsdServerInFault", FED_NODE), ("MpsdDeviceUnhealthy", FED_NODE), ("MpsdMetricsTargetDown", DOWN_NODE)}


def test_alerts_match_the_real_series_of_a_faulty_node_and_spare_the_healthy_one(monitored: Monitored) -> None:
    alerts = monitored.prometheus.active_alerts(EXPECTED)
    assert {(a["labels"]["alertname"], a["labels"].get("node", "")) for a in alerts} == EXPECTED
    for a in alerts:  # pending until their `for:` passes; the summary names the node
        assert a["state"] in ("pending", "firing"), a
        assert a["labels"]["node"] in a["annotations"]["summary"], a


def test_a_bad_expression_or_one_failing_on_real_series_fails_the_check(monitored: Monitored, tmp_path: Path) -> None:
    bad = tmp_path / "bad.rules.yml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [
        {"alert": "Unclosed", "expr": "rate(mpsd_daemon_restarts_total[5m] > 0"},
        {"alert": "ManyToMany", "expr": "mpsd_device_healthy + on() mpsd_device_healthy"},  # two nodes
        {"alert": "Fine", "expr": "mpsd_daemon_up == 0", "for": "5m"},
    ]}]}))  # fmt: skip
    found = problems(monitored.prometheus, list(rules(bad)))
    assert len(found) == 2, found
    assert found[0].startswith("bad/Unclosed: 'rate(mpsd_daemon_restarts_total[5m] > 0' failed: bad_data:")
    assert found[1].startswith("bad/ManyToMany: 'mpsd_device_healthy + on() mpsd_device_healthy' failed: execution:")
    assert "many-to-many matching not allowed" in found[1]
