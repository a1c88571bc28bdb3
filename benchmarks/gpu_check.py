"""The steps of scripts/gpu-check.sh after the install: facts, tests/gpu, benchmarks, results.

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--control-binary PATH] [--work DIR]

Each step runs as a child process with its own time limit; a step that fails or times out is
recorded (status, exit code, last lines) and the next one runs, so the results folder is always
written. --dry-run (no GPU): the facts are read through the fake libnvidia-ml.so.1 and the shim
is measured against the fake libcuda.so.1 (both built from tests/fakes), the inference
benchmark runs on the CPU, and every figure is marked dry-run. Never touches the card's settings.

Results folder: results.json (every figure), pytest-gpu.xml (JUnit), pytest-gpu.log,
summary.md, *.png, records/ (what tests/gpu measured, one JSON per test), logs/ (each step).
`python benchmarks/gpu_check.py cleanup WORK` quits and ends the MPS daemons started under WORK.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu_facts import describe  # noqa: E402
from benchmarks.gpu_report import plot_shim, read_junit, render_summary  # noqa: E402
from tests.fakes import build_fakes  # noqa: E402

# Seconds per step. On a GPU: 60 + 330 + 170 = 560 s at most, plus the install (~30 s): under the
# 10 minutes a lent machine gives one command. The shim's overhead on a GPU is measured by its test
# in tests/gpu (recorded), not a second time.
LIMITS_S = {"facts": 60, "pytest": 360, "inference": 150}  # 2026-11-26 on an H100: 22 GPU tests took 215 s
DRY_LIMITS_S = {"facts": 60, "pytest": 60, "shim_alloc": 60, "inference": 90}
PER_TEST_TIMEOUT_S = 120
SHIM_RECORD = "test_shim_overhead_against_the_real_driver"
FAKE_NVML = "gpu 0 GPU-face0000-0000-0000-0000-000000000000 17179869184 0 9 0 0 Fake GPU (gpu-check dry-run)\n"


_running: list[subprocess.Popen] = []  # the step now running, for the signal handler


def _stop_step(proc: subprocess.Popen, grace: float = 30) -> int:
    """SIGTERM the step's process group (mpsd run then quits its daemon), SIGKILL after ``grace``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
    except ProcessLookupError:
        return proc.wait()


def _on_signal(signum: int, _frame: object) -> None:
    for proc in _running:
        _stop_step(proc)
    raise SystemExit(128 + signum)


def run_step(name: str, cmd: list[str], env: dict[str, str], limit: float, logs: Path) -> dict[str, Any]:
    """Run one step (its own process group, ended at the limit); status, exit code, seconds, log tail."""
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _running.append(proc)
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc = _stop_step(proc, grace=15)
            status = "timed out"
        finally:
            _running.remove(proc)
    seconds = time.monotonic() - start
    tail = log_path.read_text(errors="replace").splitlines()[-20:]
    detail = "" if status == "ok" else f"exit {rc} after {seconds:.0f}s (limit {limit:.0f}s), see logs/{name}.log"
    print(f"gpu-check: {name}: {status} in {seconds:.1f}s", flush=True)
    return {"status": status, "rc": rc, "seconds": seconds, "detail": detail, "tail": tail}


def dry_env(work: Path) -> dict[str, str]:
    """Environment of the dry-run's children: the fake driver and fake NVML of tests/fakes."""
    fake = build_fakes(work / "fake")
    nvml_config = work / "fake-nvml.conf"
    nvml_config.write_text(FAKE_NVML)
    ld = os.pathsep.join(p for p in (str(fake), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return {"LD_LIBRARY_PATH": ld, "FAKE_NVML_CONFIG": str(nvml_config), "FAKE_CUDA_DEVICES": "16G"}


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_records(directory: Path) -> dict[str, Any]:
    out = {}
    for path in sorted(directory.glob("*.json")):
        data = load_json(path)
        if data is not None:
            out[path.stem] = data
    return out


def git_commit() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    if proc.returncode != 0:
        return "unknown (no git)"
    return proc.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def check(args: argparse.Namespace) -> dict[str, Any]:
    out, work = Path(args.out), Path(args.work)
    logs, records = out / "logs", out / "records"
    records.mkdir(parents=True, exist_ok=True)
    limits = DRY_LIMITS_S if args.dry_run else LIMITS_S
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "MPSSHIM_")) and k != "LD_PRELOAD"}
    env = {**base, "PYTHONUNBUFFERED": "1", "GPU_CHECK_RECORDS": str(records), "GPU_CHECK_WORK": str(work)}
    tool_env = {**env, **dry_env(work)} if args.dry_run else env
    control = ["--control-binary", args.control_binary] if args.control_binary else []
    py = sys.executable
    results: dict[str, Any] = {
        "schema": 1,
        "dry_run": args.dry_run,
        "mode": "dry-run" if args.dry_run else "gpu",
        "command": args.command or "scripts/gpu-check.sh",
        "commit": git_commit(),
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "install": load_json(work / "install.json") or {},
        "steps": {},
        "benchmarks": {},
    }
    facts_file = out / "facts.json"
    step = run_step("facts", [py, "benchmarks/gpu_facts.py", *control], tool_env, limits["facts"], logs)
    results["steps"]["facts"] = step
    if step["status"] == "ok":
        facts_file.write_text((logs / "facts.log").read_text())
    results["facts"] = load_json(facts_file) or {}
    results["machine"] = describe(results["facts"]) if results["facts"] else ["facts not collected"]
    for line in results["machine"]:
        print(f"gpu-check: {line}", flush=True)

    junit = out / "pytest-gpu.xml"
    pytest_cmd = [
        py,
        "-m",
        "pytest",
        "tests/gpu",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rA",
        f"--junitxml={junit}",
        "-o",
        f"timeout={PER_TEST_TIMEOUT_S}",
    ]
    results["steps"]["pytest"] = run_step("pytest", pytest_cmd, env, limits["pytest"], logs)
    (out / "pytest-gpu.log").write_text((logs / "pytest.log").read_text())
    results["tests"] = read_junit(junit)
    results["records"] = read_records(records)

    if args.dry_run:  # the shim against the fake driver, as its GPU test would against the real one
        shim_json = out / "shim_alloc.json"
        shim_cmd = [
            py,
            "benchmarks/shim_alloc.py",
            "--json",
            str(shim_json),
            "--driver",
            "fake",
            "--pairs",
            "2000",
            "--rounds",
            "1",
            "--paths",
            "dlsym",
            "--procs",
            "1",
        ]
        results["steps"]["shim_alloc"] = run_step("shim_alloc", shim_cmd, tool_env, limits["shim_alloc"], logs)
        results["benchmarks"]["shim_alloc"] = load_json(shim_json)
    else:
        results["benchmarks"]["shim_alloc"] = results["records"].get(SHIM_RECORD)

    inf_json = out / "inference.json"
    inf_cmd = [
        py,
        "benchmarks/inference.py",
        "--json",
        str(inf_json),
        "--plot",
        str(out),
        "--work",
        str(work),
        "--budget",
        str(limits["inference"] - 40),
    ]
    inf_cmd += ["--dry-run"] if args.dry_run else []
    results["steps"]["inference"] = run_step("inference", inf_cmd + control, env, limits["inference"], logs)
    results["benchmarks"]["inference"] = load_json(inf_json)

    results["plots"] = (results["benchmarks"]["inference"] or {}).get("plots", [])
    results["plots"] += plot_shim(results["benchmarks"]["shim_alloc"], out, args.dry_run)
    results["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "summary.md").write_text(render_summary(results))
    return results


# ------------------------------------------------------------------ cleanup of MPS daemons


def mps_pids_under(work: Path, proc_dir: Path = Path("/proc")) -> dict[int, str]:
    """PID -> pipe dir of every process whose CUDA_MPS_PIPE_DIRECTORY lies under ``work``."""
    found = {}
    prefix = str(work.resolve())
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if not comm.startswith("nvidia-cuda-mps"):
            continue
        for var in environ:
            if var.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
                pipe = var.split(b"=", 1)[1].decode(errors="replace")
                if pipe == prefix or pipe.startswith(prefix + "/"):
                    found[int(entry.name)] = pipe
    return found


def cleanup(work: Path, control: str) -> int:
    """`quit` every MPS control daemon started under ``work``, then SIGKILL what is left of them."""
    left = mps_pids_under(work)
    for pipe in sorted(set(left.values())):
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe}
        try:
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
    deadline = time.monotonic() + 10
    while mps_pids_under(work) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in mps_pids_under(work):
        try:
            os.kill(pid, signal.SIGKILL)
            print(f"gpu-check: killed MPS process {pid} left under {work}", flush=True)
        except ProcessLookupError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cleanup"]:
        if len(argv) not in (2, 3):
            print("usage: gpu_check.py cleanup WORK [CONTROL_BINARY]", file=sys.stderr)
            return 2
        return cleanup(Path(argv[1]), argv[2] if len(argv) == 3 else "nvidia-cuda-mps-control")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True, help="scratch directory (fakes, pipe dirs)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--control-binary", default=None)
    ap.add_argument("--command", default=None, help="the command line to record")
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    results = check(args)
    bad = [n for n, s in results["steps"].items() if s["status"] != "ok"]
    print(f"gpu-check: results in {args.out} (summary.md, results.json); steps not ok: {', '.join(bad) or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
