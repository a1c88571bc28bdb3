"""What every mpsd alert must carry, and which promtool tests cover it (pure functions over the
parsed rule file, the parsed promtool test files and docs/operations.md's text)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SEVERITIES = ("critical", "warning", "info")
RUNBOOK = re.compile(r"^https://\S+/docs/operations\.md#([a-z0-9_-]+)$")


def alerts(rule_file: dict[str, Any]) -> list[dict[str, Any]]:
    """Every alerting rule of a parsed rule file (recording rules left out)."""
    return [rule for group in rule_file["groups"] for rule in group["rules"] if "alert" in rule]


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (lowercase; punctuation other
    than '-' and '_' dropped; spaces become '-'), outside fenced code blocks."""
    found, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} +(.+?) *#*$", line)
        if match:
            text = re.sub(r"[^\w\- ]", "", match.group(1).lower().replace("`", ""))
            found.add(text.replace(" ", "-"))
    return found


def rule_problems(rule: dict[str, Any], known_anchors: set[str]) -> list[str]:
    """What one alerting rule lacks, one line each: [] when it is complete."""
    name = rule.get("alert", "?")
    problems = []
    if not re.fullmatch(r"Mpsd[A-Z][A-Za-z0-9]+", name):
        problems.append(f"{name}: the name is not CamelCase with the prefix Mpsd")
    severity = rule.get("labels", {}).get("severity")
    if severity not in SEVERITIES:
        problems.append(f"{name}: severity {severity!r}, expected one of {', '.join(SEVERITIES)}")
    notes = rule.get("annotations", {})
    summary = str(notes.get("summary", ""))
    if not summary.strip() or "\n" in summary.strip():
        problems.append(f"{name}: the summary must be one line, got {summary!r}")
    elif "absent(" not in rule["expr"] and "$labels.node" not in summary:
        problems.append(f"{name}: the summary does not name the node ($labels.node)")
    if not str(notes.get("description", "")).strip():
        problems.append(f"{name}: no description")
    match = RUNBOOK.match(str(notes.get("runbook_url", "")))
    if match is None:
        problems.append(f"{name}: runbook_url {notes.get('runbook_url')!r} is not https://.../docs/operations.md#anchor")
    elif match.group(1) not in known_anchors:
        problems.append(f"{name}: runbook anchor #{match.group(1)} is no heading of docs/operations.md")
    return problems


def case_counts(test_files: Iterable[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """alertname -> (evaluations where it must fire, evaluations where it must not) over the
    parsed promtool test files."""
    seen: dict[str, tuple[int, int]] = {}
    for test_file in test_files:
        for group in test_file.get("tests", []):
            for case in group.get("alert_rule_test", []):
                fire, quiet = seen.get(case["alertname"], (0, 0))
                if case.get("exp_alerts"):
                    fire += 1
                else:
                    quiet += 1
                seen[case["alertname"]] = (fire, quiet)
    return seen


def coverage_problems(rule_file: dict[str, Any], test_files: Iterable[dict[str, Any]]) -> list[str]:
    """Alerts without a promtool case that makes them fire and one that must not; cases that
    name no alert of the rule file."""
    seen = case_counts(test_files)
    names = {rule["alert"] for rule in alerts(rule_file)}
    problems = []
    for name in sorted(names):
        fire, quiet = seen.get(name, (0, 0))
        if not fire:
            problems.append(f"{name}: no promtool case where it fires")
        if not quiet:
            problems.append(f"{name}: no promtool case where it must not fire")
    problems += [f"{name}: tested but no such alert" for name in sorted(set(seen) - names)]
    return problems
