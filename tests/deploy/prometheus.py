"""A real Prometheus for the tests: the `prometheus` binary (Debian's package; scripts/test.sh
installs it) on a free loopback port, its storage in a temporary directory, scraping the given
targets every second, queried through its HTTP API and always stopped at the end.

The scrape job is built from the ServiceMonitor of deploy/components/servicemonitor (its path,
honorLabels and relabelings), so the labels the dashboard sees are the ones the shipped
monitoring setup gives it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SCRAPE_INTERVAL = "1s"
START_TIMEOUT = 60.0  # seconds for Prometheus to answer /-/ready on a busy machine


class PromError(RuntimeError):
    """Prometheus answered a query with an error (or not at all)."""


def binary() -> str | None:
    return shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servicemonitor_job(servicemonitor: Mapping[str, Any], targets: Mapping[str, str], job: str) -> dict[str, Any]:
    """A scrape job doing what the ServiceMonitor's first endpoint does to each target
    (``address -> node name``; the node name stands in for __meta_kubernetes_pod_node_name).
    ``job``: the name of the Service it selects, the job label the Prometheus Operator gives."""
    endpoint = servicemonitor["spec"]["endpoints"][0]
    relabel = []
    for r in endpoint.get("relabelings", []):
        rule = {"source_labels": r["sourceLabels"], "target_label": r["targetLabel"]}
        rule.update({k: r[k] for k in ("regex", "replacement", "separator", "action") if k in r})
        relabel.append(rule)
    return {
        "job_name": job,
        "scrape_interval": SCRAPE_INTERVAL,
        "scrape_timeout": SCRAPE_INTERVAL,
        "metrics_path": endpoint.get("path", "/metrics"),
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "static_configs": [
            {"targets": [address], "labels": {"__meta_kubernetes_pod_node_name": node}}
            for address, node in targets.items()
        ],
        "relabel_configs": relabel,
    }


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    at: float | None = None  # Unix time queries are evaluated at (None: now)

    def api(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        """``data`` of one GET /api/v1/<path>; an error answer raises PromError with its text."""
        query = "?" + urllib.parse.urlencode(params) if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # 400/422: a bad or failing expression
            body = json.load(exc)
        except OSError as exc:
            raise PromError(f"{path}: no answer from Prometheus: {exc}") from exc
        if body.get("status") != "success":
            raise PromError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` at ``at`` (default: ``self.at``, the moment every
        target had been scraped up; a scrape failing later on a loaded machine marks a target's
        series stale, and a query of now would miss them): [{"metric": labels, "value": [t, v]}]."""
        when = self.at if at is None else at
        data = self.api("query", {"query": expr, **({"time": f"{when:.3f}"} if when else {})})
        if data["resultType"] != "vector":
            raise PromError(f"{expr!r} is a {data['resultType']}, not an instant vector")
        return data["result"]

    def wait_for_scrapes(self, count: int, up: int, down: int = 0, timeout: float = 60.0) -> None:
        """Until ``up`` targets answered and ``down`` did not, ``count`` scrapes each; queries
        are evaluated at that moment from then on."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            now = time.time()
            seen = self.query(f"count_over_time(up[10m]) >= {count}", at=now)
            states = [float(s["value"][1]) for s in self.query("up", at=now)]
            if len(seen) == up + down and (states.count(1.0), states.count(0.0)) == (up, down):
                self.at = now
                return
            time.sleep(0.5)
        log = self.log.read_text()
        raise PromError(f"not {count} scrapes of {up} up, {down} down in {timeout:.0f}s: {seen}\n{log}")

    def evaluated_rules(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Every loaded rule (with its group's name under "group") once each was evaluated."""
        deadline = time.monotonic() + timeout
        while True:
            found = [dict(r, group=g["name"]) for g in self.api("rules")["groups"] for r in g["rules"]]
            if all(r["health"] != "unknown" for r in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def active_alerts(self, expected: set[tuple[str, str]], timeout: float = 60.0) -> list[dict[str, Any]]:
        """The pending and firing alerts, once their (alertname, node) are ``expected`` (or
        at the timeout: the caller compares)."""
        deadline = time.monotonic() + timeout
        while True:
            alerts = self.api("alerts")["alerts"]
            got = {(a["labels"]["alertname"], a["labels"].get("node", "")) for a in alerts}
            if got == expected or time.monotonic() > deadline:
                return alerts
            time.sleep(0.5)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PromError(f"prometheus exited {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise PromError(f"prometheus not ready in {START_TIMEOUT:.0f}s:\n{log.read_text()}")


@contextmanager
def running(workdir: Path, jobs: list[dict[str, Any]], rule_files: list[Path] = ()) -> Iterator[Prometheus]:
    """Prometheus scraping ``jobs`` (scrape_configs entries) and evaluating ``rule_files``
    every second, data and log under ``workdir``."""
    exe = binary()
    if exe is None:
        raise PromError("no prometheus binary on PATH (apt-get install prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(f) for f in rule_files],
        "scrape_configs": jobs,
    }))  # fmt: skip
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log)
        yield Prometheus(url, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
