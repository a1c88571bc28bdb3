"""The chart's `config` value checked at install (issue 31, item 4): values.schema.json's `config`
part is generated from mpsd's own settings (mpsd/config/schema.py, scripts/gen-chart-schema.py),
so `helm install/template/lint` refuse a misspelled key or a bad value inside `config` in one
line instead of a pod that crash-loops at its next restart, and what they let through loads in
mpsd. tests/config/test_config_schema.py holds each parser against its schema; this file, the
chart and the real `helm` (tests/deploy/conftest.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.conftest import CHART, NAMESPACE, RELEASE, REPO, config_text, helm

SCRIPT = REPO / "scripts/gen-chart-schema.py"
SCHEMA = CHART / "values.schema.json"


def gen(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False)


def template(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return helm("template", RELEASE, CHART, "--namespace", NAMESPACE, *args, check=False)


def rendered_config(values: dict[str, Any], tmp_path: Path) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"config": values}))
    proc = template("-f", path)
    assert proc.returncode == 0, proc.stderr
    return config_text([d for d in yaml.safe_load_all(proc.stdout) if d])


def test_the_config_schema_is_what_the_settings_make() -> None:
    proc = gen("--check")
    assert proc.returncode == 0, proc.stderr


def test_a_drifted_schema_is_found_and_rewritten(tmp_path: Path) -> None:
    # A setting missing from the file (or one the settings no longer have) fails --check; a run
    # without it writes the file back to what --check accepts, the hand-written rest untouched.
    copy = tmp_path / "values.schema.json"
    schema = json.loads(SCHEMA.read_text())
    del schema["properties"]["config"]["properties"]["devicePlugin"]["properties"]["slicesPerGpu"]
    schema["properties"]["config"]["properties"]["faultpolicy"] = {"type": "string"}
    copy.write_text(json.dumps(schema, indent=2))
    proc = gen("--check", "--schema", copy)
    assert proc.returncode == 1 and "run scripts/gen-chart-schema.py" in proc.stderr
    assert gen("--schema", copy).returncode == 0
    assert gen("--check", "--schema", copy).returncode == 0
    fixed = json.loads(copy.read_text())
    assert fixed == json.loads(SCHEMA.read_text())


def test_every_level_of_config_refuses_unknown_keys() -> None:
    def objects(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
        found = [(path, node)] if "properties" in node else []
        for name, sub in node.get("properties", {}).items():
            found += objects(sub, f"{path}.{name}")
        return found

    levels = objects(json.loads(SCHEMA.read_text())["properties"]["config"], "config")
    assert {p for p, _ in levels} == {"config", "config.devicePlugin", "config.mps", "config.mig", "config.dra"}
    assert all(node["additionalProperties"] is False for _, node in levels)


@pytest.mark.parametrize("pairs, message", [
    # misspelled keys, at every level
    (["config.devicePlugin.slicesPerGPU=4"], "at '/config/devicePlugin': additional properties 'slicesPerGPU' not allowed"),
    (["config.faultpolicy=x"], "at '/config': additional properties 'faultpolicy' not allowed"),
    (["config.dra.drivername=gpu.example.com"], "at '/config/dra': additional properties 'drivername' not allowed"),
    (["config.mig.capsdir=/dev/nvidia-caps"], "at '/config/mig': additional properties 'capsdir' not allowed"),
    (["config.devicePlugins.enabled=true"], "at '/config': additional properties 'devicePlugins' not allowed"),
    # bad values: choices, ranges, forms, types
    (["config.faultPolicy=kill"], "at '/config/faultPolicy': value must be one of 'report', 'terminate'"),
    (["config.devicePlugin.slicesPerGpu=0"], "at '/config/devicePlugin/slicesPerGpu': minimum: got 0, want 1"),
    (["config.devicePlugin.slicesPerGpu=101"], "at '/config/devicePlugin/slicesPerGpu': maximum: got 101, want 100"),
    (["config.logKeep=many"], "at '/config/logKeep': got string, want integer"),
    (["config.healthInterval=0s"], "at '/config/healthInterval': '0s' does not match pattern"),
    (["config.healthInterval=5h"], "at '/config/healthInterval': '5h' does not match pattern"),
    (["config.dra.taintAfter=-1"], "at '/config/dra/taintAfter': minimum: got -1, want 0"),
    (["config.exclusiveProcess=yes"], "at '/config/exclusiveProcess': got string, want boolean"),
    (["config.pipeDir=/run/" + "p" * 83], "at '/config/pipeDir': maxLength: got 88, want 87"),
    (["config.pinnedMemLimit=0=4X"], "at '/config/pinnedMemLimit': '0=4X' does not match pattern"),
    (["config.devicePlugin.memoryLimit=150%"], "at '/config/devicePlugin/memoryLimit': '150%' does not match pattern"),
    (["config.logMaxSize=1000"], "at '/config/logMaxSize': minimum: got 1,000, want 65,536"),
    (["config.dra.taintAfter=1h"], "at '/config/dra/taintAfter': '1h' does not match pattern"),
    (["config.dra.driverName=GPU_Example"], "at '/config/dra/driverName': 'GPU_Example' does not match pattern"),
    (["config.mig.slicesPerInstance=all"], "at '/config/mig/slicesPerInstance': 'all' does not match pattern"),
    (["config.version=v2"], "at '/config/version': value must be 'v1'"),
])
def test_bad_config_is_refused_in_one_line(pairs: list[str], message: str) -> None:
    proc = template(*[a for p in pairs for a in ("--set", p)])
    assert proc.returncode != 0, f"rendered with {pairs}"
    assert message in proc.stderr, proc.stderr


def test_helm_lint_refuses_a_misspelled_config_key(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("config:\n  devicePlugin:\n    slicesPerGPU: 4\n")
    proc = helm("lint", "--strict", CHART, "--namespace", NAMESPACE, "-f", values, check=False)
    assert proc.returncode != 0
    assert "additional properties 'slicesPerGPU' not allowed" in proc.stdout + proc.stderr


def test_the_shipped_config_files_pass_the_config_schema() -> None:
    # What the chart merges under `config` (files/) is what an operator copies into it.
    schema = json.loads(SCHEMA.read_text())["properties"]["config"]
    for name in ("config.yaml", "dra-config.yaml"):
        jsonschema.validate(yaml.safe_load((CHART / "files" / name).read_text()), schema)


def test_what_the_schema_lets_through_loads_in_mpsd(tmp_path: Path) -> None:
    # Edge values the schema accepts, through Helm (which turns YAML numbers into floats and
    # writes them back) into the rendered config.yaml, which mpsd must load.
    from mpsd import config as mpsd_config

    values = {
        "healthInterval": 0.0001, "healthTimeout": "0.5ms", "verdictTimeout": 604800, "restartBackoffMax": "9999m",
        "shutdownTimeout": "99999999ms", "restartBackoffInitial": 1e-3, "activeThreadPercentage": 0.00001,
        "logMaxSize": 65536, "logKeep": 100.0, "visibleDevices": [0, "GPU-0123-abcd"], "clientPriority": "1",
        "pinnedMemLimit": "63=9999999T,GPU-x=0", "metricsAddress": "[fe80::1]:65535", "multiUser": False,
        "mps": {"protocol": 3}, "devicePlugin": {"slicesPerGpu": 100, "memoryLimit": "0.5%"},
        "mig": {"pipeRoot": "/" + "m" * 45, "slicesPerInstance": "auto", "smPartitionProfiles": ["1g.10gb", "1c.3g.40gb+me"]},
        "pipeDir": "/run/" + "p" * 82,
    }
    schema = json.loads(SCHEMA.read_text())["properties"]["config"]
    jsonschema.validate(values, schema)
    path = tmp_path / "config.yaml"
    path.write_text(rendered_config(values, tmp_path))
    cfg = mpsd_config.load(str(path), {}, {})
    assert (cfg.health_interval, cfg.log_keep, cfg.multi_user) == (0.0001, 100, "off")
    dra = {"dra": {"taintAfter": 0}}
    jsonschema.validate(dra, schema)
    assert "taintAfter: 0" in rendered_config(dra, tmp_path)


def test_the_chart_folder_copied_alone_keeps_its_schema(tmp_path: Path) -> None:
    # The schema is a file of the chart, not read from mpsd at install.
    copy = tmp_path / "mpsd"
    shutil.copytree(CHART, copy)
    proc = helm("template", RELEASE, copy, "--namespace", NAMESPACE, "--set", "config.faultpolicy=x", check=False)
    assert proc.returncode != 0 and "additional properties 'faultpolicy' not allowed" in proc.stderr
