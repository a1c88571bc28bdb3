"""The results folder of scripts/gpu-check.sh: the pytest JUnit report read into plain data, and
summary.md written from results.json. Pure functions, plus one plot of the shim's overhead."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

DRY_RUN_BANNER = (
    "**DRY RUN on a machine without an NVIDIA GPU**: fake driver (tests/fakes), CPU clients, tiny models. "
    "These figures show that the check's plumbing works; they say nothing about GPUs."
)


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and one entry per test case of a pytest JUnit XML file (xunit1 or xunit2)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"error": f"{path}: {exc}", "cases": [], "total": 0, "passed": 0, "failed": 0, "skipped": 0}
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = node.get("message") or node.text or ""
                message = (text.strip().splitlines() or [""])[0][:300]
                break
        cases.append(
            {
                "name": f"{case.get('classname', '')}::{case.get('name', '')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
            }
        )
    counts = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    return {"total": len(cases), **counts, "cases": cases}


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f} MiB"


def _steps(results: dict[str, Any]) -> list[str]:
    lines = ["| step | status | seconds |", "| --- | --- | --- |"]
    for name, step in results.get("steps", {}).items():
        status = step["status"] + (f": {step['detail']}" if step.get("detail") else "")
        lines.append(f"| {name} | {status} | {step['seconds']:.1f} |")
    return lines


def _tests(tests: dict[str, Any]) -> list[str]:
    lines = [
        f"{tests.get('total', 0)} tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
        f"{tests.get('error', 0)} errors, {tests.get('skipped', 0)} skipped",
        "",
    ]
    if tests.get("cases"):
        lines += ["| test | outcome | seconds | message |", "| --- | --- | --- | --- |"]
        for c in tests["cases"]:
            msg = c["message"].replace("|", "\\|")
            lines.append(f"| `{c['name']}` | {c['outcome']} | {c['seconds']:.1f} | {msg} |")
    return lines


def _shim(shim: dict[str, Any] | None) -> list[str]:
    if not shim or not shim.get("rows"):
        return ["not measured"]
    lines = [
        f"`{shim['command']}` ({shim['driver']} driver)",
        "",
        "| path | bytes | threads | processes | bare ns | shim ns | added ns | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in shim["rows"]:
        lines.append(
            f"| {r['path']} | {r['bytes']} | {r['threads']} | {r['procs']} | {r['bare_ns']} | {r['shim_ns']} "
            f"| {r['added_ns']} | {r['ratio']} |"
        )
    return lines


def _inference(inf: dict[str, Any] | None) -> list[str]:
    if not inf or not inf.get("rows"):
        return ["not measured"]
    lines = [
        f"`{inf.get('command', 'benchmarks/inference.py')}`: device {inf['device']}, {inf['size']} models, "
        f"{inf['duration_s']} s windows",
        "",
        "| model | batch | mode | clients | items/s (all) | p50 ms (worst) | p99 ms (worst) | GPU memory |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in inf["rows"]:
        p50 = max(c["p50_ms"] for c in r["per_client"])
        p99 = max(c["p99_ms"] for c in r["per_client"])
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']} | {r['clients']} | {r['aggregate_items_per_s']:.1f} | "
            f"{p50:.2f} | {p99:.2f} | {_fmt_bytes(r.get('gpu_memory_used_max'))} |"
        )
    lines.append("")
    for t in inf.get("targets", []):
        lines.append(
            f"- MPS / time-slicing, {t['model']} batch {t['batch']}, {t['clients']} clients: "
            f"{t['mps_over_timeslice']:.2f} (target >= {t['target']}: {'met' if t['met'] else 'NOT met'})"
        )
    s = inf.get("split")
    if s:
        lines.append(
            f"- 25/75 split ({s['model']} batch {s['batch']}): {s['items_per_s_25']:.1f} vs {s['items_per_s_75']:.1f} "
            f"items/s, ratio {s['ratio']:.2f} (target 3 +/- 10%: {'met' if s['within_target'] else 'NOT met'})"
        )
    lines += [f"- {x}" for x in inf.get("skipped", [])]
    return lines


def render_summary(results: dict[str, Any]) -> str:
    """summary.md: what ran where, the test outcomes, every figure."""
    dry = results.get("dry_run", True)
    lines = [f"# gpu-check results ({'DRY RUN' if dry else 'GPU'})", ""]
    if dry:
        lines += [DRY_RUN_BANNER, ""]
    lines += [
        f"- command: `{results.get('command', '')}`",
        f"- commit: {results.get('commit', 'unknown')}",
        f"- started: {results.get('started', '')}  finished: {results.get('finished', '')}",
        "",
        "## Machine",
        "",
    ]
    lines += [f"- {line}" for line in results.get("machine", [])]
    install = results.get("install") or {}
    if install:
        lines.append(
            f"- install ({install.get('seconds', '?')} s): {install.get('packages')}; {install.get('project')}"
        )
    lines += ["", "## Steps", ""] + _steps(results)
    lines += ["", "## tests/gpu", ""] + _tests(results.get("tests", {}))
    records = results.get("records", {})
    if records:
        lines += ["", "## Recorded by the tests", ""]
        for name, rec in sorted(records.items()):
            lines.append(f"- `{name}`: `{rec}`")
    lines += ["", "## Shim alloc+free overhead", ""] + _shim(results.get("benchmarks", {}).get("shim_alloc"))
    lines += ["", "## Inference: sequential, time-slicing, MPS", ""]
    lines += _inference(results.get("benchmarks", {}).get("inference"))
    plots = results.get("plots", [])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_shim(shim: dict[str, Any] | None, directory: Path, dry_run: bool) -> list[str]:
    """Bar chart of ns added per pair, per size and thread count; [] without matplotlib or data."""
    if not shim or not shim.get("rows"):
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    labels = [f"{r['path']} {r['bytes'] >> 10}K x{r['threads']}x{r['procs']}" for r in shim["rows"]]
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(labels)), 3.5))
    ax.bar(labels, [r["added_ns"] for r in shim["rows"]])
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    tag = " (DRY RUN)" if dry_run else f" ({shim['driver']} driver)"
    ax.set(title=f"shim: ns added per alloc+free pair{tag}", ylabel="ns added")
    fig.tight_layout()
    path = directory / "shim-alloc.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path.name]
