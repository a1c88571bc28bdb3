"""shim.usage() and `python -m shim` on real region files, written by the real core
(csrc/region.c, region_open.c) from helper processes, read through libmpsshim.so's mpsshim_usage."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import shim

REPO = Path(__file__).resolve().parents[2]
G = 1 << 30
M = 1 << 20


def hold(exe, region, *charges):
    proc = subprocess.Popen([exe, region, *charges], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_usage_reads_caps_usage_and_live_and_dead_holders(holder_exe, shim_lib, tmp_path):
    region = tmp_path / "region"
    a = hold(holder_exe, region, f"0:{4 * G}:{G}", f"1:{2 * G}:{M}")
    b = hold(holder_exe, region, f"0:{4 * G}:{512 * M}")
    try:
        devices = shim.usage(region, library=shim_lib)
        assert [(d.device, d.cap, d.used) for d in devices] == [(0, 4 * G, G + 512 * M), (1, 2 * G, M)]
        assert sorted((p.pid, p.alive, p.used) for p in devices[0].processes) == sorted([(a.pid, True, G), (b.pid, True, 512 * M)])
        b.send_signal(signal.SIGKILL)
        b.wait()
        dead = {p.pid: p.alive for p in shim.usage(region, library=shim_lib)[0].processes}
        assert dead.get(b.pid, False) is False and dead[a.pid] is True
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_usage_of_a_missing_or_corrupted_region_is_a_region_error(shim_lib, tmp_path):
    with pytest.raises(shim.RegionError, match=r"cannot read region '.*/absent': "):
        shim.usage(tmp_path / "absent", library=shim_lib)
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a region" * 1000)
    with pytest.raises(shim.RegionError, match=r"cannot read region '.*/bad': .+"):
        shim.usage(bad, library=shim_lib)


def test_cli_path_and_usage(holder_exe, shim_lib, tmp_path, run_client):
    env = {"MPSSHIM_LIBRARY": str(shim_lib)}
    out = run_client([sys.executable, "-m", "shim", "path"], env=env, check=True)
    assert out.stdout == f"{shim_lib}\n"
    region = tmp_path / "region"
    a = hold(holder_exe, region, f"0:{4 * G}:{G}")
    try:
        table = run_client([sys.executable, "-m", "shim", "usage", str(region)], env=env, check=True).stdout
        assert table.splitlines()[1].split()[:5] == ["0", "4.0", "GiB", "1.0", "GiB"]
        assert f"pid {a.pid}" in table
        data = json.loads(run_client([sys.executable, "-m", "shim", "usage", str(region), "--json"], env=env, check=True).stdout)
        assert data == {"region": str(region), "devices": [{"device": 0, "cap": 4 * G, "used": G, "processes": [{"pid": a.pid, "alive": True, "used": G}]}]}
    finally:
        a.kill()
        a.wait()
    bad = run_client([sys.executable, "-m", "shim", "usage", str(tmp_path / "absent")], env=env)
    assert bad.returncode == 1 and bad.stderr.startswith("error: cannot read region") and bad.stdout == ""
    missing = run_client([sys.executable, "-m", "shim", "path"], env={"MPSSHIM_LIBRARY": "/no/lib.so"})
    assert missing.returncode == 1 and "MPSSHIM_LIBRARY='/no/lib.so' does not name a file" in missing.stderr
