"""mpsd's alerting rules (deploy/components/alerts) under the real promtool (Debian's
`prometheus` package; scripts/test.sh installs it).

- `promtool check rules` accepts the plain rule file and the rules of the rendered component;
- the PrometheusRule is exactly what scripts/alert_rules.py makes of the plain file;
- `promtool test rules` passes tests/deploy/alerts/*.yml, which hold for every alert series
  that make it fire after its `for:` and series that must not (a blip, a recovery);
- those cases can fail: each alert made never to fire, or to fire too easily (its `for:`
  dropped, its threshold or guard loosened), fails them;
- every alert has a severity, a one-line summary naming the node, a description and a
  runbook_url whose anchor is a heading of docs/operations.md.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.alertcheck import alerts, anchors, coverage_problems, rule_problems
from tests.deploy.conftest import REPO, kubectl_kustomize, one, rendered

COMPONENT = REPO / "deploy/components/alerts"
PLAIN = COMPONENT / "mpsd.rules.yml"
CASES = sorted((REPO / "tests/deploy/alerts").glob("*.yml"))
OPERATIONS = REPO / "docs/operations.md"

# Changes that make an alert fire too easily; each must fail its promtool cases:
# (alert, rule field, text in it, replacement).
LOOSENED = [
    ("MpsdDaemonDown", "for", "5m", "0m"),
    ("MpsdDaemonRestartStorm", "expr", ">= 3", ">= 1"),
    ("MpsdServerInFault", "for", "5m", "0m"),
    ("MpsdClientWaitingForOtherUid", "for", "3m", "0m"),
    ("MpsdClientWaitingForOtherUid", "expr", "> 0", ">= 0"),
    ("MpsdStandbyStuck", "for", "15m", "0m"),
    ("MpsdStandbyStuck", "expr", "== 1", ">= 0"),
    ("MpsdHealthVerdictStale", "for", "5m", "0m"),
    ("MpsdHealthVerdictStale", "expr", " and mpsd_daemon_up == 1", ""),
    ("MpsdDefaultsRestored", "expr", "> 0", ">= 0"),
    ("MpsdDefaultsContested", "for", "5m", "0m"),
    ("MpsdDefaultsContested", "expr", "> 60", ">= 0"),
    ("MpsdControlImpostor", "expr", "> 0", ">= 0"),
    ("MpsdAllocationNearLimit", "for", "15m", "0m"),
    ("MpsdAllocationNearLimit", "expr", "(mpsd_allocation_memory_limit_bytes > 0)",
     "mpsd_allocation_memory_limit_bytes"),
    ("MpsdExecRegionNearCap", "for", "15m", "0m"),
    ("MpsdExecRegionNearCap", "expr", "> 0.95", "> 0.85"),
    ("MpsdRegionsRefused", "for", "10m", "0m"),
    ("MpsdDeviceUnhealthy", "for", "5m", "0m"),
    ("MpsdDraSliceFieldsDropped", "for", "10m", "0m"),
    ("MpsdDraSliceFieldsDropped", "expr", "> 0", ">= 0"),
    ("MpsdDraDeviceTainted", "for", "10m", "0m"),
    ("MpsdDraDeviceUnhealthy", "for", "5m", "0m"),
    ("MpsdDraDeviceUnhealthy", "expr", '{health="unhealthy"}', ""),
    ("MpsdMetricsTargetDown", "for", "5m", "0m"),
    ("MpsdMetricsTargetDown", "expr", '{job="mpsd-metrics"}', ""),
    ("MpsdMetricsAbsent", "for", "15m", "0m"),
]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not on PATH: install Debian's prometheus package (scripts/test.sh does)")
    return path


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


def plain_rules() -> dict[str, Any]:
    return yaml.safe_load(PLAIN.read_text())


def names() -> list[str]:
    return [rule["alert"] for rule in alerts(plain_rules())]


def exported_names() -> set[str]:
    """Sample names a fresh mpsd Metrics registry can export (counters with _total,
    histograms with _bucket, _count and _sum)."""
    from mpsd.registry import Metrics

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {f.name + suffix for f in Metrics().registry.collect() for suffix in suffixes[f.type]}


def test_every_metric_an_alert_reads_is_one_mpsd_exports() -> None:
    read = {m for rule in alerts(plain_rules()) for m in re.findall(r"\b(mpsd_[a-z0-9_]+)", rule["expr"])}
    assert read
    assert sorted(read - exported_names()) == []


def test_promtool_accepts_the_plain_rule_file() -> None:
    proc = run_promtool("check", "rules", PLAIN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(names())} rules found" in proc.stdout


@pytest.mark.parametrize("kustomization", ["deploy/overlays/monitoring", None])
def test_promtool_accepts_the_rules_of_the_rendered_component(kustomization: str | None, tmp_path: Path) -> None:
    if kustomization is None:  # the component alone, as a user's kustomization includes it
        (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"components": [os.path.relpath(COMPONENT, tmp_path)]}))
        objects = kubectl_kustomize(tmp_path)
    else:
        objects = rendered(kustomization)
    rule = one(objects, "PrometheusRule", "mpsd")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "mpsd-system"
    assert set(rule["spec"]) == {"groups"}
    assert rule["spec"] == plain_rules()  # the same rules as the plain file
    extracted = tmp_path / "extracted.rules.yml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    proc = run_promtool("check", "rules", extracted)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_base_alone_carries_no_prometheus_rule() -> None:
    assert not [o for o in rendered("deploy") if o["kind"] == "PrometheusRule"]


def generate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "scripts/alert_rules.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_prometheus_rule_is_generated_from_the_plain_file(tmp_path: Path) -> None:
    proc = generate("--check")
    assert proc.returncode == 0, proc.stderr
    copied = tmp_path / "alerts"
    shutil.copytree(COMPONENT, copied)
    edited = PLAIN.read_text().replace("mpsd_daemon_up == 0", "mpsd_daemon_up < 1")
    (copied / "mpsd.rules.yml").write_text(edited)
    proc = generate("--check", "--dir", copied)
    assert proc.returncode == 1 and "differs from mpsd.rules.yml" in proc.stderr
    assert generate("--dir", copied).returncode == 0  # regenerated: the two agree again
    assert generate("--check", "--dir", copied).returncode == 0
    assert yaml.safe_load((copied / "prometheusrule.yaml").read_text())["spec"] == yaml.safe_load(edited)


def test_the_generator_refuses_a_rule_file_it_cannot_nest(tmp_path: Path) -> None:
    (tmp_path / "mpsd.rules.yml").write_text("groups: []\nextra: 1\n")
    proc = generate("--dir", tmp_path)
    assert proc.returncode == 1 and "expected one top-level key 'groups:'" in proc.stderr
    assert not (tmp_path / "prometheusrule.yaml").exists()


def test_promtool_rule_tests_pass() -> None:
    assert CASES
    proc = run_promtool("test", "rules", *CASES)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_cases_that_fire_and_cases_that_must_not() -> None:
    cases = [yaml.safe_load(path.read_text()) for path in CASES]
    assert coverage_problems(plain_rules(), cases) == []


@pytest.mark.parametrize("name", names())
def test_every_alert_is_labelled_annotated_and_has_a_runbook(name: str) -> None:
    (rule,) = [r for r in alerts(plain_rules()) if r["alert"] == name]
    assert rule_problems(rule, anchors(OPERATIONS.read_text())) == []


def test_the_checks_catch_what_an_alert_lacks() -> None:
    good = copy.deepcopy(alerts(plain_rules())[0])
    known = anchors(OPERATIONS.read_text())
    assert rule_problems(good, known) == []
    bad = copy.deepcopy(good)
    bad["alert"] = "daemon_down"
    bad["labels"] = {"severity": "page"}
    bad["annotations"] = {"summary": "down\non two lines", "runbook_url": "https://x.example/docs/operations.md#nowhere"}
    assert [p.split(": ", 1)[1] for p in rule_problems(bad, known)] == [
        "the name is not CamelCase with the prefix Mpsd",
        "severity 'page', expected one of critical, warning, info",
        "the summary must be one line, got 'down\\non two lines'",
        "no description",
        "runbook anchor #nowhere is no heading of docs/operations.md",
    ]
    bad["annotations"] = {"summary": "down on {{ $labels.instance }}", "description": "d", "runbook_url": "docs"}
    assert [p.split(": ", 1)[1] for p in rule_problems(bad, known)][2:] == [
        "the summary does not name the node ($labels.node)",
        "runbook_url 'docs' is not https://.../docs/operations.md#anchor",
    ]
    rules = {"groups": [{"name": "g", "rules": [good, {"alert": "MpsdNew", "expr": "vector(1)"}]}]}
    fires = {"alertname": good["alert"], "exp_alerts": [{"exp_labels": {}}]}
    quiet = {"alertname": good["alert"], "exp_alerts": []}
    assert coverage_problems(rules, [{"tests": [{"alert_rule_test": [fires, quiet]}]}]) == [
        "MpsdNew: no promtool case where it fires",
        "MpsdNew: no promtool case where it must not fire",
    ]
    assert coverage_problems(rules, [{"tests": [{"alert_rule_test": [fires, dict(quiet, alertname="MpsdOld")]}]}]) == [
        f"{good['alert']}: no promtool case where it must not fire",
        "MpsdNew: no promtool case where it fires",
        "MpsdNew: no promtool case where it must not fire",
        "MpsdOld: tested but no such alert",
    ]


def test_anchors_are_those_github_makes() -> None:
    markdown = "# Operating mpsd\n```\n# not a heading\n```\n### `MpsdDaemonDown`\n## Metrics, and probes\n"
    assert anchors(markdown) == {"operating-mpsd", "mpsddaemondown", "metrics-and-probes"}


def mutated_tree(tmp_path: Path, alert: str, field: str, old: str | None, new: str) -> Path:
    """A copy of the rule file (``alert``'s ``field`` changed) where the promtool cases'
    relative rule_files path finds it, with the cases beside; returns the cases' directory."""
    rules = plain_rules()
    (rule,) = [r for r in alerts(rules) if r["alert"] == alert]
    if old is None:
        rule[field] = new
    else:
        assert old in str(rule[field]), f"{alert}: {old!r} not in its {field}"
        rule[field] = str(rule[field]).replace(old, new)
    target = tmp_path / PLAIN.relative_to(REPO)
    target.parent.mkdir(parents=True)
    target.write_text(yaml.safe_dump(rules))
    cases = tmp_path / "tests/deploy/alerts"
    shutil.copytree(REPO / "tests/deploy/alerts", cases)
    return cases


def cases_of(alert: str, directory: Path) -> list[Path]:
    """The promtool test files in ``directory`` with cases of ``alert``."""
    return [path for path in sorted(directory.glob("*.yml")) if f"alertname: {alert}\n" in path.read_text()]


@pytest.mark.parametrize("alert", names())
def test_the_cases_fail_for_an_alert_that_never_fires(alert: str, tmp_path: Path) -> None:
    cases = mutated_tree(tmp_path, alert, "expr", None, "absent(vector(1))")
    proc = run_promtool("test", "rules", *cases_of(alert, cases))
    assert proc.returncode == 1 and f"alertname: {alert}," in proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("alert, field, old, new", LOOSENED)
def test_the_cases_fail_for_an_alert_that_fires_too_easily(alert: str, field: str, old: str, new: str,
                                                           tmp_path: Path) -> None:
    cases = mutated_tree(tmp_path, alert, field, old, new)
    proc = run_promtool("test", "rules", *cases_of(alert, cases))
    assert proc.returncode == 1 and f"alertname: {alert}," in proc.stderr, proc.stdout + proc.stderr


def test_every_alert_with_a_duration_or_threshold_is_loosened_above() -> None:
    assert {alert for alert, *_ in LOOSENED} == set(names())
