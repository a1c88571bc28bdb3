"""Signal handlers only enqueue, and must do so safely while the loop is inside its own get()."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Signals arrive every 0.2 ms while the main thread takes events off the queue, as the
# supervisor loop does: with a non-reentrant queue a handler lands inside get() while it holds
# the queue's lock and the process deadlocks or dies.
STORM = """
import queue, signal, sys, time
from mpsd import config as cfg
from mpsd.lifecycle.health import HealthBoard
from mpsd.lifecycle.supervisor import Supervisor

sup = Supervisor(cfg.default_config(), HealthBoard())
sup.install_signal_handlers()
signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGHUP))
signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
taken, end = 0, time.monotonic() + 1.5
while time.monotonic() < end:
    try:
        event = sup._events.get(timeout=0.001)
        assert event == ("reload",), event
        taken += 1
    except queue.Empty:
        pass
signal.setitimer(signal.ITIMER_REAL, 0)
print("taken", taken)
"""


def test_signal_storm_while_the_loop_takes_events():
    proc = subprocess.run([sys.executable, "-c", STORM], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 100, proc.stdout
