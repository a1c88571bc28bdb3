"""mpsd replaced under a running MPS control daemon (``daemonLifecycle: independent``), with the
real nvidia-cuda-mps-control: what a DaemonSet rollout, a crash or a config change costs.

    .venv/bin/python benchmarks/rollout.py [--rounds 30] [--no-holder] [--surge] [--control-binary PATH]

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

``--surge``: the DaemonSet's maxSurge rollout instead (mpsd/lifecycle/standby.py). Each round starts a new
``mpsd run`` (a POD_UID of its own, its own metrics port) beside the running one, waits for its
/readyz 200 (it stands by), then SIGTERMs the old one, as the DaemonSet controller does once the
new pod is Ready, and waits for the new one to adopt the daemon; the next round replaces that
one in turn. The same checks after each round, plus: the new mpsd's /readyz, polled every 5 ms
from its first 200 until 0.5 s after the adoption, never answered anything else. Prints p50,
p99 and the worst of: spawn to /readyz 200, spawn to the adoption (its log record), and the old
mpsd's SIGTERM to the adoption (the old one's shutdown, then the standby's next try of the lock).
No kubelet face runs here: /readyz is the standby's proof of the daemon
(tests/lifecycle/test_standby_faces.py runs the same sequence with the DRA and device plugin faces).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes import build_fake_cuda  # noqa: E402
from tests.rollout import Node, free_port, http_get, read, stop, wait_until  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
G = 1 << 30


def percentile(values: list[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def first_record(run: subprocess.Popen, containing: str = "") -> float:
    """The wall-clock time of mpsd's first log record (its config line, after the imports), or
    of its first record ``containing`` a text."""
    line = next(line for line in read(run).splitlines() if containing in line)
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def summary(label: str, values: list[float]) -> str:
    return (f"{label} p50={percentile(values, 50) * 1000:.0f}ms p99={percentile(values, 99) * 1000:.0f}ms "
            f"max={max(values) * 1000:.0f}ms")


class ReadyWatch:
    """/readyz on ``port`` every 5 ms in a thread until ``stop()``: the answers other than 200."""

    def __init__(self, port: int) -> None:
        self.port, self.misses, self._stop = port, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            code, body = http_get(self.port, "/readyz")
            if code != 200:
                self.misses.append(f"{code} {body.strip()}")

    def stop(self) -> list[str]:
        self._stop.set()
        self.thread.join(10)
        return self.misses


def surge(node: Node, run: subprocess.Popen, rounds: int, check) -> dict[str, list[float]]:
    """The maxSurge rounds (see the module docstring) from the running ``run``; ``check(where)``
    after each."""
    times: dict[str, list[float]] = {"spawn->ready": [], "spawn->adopted": [], "sigterm->adopted": []}
    daemon = node.daemon_pid()
    for round_ in range(rounds):
        where = f"surge round {round_}"
        port = free_port()
        began = time.time()
        new, seconds = node.start_timed({"POD_UID": str(uuid.uuid4())}, port=port)
        assert "standing by" in read(new), f"{where}: not standing by:\n{read(new)}"
        watch = ReadyWatch(port)
        times["spawn->ready"].append(seconds)
        term = time.time()
        assert stop(run) == 0, f"{where}: the old mpsd:\n{read(run)}"
        adopted = f"adopted the running control daemon pid={daemon}"
        wait_until(lambda: adopted in read(new), f"{where}: the adoption")  # noqa: B023
        time.sleep(0.5)
        misses = watch.stop()
        assert misses == [], f"{where}: /readyz of the new mpsd: {misses[:5]}"
        at = first_record(new, adopted)
        times["spawn->adopted"].append(at - began)
        times["sigterm->adopted"].append(at - term)
        run = new
        node.port = port  # the checks read the supervisor's metrics
        check(where)
    return times


def build(work: Path) -> tuple[Path, Path]:
    """libmpsshim.so from csrc/ and the fake libcuda.so.1, built under ``work``."""
    shim = work / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(REPO / "csrc"), f"OUT={shim}", "lib"], check=True)
    return shim, build_fake_cuda(work / "fakecuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-holder", action="store_true")
    parser.add_argument("--surge", action="store_true", help="the maxSurge rollout (a standby beside the old one)")
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
    percent = 50
    try:
        if not args.no_holder:
            node.spawn("holder")
            wait_until(node.daemon_pid, "the holder's daemon")
        run, _ = node.start_timed({"POD_UID": str(uuid.uuid4())} if args.surge else None)
        client = node.exec_client("web", "1G")
        daemon, servers, quits = node.daemon_pid(), node.servers(), node.quits()
        region = wait_until(lambda: node.metric("mpsd_region_memory_used_bytes"), "the region's series")

        def check(where: str) -> None:
            assert node.daemon_pid() == daemon, f"{where}: daemon {daemon} replaced by {node.daemon_pid()}"
            assert node.quits() == quits, f"{where}: quit sent to the daemon"
            assert node.defaults() == (percent, 2 * G, 1), f"{where}: defaults {node.defaults()}"
            assert node.servers() == servers, f"{where}: servers {servers} -> {node.servers()}"
            assert client.poll() is None, f"{where}: the exec client exited:\n{read(client)}"
            now = wait_until(lambda: node.metric("mpsd_region_memory_used_bytes"), f"{where}: region series")
            assert now == region, f"{where}: region accounting {region} -> {now}"

        if args.surge:
            times = surge(node, run, args.rounds, check)
        for round_ in range(0 if args.surge else args.rounds):
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
                check(f"round {round_} {kind}")
    finally:
        node.close()
        shutil.rmtree(work, ignore_errors=True)
    layout = "detached (no holder)" if args.no_holder else "kept by mpsd holder"
    if args.surge:
        print(f"daemon {layout}; {args.rounds} maxSurge rounds (a standby beside the running mpsd, then SIGTERM "
              "to the old one):")  # fmt: skip
        for kind, values in times.items():
            print(f"  {summary(f'{kind:16} n={len(values)}', values)}")
    else:
        print(f"daemon {layout}; {args.rounds} rounds; mpsd spawn -> /readyz 200:")
        for kind, values in times.items():
            adoption = [total - start for total, start in zip(values, imports[kind], strict=True)]
            print(f"  {summary(f'{kind:8} n={len(values)}', values)}; "
                  f"of which interpreter+imports p50={percentile(imports[kind], 50) * 1000:.0f}ms, "
                  f"first record->ready p50={percentile(adoption, 50) * 1000:.0f}ms "
                  f"p99={percentile(adoption, 99) * 1000:.0f}ms")  # fmt: skip
    print(f"  daemon pid {daemon} unchanged, {quits} quit(s) in control.log, servers {servers}, region {region}, "
          "the exec client running throughout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
