"""Small-batch inference: N clients one after another, all at once with time-slicing, and all at
once under MPS through mpsd; and a 25/75 active-thread split between two MPS clients.

    python benchmarks/inference.py [--dry-run] [--clients 1,2,4,8] [--models resnet18,encoder]
        [--batches 1,8] [--duration 1] [--budget S] [--control-binary PATH] [--json FILE] [--plot DIR]

Clients are benchmarks/inference_client.py processes in --serve mode, started once per pool and
reused across windows (start-up is not measured). Modes, for each model, batch and N:
  sequential  N clients of the plain pool, each timed alone in its own turn (one after another),
              the turns together as long as one window
  timeslice   N clients of the plain pool timed over one window, no MPS (the driver time-slices)
  mps         N clients started by `mpsd exec --no-shim` under `mpsd run` (private pipe dir), one
              window (no shim in any mode: its cost is measured apart, benchmarks/shim_alloc.py --driver real)
Aggregate throughput = items of all clients / wall time of the mode; p50/p99 latency per client;
GPU memory = the most NVML reported used on device 0 during the mode's windows, plus each
client's own peak (torch.cuda.max_memory_reserved). The split runs two MPS clients started with
`mpsd exec --gpu-compute 25` and `--gpu-compute 75` at a compute-bound batch.

--dry-run: device cpu, tiny models (NumPy when PyTorch is missing), short windows; the MPS mode
runs under the real control binary when one is found (no server starts without a GPU), else is
skipped. Every figure is then marked dry-run: it says the plumbing works, nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
CLIENT = REPO / "benchmarks" / "inference_client.py"
MPSD = [sys.executable, "-m", "mpsd"]
TARGET_MPS_OVER_TIMESLICE = 1.5
TARGET_SPLIT_RATIO, SPLIT_TOLERANCE = 3.0, 0.10
MIN_SLOT = 0.1  # seconds: the shortest turn a sequential client gets


class Pool:
    """Warm clients in --serve mode; ``prefix`` runs each (e.g. ``mpsd exec ... --``)."""

    def __init__(self, n: int, client_args: list[str], prefixes: list[list[str]], env: dict[str, str] | None = None):
        self.procs = []
        for i in range(n):
            cmd = [*prefixes[i % len(prefixes)], sys.executable, str(CLIENT), "--serve", *client_args]
            self.procs.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
            )
        self.ready = [self._read(p, timeout=300) for p in self.procs]

    @staticmethod
    def _read(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"client {proc.args} gave no answer (exit {proc.poll()})")
        return json.loads(box[0])

    def windows(self, plan: list[tuple[int, dict[str, Any]]], timeout: float) -> list[dict[str, Any]]:
        """Send each (client index, command); return the answers in plan order."""
        for i, cmd in plan:
            self.procs[i].stdin.write(json.dumps(cmd) + "\n")
            self.procs[i].stdin.flush()
        return [self._read(self.procs[i], timeout) for i, _ in plan]

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class MemorySampler:
    """The most NVML reports used on device 0 while running; None without NVML (dry-run)."""

    def __init__(self, enabled: bool):
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True) if enabled else None

    def _loop(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            while not self._stop.wait(0.1):
                used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
                self.peak = used if self.peak is None else max(self.peak, used)
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - a missing or failing NVML leaves the figure out, not the benchmark
            self.peak = None

    def __enter__(self) -> "MemorySampler":
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)


def mode_plan(mode: str, n: int, batch: int, start: float, duration: float, gap: float) -> list[tuple[int, dict]]:
    """Commands for one mode: sequential = one window per client, back to back; else one shared window."""
    if mode == "sequential":  # the same wall time as one shared window, taken in turns
        slot = max(duration / n, MIN_SLOT)
        return [(i, {"batch": batch, "start_at": start + i * (slot + gap), "duration": slot}) for i in range(n)]
    return [(i, {"batch": batch, "start_at": start, "duration": duration}) for i in range(n)]


def aggregate(mode: str, n: int, results: list[dict[str, Any]], gap: float) -> dict[str, Any]:
    """One row: aggregate items/s over the mode's wall time, and each client's own figures."""
    items = sum(r["requests"] * r["batch"] for r in results)
    if mode == "sequential":
        wall = sum(r["seconds"] for r in results)  # the gaps between turns are not counted
    else:
        wall = max(r["seconds"] for r in results)
    return {
        "mode": mode,
        "clients": n,
        "aggregate_items_per_s": items / wall if wall else 0.0,
        "per_client": [
            {k: r[k] for k in ("pid", "items_per_s", "p50_ms", "p99_ms", "peak_memory", "late_start_s")}
            for r in results
        ],
        "engine": results[0]["engine"] if results else None,
    }


def run_modes(
    pool: Pool, modes: list[str], clients: list[int], batch: int, args: argparse.Namespace, sample: bool
) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        for n in clients:
            start = time.time() + args.lead
            plan = mode_plan(mode, n, batch, start, args.duration, args.lead)
            with MemorySampler(sample) as mem:
                results = pool.windows(plan, timeout=args.lead * (n + 2) + args.duration * (n + 2) + 120)
            row = aggregate(mode, n, results, args.lead)
            row["gpu_memory_used_max"] = mem.peak
            rows.append(row)
            print(f"  {mode:<10} N={n} batch={batch}: {row['aggregate_items_per_s']:.1f} items/s", flush=True)
    return rows


@contextmanager
def mpsd_node(control: str, work: Path) -> Iterator[dict[str, Any]]:
    """`mpsd run` on a private pipe dir; SIGTERM (then kill) on the way out."""
    pipe, logs, state = work / "pipe", work / "log", work / "state"
    common = ["--control-binary", control, "--pipe-dir", str(pipe), "--log-dir", str(logs), "--state-dir", str(state)]
    log = (work / "mpsd-run.log").open("w")
    proc = subprocess.Popen(
        [
            *MPSD,
            "run",
            *common,
            "--metrics-address",
            "",
            "--active-thread-percentage",
            "100",
            "--health-interval",
            "1s",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([*MPSD, "status", "--json", *common], capture_output=True, cwd=REPO).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mpsd run did not come up (exit {proc.poll()})")
            time.sleep(0.3)
        yield {"pipe": pipe, "common": common, "exec": [*MPSD, "exec", *common]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def split(node: dict[str, Any], client_args: list[str], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    prefixes = [[*node["exec"], "--no-shim", "--gpu-compute", pct, "--"] for pct in ("25", "75")]
    pool = Pool(2, client_args, prefixes)
    try:
        results = pool.windows(mode_plan("split", 2, batch, time.time() + args.lead, args.duration, 0), timeout=300)
    finally:
        pool.close()
    low, high = results
    ratio = high["items_per_s"] / low["items_per_s"] if low["items_per_s"] else float("inf")
    return {
        "batch": batch,
        "items_per_s_25": low["items_per_s"],
        "items_per_s_75": high["items_per_s"],
        "ratio": ratio,
        "target": TARGET_SPLIT_RATIO,
        "within_target": abs(ratio - TARGET_SPLIT_RATIO) <= TARGET_SPLIT_RATIO * SPLIT_TOLERANCE,
    }


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """MPS vs time-slicing aggregate throughput at 4 and 8 clients, per model and batch."""
    index = {(r["model"], r["batch"], r["mode"], r["clients"]): r["aggregate_items_per_s"] for r in rows}
    out = []
    for (model, batch, mode, n), mps in sorted(index.items()):
        ts = index.get((model, batch, "timeslice", n))
        if mode == "mps" and n in (4, 8) and ts:
            out.append(
                {
                    "model": model,
                    "batch": batch,
                    "clients": n,
                    "mps_over_timeslice": mps / ts,
                    "target": TARGET_MPS_OVER_TIMESLICE,
                    "met": mps / ts >= TARGET_MPS_OVER_TIMESLICE,
                }
            )
    return out


def find_control(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    cached = REPO / ".cache" / "mps" / "root" / "usr" / "bin" / "nvidia-cuda-mps-control"
    return shutil.which("nvidia-cuda-mps-control") or (str(cached) if cached.is_file() else None)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device, size = ("cpu", "tiny") if args.dry_run else ("cuda", "full")
    clients = [int(c) for c in args.clients.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    control = find_control(args.control_binary)
    deadline = time.monotonic() + args.budget if args.budget is not None else float("inf")
    out: dict[str, Any] = {
        "dry_run": args.dry_run,
        "device": device,
        "size": size,
        "duration_s": args.duration,
        "control_binary": control,
        "rows": [],
        "split": None,
        "skipped": [],
        "targets": [],
    }

    def time_left(what: str) -> bool:
        """False (and noted) once the budget is spent; the figures so far are saved either way."""
        out["targets"] = verdicts(out["rows"])
        save(out, args.json)
        if time.monotonic() < deadline:
            return True
        out["skipped"].append(f"{what}: skipped, the {args.budget:g}s budget was spent")
        return False

    for model in args.models.split(","):
        if not time_left(model):
            continue
        client_args = ["--model", model, "--device", device, "--size", size, "--warmup", str(args.warmup)]
        print(f"{model}: plain pool of {max(clients)} clients", flush=True)
        pool = Pool(max(clients), client_args, [[]])
        try:
            for batch in batches:
                if time_left(f"{model} batch {batch} sequential/timeslice"):
                    for row in run_modes(pool, ["sequential", "timeslice"], clients, batch, args, not args.dry_run):
                        out["rows"].append({"model": model, "batch": batch, **row})
        finally:
            pool.close()
        if control is None:
            out["skipped"].append(f"{model}: mps mode skipped: no nvidia-cuda-mps-control found")
            continue
        if not time_left(f"{model} mps"):
            continue
        with (
            tempfile.TemporaryDirectory(prefix="mps-", dir=args.work) as tmp,
            mpsd_node(control, Path(tmp)) as node,
        ):
            print(f"{model}: MPS pool of {max(clients)} clients under mpsd", flush=True)
            pool = Pool(max(clients), client_args, [[*node["exec"], "--no-shim", "--"]])
            try:
                for batch in batches:
                    if time_left(f"{model} batch {batch} mps"):
                        for row in run_modes(pool, ["mps"], clients, batch, args, not args.dry_run):
                            out["rows"].append({"model": model, "batch": batch, **row})
            finally:
                pool.close()
            if model == args.split_model and time_left("25/75 split"):
                out["split"] = {"model": model, **split(node, client_args, args.split_batch, args)}
                print(f"  split 25/75 batch={args.split_batch}: ratio {out['split']['ratio']:.2f}", flush=True)
    out["targets"] = verdicts(out["rows"])
    return out


def save(result: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def plot(result: dict[str, Any], directory: Path) -> list[str]:
    """One PNG per model and batch: aggregate items/s against clients, a line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    made = []
    keys = sorted({(r["model"], r["batch"]) for r in result["rows"]})
    for model, batch in keys:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for mode in ("sequential", "timeslice", "mps"):
            pts = sorted(
                (r["clients"], r["aggregate_items_per_s"])
                for r in result["rows"]
                if (r["model"], r["batch"], r["mode"]) == (model, batch, mode)
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xticks(sorted({r["clients"] for r in result["rows"]}))
        tag = " (DRY RUN, CPU)" if result["dry_run"] else ""
        ax.set(title=f"{model}, batch {batch}{tag}", xlabel="concurrent clients", ylabel="items/s (aggregate)")
        ax.legend()
        path = directory / f"inference-{model}-b{batch}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path.name)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny models, short windows")
    ap.add_argument("--clients", default=None, help="concurrent client counts (default 1,2,4,8; dry-run 1,2)")
    ap.add_argument("--models", default="resnet18,encoder")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,8; dry-run 2)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per window (default 1; dry-run 0.3)")
    ap.add_argument(
        "--lead", type=float, default=None, help="seconds before a window for warm-up (default 0.5; dry 0.3)"
    )
    ap.add_argument("--warmup", type=int, default=None, help="requests before each window (default 5; dry-run 1)")
    ap.add_argument("--split-model", default="resnet18")
    ap.add_argument("--split-batch", type=int, default=None, help="batch of the 25/75 split (default 32; dry-run 2)")
    ap.add_argument("--budget", type=float, default=None, help="seconds; parts not started by then are skipped")
    ap.add_argument("--control-binary", default=None)
    ap.add_argument("--work", default=None, help="directory for the temporary pipe dirs (default: system temp)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--plot", default=None, metavar="DIR")
    args = ap.parse_args(argv)
    dry = args.dry_run
    for name, full, tiny in (
        ("clients", "1,2,4,8", "1,2"),
        ("batches", "1,8", "2"),
        ("duration", 1.0, 0.3),
        ("lead", 0.5, 0.3),
        ("warmup", 5, 1),
        ("split_batch", 32, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else full)
    result = measure(args)
    result["command"] = "benchmarks/inference.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.plot:
        result["plots"] = plot(result, Path(args.plot))
    save(result, args.json)
    for t in result["targets"]:
        print(
            f"target {t['model']} b{t['batch']} N={t['clients']}: MPS/time-slicing {t['mps_over_timeslice']:.2f} "
            f"({'met' if t['met'] else 'NOT met'}, target >= {t['target']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
