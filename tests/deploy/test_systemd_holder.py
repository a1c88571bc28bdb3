"""deploy/systemd/mpsd-holder.service beside mpsd.service: the holder runs `mpsd holder` on the
same config, stops within its grace, has mpsd.service's hardening and capabilities, and the two
units relate as docs/operations.md says (mpsd after and part of the holder; the config makes the
daemon the holder's)."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mpsd.units import parse_duration
from tests.deploy.conftest import REPO
from tests.deploy.test_systemd import CONFIG, UNIT, parse_unit, systemd_seconds

HOLDER_UNIT = REPO / "deploy/systemd/mpsd-holder.service"
HOLDER = parse_unit(HOLDER_UNIT.read_text())
MPSD = parse_unit(UNIT.read_text())


def value(unit: dict, section: str, name: str) -> str:
    (found,) = unit[section][name]
    return found


def test_the_holder_runs_mpsd_holder_on_the_same_config_with_known_flags():
    argv = shlex.split(value(HOLDER, "Service", "ExecStart"))
    assert Path(argv[0]).name == "mpsd" and argv[1] == "holder"
    assert argv[argv.index("--config") + 1] == "/etc/mpsd/config.yaml"
    from mpsd.cli import build_parser

    known = build_parser()._subparsers._group_actions[0].choices["holder"].format_help()
    for flag in [a for a in argv[2:] if a.startswith("--")]:
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", known), flag


def test_the_config_makes_the_daemon_the_holders():
    from mpsd.config import load

    assert load(str(CONFIG), {}, {}).daemon_lifecycle == "independent"


def test_the_holder_quits_its_daemon_in_time_and_is_restarted():
    shutdown = parse_duration(yaml.safe_load(CONFIG.read_text())["shutdownTimeout"])
    assert systemd_seconds(value(HOLDER, "Service", "TimeoutStopSec")) > shutdown + 5
    assert value(HOLDER, "Service", "KillMode") == "mixed"  # SIGTERM to the holder alone: it quits the daemon
    assert value(HOLDER, "Service", "Restart") == "always"


def test_mpsd_starts_after_the_holder_and_stops_or_restarts_with_it():
    unit = MPSD["Unit"]
    for key in ("After", "Wants"):
        assert "mpsd-holder.service" in " ".join(unit[key]).split(), key
    assert value(MPSD, "Unit", "PartOf") == "mpsd-holder.service"
    assert "PartOf" not in HOLDER["Unit"] and "BindsTo" not in HOLDER["Unit"]  # restarting mpsd leaves the holder


def test_the_holder_has_mpsds_hardening_and_capabilities():
    shared = ("User", "NoNewPrivileges", "ProtectSystem", "PrivateTmp", "PrivateDevices",
              "PrivateIPC", "ProtectHome", "RestrictSUIDSGID")  # fmt: skip
    for key in shared:
        assert HOLDER["Service"][key] == MPSD["Service"][key], key
    # mpsd's, less CAP_SYS_PTRACE: only mpsd reads the sessions held on the daemon's sockets
    holder = set(" ".join(HOLDER["Service"]["CapabilityBoundingSet"]).split())
    mpsd = set(" ".join(MPSD["Service"]["CapabilityBoundingSet"]).split())
    assert "CAP_SYS_PTRACE" in mpsd and holder == mpsd - {"CAP_SYS_PTRACE"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_accepts_both_units_together(tmp_path: Path) -> None:
    for unit in (UNIT, HOLDER_UNIT):
        text = re.sub(r"^(ExecStart(?:Pre)?=[-+]*)\S+", r"\1/bin/true", unit.read_text(), flags=re.M)
        (tmp_path / unit.name).write_text(text)
    paths = [str(tmp_path / UNIT.name), str(tmp_path / HOLDER_UNIT.name)]
    proc = subprocess.run(["systemd-analyze", "verify", *paths], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert not re.search(r"Unknown|Failed|Invalid|ignoring|not found", out, re.I), out
