"""Duration of one periodic health check, against the real nvidia-cuda-mps-control.

    .venv/bin/python benchmarks/health_round.py [--rounds 50] [--repo PATH] [--control-binary PATH]

Runs the supervisor in this process (health every 0.2s, two managed GPUs, pinned limits
0=2G,1=1044M) and records ``health_latency`` of each periodic check: the control-socket
checks and every front-end command of the round. ``--repo`` runs another checkout's mpsd
(e.g. main, for a before/after). Prints the median, p90 and worst.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--control-binary", default="")
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    from mpsd import config as cfg
    from mpsd.lifecycle.health import HealthBoard
    from mpsd.lifecycle.supervisor import Supervisor

    here = Path(__file__).resolve().parent.parent
    sys.path.insert(1, str(here))
    from tests.mpsbin import ensure_mps_control

    binary = args.control_binary or str(ensure_mps_control())
    base = Path(tempfile.mkdtemp(prefix="mpsd-hb-", dir="/tmp"))
    latencies: list[float] = []
    done = threading.Event()

    def observe(status) -> None:
        if status.health_latency is not None and status.health_checks > len(latencies):
            latencies.append(status.health_latency)
            if len(latencies) >= args.rounds:
                done.set()

    config = cfg.load(
        None,
        {},
        {
            "control-binary": binary,
            "pipe-dir": str(base / "pipe"),
            "log-dir": str(base / "log"),
            "state-dir": str(base / "state"),
            "metrics-address": "",
            "health-interval": "0.2s",
            "pinned-mem-limit": "0=2G,1=1044M",
        },
    )
    sup = Supervisor(config, HealthBoard(), gpu_indices=lambda: [0, 1], on_status=observe)
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        if not done.wait(60 + args.rounds):
            print(f"only {len(latencies)} rounds", file=sys.stderr)
            return 1
    finally:
        sup.stop()
        thread.join(30)
        shutil.rmtree(base, ignore_errors=True)
    ms = sorted(x * 1000 for x in latencies)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    median = statistics.median(ms)
    print(f"repo={args.repo} rounds={len(ms)} median={median:.1f}ms p90={p90:.1f}ms worst={ms[-1]:.1f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
