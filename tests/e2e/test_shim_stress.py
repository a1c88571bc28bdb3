"""Several processes and many threads share one cap through one region: the cap holds at every
moment an observer looks, every byte comes back, and a SIGKILLed holder's share is reclaimed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import shim
from tests.conftest import REPO

M = 1 << 20
CAP = 256 * M


def _spawn(argv, env):
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
    full.update(env, PYTHONPATH=str(REPO))
    return subprocess.Popen(argv, env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_threads_and_processes_never_exceed_the_cap(shim_env, shim_lib, tmp_path):
    region = tmp_path / "region"
    env = shim_env(limit=f"0={CAP}", region=region, MPSSHIM_LOG="error")
    layout = [16, 4, 4, 4]  # threads per process: one process of 16, three of 4
    procs = [
        _spawn([sys.executable, "-m", "tests.e2e.stress_worker", str(n), "3", str(48 * M), str(i)], env)
        for i, n in enumerate(layout)
    ]
    samples = []
    try:
        while any(p.poll() is None for p in procs):
            if region.exists():
                try:
                    samples.append(sum(d.used for d in shim.usage(region, library=shim_lib) if d.device == 0))
                except shim.RegionError:
                    pass  # the file exists before its header is written
            time.sleep(0.005)
        outs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["errors"] == [] for r in results), results
    assert all(r["final_fake_used"] == 0 for r in results)
    # The driver of each process never held more than the container's cap...
    assert max(r["max_fake_used"] for r in results) <= CAP
    # ...the region's total never passed it whenever it was looked at...
    assert len(samples) > 20 and max(samples) <= CAP
    # ...and the cap was really contended, so the assertions above had something to catch.
    assert sum(r["refused"] for r in results) > 0 and max(samples) > CAP // 2
    # Every byte came back.
    assert [d.used for d in shim.usage(region, library=shim_lib)] in ([], [0])


def test_sigkilled_holder_share_is_reclaimed(shim_env, run_py, tmp_path):
    region = tmp_path / "region"
    env = shim_env(limit=f"0={CAP}", region=region)
    holder = _spawn(
        [sys.executable, "-c",
         "import sys\nfrom tests.e2e.cudrv import Driver\nd = Driver(); d.init(); d.alloc(%d)\nprint('held', flush=True)\nsys.stdin.read()" % CAP],
        env,
    )
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        blocked = run_py("d = Driver(); d.init(); emit(one_byte=attempt(d.alloc, 1))", env)
        assert blocked.one == {"one_byte": {"error": 2}}
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        after = run_py("d = Driver(); d.init(); p = d.alloc(%d); emit(whole_cap=p > 0, used=d.fake_used(0))" % CAP, env)
        assert after.one == {"whole_cap": True, "used": CAP}
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def fault_lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("faultshim") / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(REPO / "csrc"), f"OUT={out}", "fault"], check=True, capture_output=True)
    return out.with_name("libmpsshim_fault.so")


@pytest.mark.parametrize("step", ["charge.announced", "charge.applied", "charge.folded", "uncharge.applied"])
def test_a_client_killed_inside_the_shims_charge_is_given_back_exactly(shim_env, run_py, fault_lib, tmp_path, step):
    """Through the real shim (a fault-injection build): a client dies of SIGKILL at a step of its
    second allocation's charge (or of a free's uncharge); the next client gets exactly the whole
    cap, and not one byte more."""
    region = tmp_path / "region"
    env = shim_env(limit=f"0={CAP}", region=region)
    victim = dict(env, LD_PRELOAD=str(fault_lib), MPSSHIM_FAULT=f"{step}:2" if step.startswith("charge") else step)
    run_py(f"d = Driver(); d.init(); p = d.alloc({M}); q = d.alloc({64 * M}); d.free(q)\nemit(survived=True)",
           victim, expect_rc=-signal.SIGKILL)
    after = run_py(f"d = Driver(); d.init(); emit(whole=attempt(d.alloc, {CAP}) > 0, more=attempt(d.alloc, 1))", env)
    assert after.one == {"whole": True, "more": {"error": 2}}
