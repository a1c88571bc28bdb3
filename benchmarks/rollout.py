"""mpsd replaced under a running MPS control daemon (``daemonLifecycle: independent``), with the
real nvidia-cuda-mps-control: what a DaemonSet rollout, a crash or a config change costs.

    .venv/bin/python benchmarks/rollout.py [--rounds 30] [--no-holder] [--control-binary PATH]

The daemon is kept by an ``mpsd holder`` (the Kubernetes and systemd layout; ``--no-holder``: the
first ``mpsd run`` starts it detached). An ``mpsd exec`` client (the fake CUDA driver under
libmpsshim.so) holds 1 GiB in its region throughout. Each round replaces the running ``mpsd run``
three ways: SIGTERM then a new one; SIGKILL then a new one; SIGTERM then one with another
activeThreadPercentage (a config change; the next round changes it back). After each it checks,
and stops on the first miss: the daemon's PID unchanged, no ``quit`` in control.log, the defaults
as configured (the same, or the new percentage), the server list unchanged, the exec client
running and its region's accounting unchanged as the new mpsd exports it. Prints, per kind, p50,
p99 and the worst time from the new mpsd's spawn to its first /readyz 200, and how much of it
was the interpreter starting and importing (spawn to mpsd's first log record) rather than the
adoption (first log record to ready: NVML, the metrics server, the proof, one health check).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes import build_fake_cuda  # noqa: E402
from tests.rollout import Node, read, stop, wait_until  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
G = 1 << 30


def percentile(values: list[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def first_record(run: subprocess.Popen) -> float:
    """The wall-clock time of mpsd's first log record (its config line, after the imports)."""
    line = read(run).splitlines()[0]
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def build(work: Path) -> tuple[Path, Path]:
    """libmpsshim.so from csrc/ and the fake libcuda.so.1, built under ``work``."""
    shim = work / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(REPO / "csrc"), f"OUT={shim}", "lib"], check=True)
    return shim, build_fake_cuda(work / "fakecuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-holder", action="store_true")
    parser.add_argument("--control-binary", default=None)
    args = parser.parse_args()
    binary = args.control_binary
    if binary is None:
        from tests.mpsbin import ensure_mps_control

        binary = str(ensure_mps_control())
    work = Path(tempfile.mkdtemp(prefix="mpsd-roll-", dir="/tmp"))
    work.chmod(0o711)
    shim, fakes = build(work / "build")
    node = Node(work / "n", Path(binary), shim, fakes)
    node.work.mkdir()
    times: dict[str, list[float]] = {"sigterm": [], "sigkill": [], "config": []}
    imports: dict[str, list[float]] = {kind: [] for kind in times}  # spawn -> mpsd's first log record
    try:
        if not args.no_holder:
            node.spawn("holder")
            wait_until(node.daemon_pid, "the holder's daemon")
        run, _ = node.start_timed()
        client = node.exec_client("web", "1G")
        daemon, servers, quits = node.daemon_pid(), node.servers(), node.quits()
        region = wait_until(lambda: node.metric("mpsd_region_memory_used_bytes"), "the region's series")
        percent = 50
        for round_ in range(args.rounds):
            for kind in times:
                sig = signal.SIGKILL if kind == "sigkill" else signal.SIGTERM
                code = stop(run, sig)
                assert code == (-9 if kind == "sigkill" else 0), (kind, code, read(run))
                if kind == "config":
                    percent = 60 if percent == 50 else 50
                began = time.time()
                run, seconds = node.start_timed(**{"active-thread-percentage": str(percent)})
                times[kind].append(seconds)
                imports[kind].append(first_record(run) - began)
                where = f"round {round_} {kind}"
                assert node.daemon_pid() == daemon, f"{where}: daemon {daemon} replaced by {node.daemon_pid()}"
                assert node.quits() == quits, f"{where}: quit sent to the daemon"
                assert node.defaults() == (percent, 2 * G, 1), f"{where}: defaults {node.defaults()}"
                assert node.servers() == servers, f"{where}: servers {servers} -> {node.servers()}"
                assert client.poll() is None, f"{where}: the exec client exited:\n{read(client)}"
                now = wait_until(lambda: node.metric("mpsd_region_memory_used_bytes"), f"{where}: region series")
                assert now == region, f"{where}: region accounting {region} -> {now}"
    finally:
        node.close()
        shutil.rmtree(work, ignore_errors=True)
    layout = "detached (no holder)" if args.no_holder else "kept by mpsd holder"
    print(f"daemon {layout}; {args.rounds} rounds; mpsd spawn -> /readyz 200:")
    for kind, values in times.items():
        adoption = [total - start for total, start in zip(values, imports[kind], strict=True)]
        print(f"  {kind:8} n={len(values)} p50={percentile(values, 50) * 1000:.0f}ms "
              f"p99={percentile(values, 99) * 1000:.0f}ms max={max(values) * 1000:.0f}ms; "
              f"of which interpreter+imports p50={percentile(imports[kind], 50) * 1000:.0f}ms, "
              f"first record->ready p50={percentile(adoption, 50) * 1000:.0f}ms "
              f"p99={percentile(adoption, 99) * 1000:.0f}ms")  # fmt: skip
    print(f"  daemon pid {daemon} unchanged, {quits} quit(s) in control.log, servers {servers}, region {region}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
