"""Recovery after SIGKILL of the MPS control daemon, against the real nvidia-cuda-mps-control.

    .venv/bin/python benchmarks/recovery.py [--kills 50] [--control-binary PATH]

Runs the supervisor (default restart backoff: 0.2s initial) in this process with defaults to
apply (active threads 50%, pinned limits 0=2G,1=1044M, client priority 1). Each round waits
until the daemon has passed a periodic health check (so the failure count is back to 0),
SIGKILLs it, and times kill -> a new daemon whose defaults an independent front-end call
reads back. Prints the median, p90 and worst of those times.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mpsd import config as cfg  # noqa: E402
from mpsd.daemon.control import Control  # noqa: E402
from mpsd.errors import ControlError  # noqa: E402
from mpsd.lifecycle.health import HealthBoard  # noqa: E402
from mpsd.lifecycle.supervisor import Supervisor  # noqa: E402

G = 1 << 30


def verified(control: Control) -> bool:
    try:
        return (
            control.get_default_active_thread_percentage() == 50.0
            and control.get_default_device_pinned_mem_limit(0) == 2 * G
            and control.get_default_device_pinned_mem_limit(1) == 1 * G
            and control.get_default_client_priority() == 1
        )
    except ControlError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--control-binary", default=None)
    parser.add_argument("--health-interval", default="0.5s")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    binary = args.control_binary
    if binary is None:
        from tests.mpsbin import ensure_mps_control

        binary = str(ensure_mps_control())
    base = Path(tempfile.mkdtemp(prefix="mpsd-bench-"))
    config = cfg.load(
        None,
        {},
        {
            "control-binary": binary,
            "pipe-dir": str(base / "pipe"),
            "log-dir": str(base / "log"),
            "active-thread-percentage": "50",
            "pinned-mem-limit": "0=2G,1=1044M",
            "client-priority": "1",
            "health-interval": args.health_interval,
            "metrics-address": "",
        },
    )
    board = HealthBoard()
    sup = Supervisor(config, board)
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    probe = Control(binary, config.pipe_dir, timeout=5)
    times: list[float] = []
    checks_before = 0
    try:
        for round_ in range(args.kills):
            deadline = time.monotonic() + 60
            while not (board.current().configured and sup.status().health_checks > checks_before):
                if time.monotonic() > deadline:
                    raise SystemExit(f"round {round_}: daemon never settled: {sup.status()}")
                time.sleep(0.02)
            victim = sup.status().pid
            assert victim is not None
            began = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while not (sup.status().pid not in (None, victim) and board.current().configured and verified(probe)):
                if time.monotonic() - began > 60:
                    raise SystemExit(f"round {round_}: no recovery in 60s: {sup.status()}")
                time.sleep(0.005)
            times.append(time.monotonic() - began)
            checks_before = sup.status().health_checks  # next round: after a periodic check of this daemon
    finally:
        sup.stop()
        thread.join(30)
        shutil.rmtree(base, ignore_errors=True)
    times.sort()
    p90 = times[max(0, int(len(times) * 0.9) - 1)]
    print(
        f"kills={len(times)} restarts={sup.status().restarts} kill->verified-healthy: "
        f"median={statistics.median(times) * 1000:.0f}ms p90={p90 * 1000:.0f}ms worst={times[-1] * 1000:.0f}ms "
        f"best={times[0] * 1000:.0f}ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
