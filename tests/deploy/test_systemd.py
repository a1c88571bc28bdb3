"""deploy/systemd: the unit runs `mpsd run` with flags that exist, stops within the config's
shutdownTimeout, and its hardening keeps what MPS needs (host /tmp, /dev/nvidia*, /dev/shm)."""
from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mpsd.units import parse_duration
from tests.deploy.conftest import REPO, assert_flags_known, one, rendered

UNIT = REPO / "deploy/systemd/mpsd.service"
CONFIG = REPO / "deploy/systemd/config.yaml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections → key → values (a key may repeat, as systemd allows)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None, f"key outside a section: {line}"
        name, _, value = line.partition("=")
        current.setdefault(name.strip(), []).append(value.strip())
    return sections


def systemd_seconds(text: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(number) * units[unit]
    return total


SERVICE = parse_unit(UNIT.read_text())["Service"]


def get(name: str) -> str:
    (value,) = SERVICE[name]
    return value


def exec_start() -> list[str]:
    return shlex.split(get("ExecStart"))


@pytest.mark.parametrize("text, seconds", [("30", 30), ("30s", 30), ("1min 30s", 90), ("500ms", 0.5)])
def test_systemd_seconds(text: str, seconds: float) -> None:
    assert systemd_seconds(text) == seconds


def test_exec_start_runs_mpsd_with_the_config() -> None:
    argv = exec_start()
    assert Path(argv[0]).name == "mpsd" and argv[1] == "run"
    assert argv[argv.index("--config") + 1] == "/etc/mpsd/config.yaml"


def test_exec_start_flags_exist_in_mpsd_run_help() -> None:
    assert_flags_known(exec_start()[1:])


def test_stop_timeout_exceeds_the_shutdown_timeout() -> None:
    shutdown = parse_duration(yaml.safe_load(CONFIG.read_text())["shutdownTimeout"])
    assert systemd_seconds(get("TimeoutStopSec")) > shutdown + 5


def test_signals_go_to_mpsd_first() -> None:
    assert get("Type") == "simple"
    assert get("KillSignal") == "SIGTERM"
    assert get("KillMode") == "mixed"  # mpsd alone gets SIGTERM, so it can `quit -t` the daemon
    assert shlex.split(get("ExecReload")) == ["/bin/kill", "-HUP", "$MAINPID"]
    assert get("Restart") == "on-failure"


def test_config_loads_and_leaves_the_device_plugin_off(tmp_path: Path) -> None:
    raw = yaml.safe_load(CONFIG.read_text())
    assert raw["devicePlugin"]["enabled"] is False
    if importlib.util.find_spec("mpsd.config") is None:
        pytest.skip("mpsd.config not present yet")
    from mpsd.config import load
    cfg = load(str(CONFIG), {}, {})
    assert cfg.device_plugin.enabled is False
    assert cfg.pipe_dir == raw["pipeDir"]


def test_hardening_keeps_what_mps_needs() -> None:
    cfg = yaml.safe_load(CONFIG.read_text())
    assert get("PrivateDevices") == "no"   # /dev/nvidia*
    assert get("PrivateIPC") == "no"       # /dev/shm shared with clients
    if cfg["pipeDir"].startswith("/tmp/"):
        assert get("PrivateTmp") == "no"   # clients look for the pipe dir in the host's /tmp
    protect = get("ProtectSystem")
    assert protect in {"yes", "full"}, "strict would make /tmp, /var/log and /var/lib read-only"
    for key in ("pipeDir", "logDir", "stateDir"):
        assert not cfg[key].startswith(("/usr/", "/boot/", "/etc/")), key
    caps = set(get("CapabilityBoundingSet").split())
    assert {"CAP_SETUID", "CAP_SETGID"} <= caps
    assert get("User") == "root"


def test_capabilities_match_the_kubernetes_daemonset() -> None:
    ds = one(rendered("deploy"), "DaemonSet", "mpsd")
    added = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
    assert set(get("CapabilityBoundingSet").split()) == {f"CAP_{c}" for c in added}


def verify(unit_text: str, tmp_path: Path) -> str:
    path = tmp_path / "mpsd.service"
    path.write_text(unit_text)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    return proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_accepts_every_directive(tmp_path: Path) -> None:
    # The binaries do not exist on a test machine: point Exec lines at /bin/true.
    text = re.sub(r"^(ExecStart(?:Pre)?=[-+]*)\S+", r"\1/bin/true", UNIT.read_text(), flags=re.M)
    out = verify(text, tmp_path)
    assert not re.search(r"Unknown|Failed|Invalid|ignoring", out, re.I), out
    # The check itself can fail:
    assert "Unknown key" in verify(text.replace("[Service]\n", "[Service]\nBogusKey=1\n"), tmp_path)
