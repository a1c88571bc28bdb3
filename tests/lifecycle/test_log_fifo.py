"""Hung or contested (issue 33, row 5): the daemon's `log` FIFO is one a tenant can fill.

The control daemon reads `<pipeDir>/log` itself, in a thread of its own, and writes what it
reads to control.log (stdout under ``-f``). A record it cannot parse (48 bytes of zeros will do)
ends that thread; from then on nobody reads the FIFO, and once 64 KiB are queued the daemon's
next log line blocks its main thread in ``write`` for good: it answers no one. Pods get
/dev/null bound over `log`, but the daemon unlinks `log` and makes a new FIFO at each start,
and the kernel then detaches that bind in pods started before: they can write into the new one.
A tenant can therefore produce the silence, so it is never taken for a hang: the verdict is
"contested", reported naming the writers still holding the FIFO, and the daemon left running.
The real daemons, every Debian version; the writer runs as UID 1000.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from mpsd.daemon import logfifo
from mpsd.node import _ready
from tests.daemon.test_genuine import kill_and_reap, start
from tests.lifecycle.test_session_verdicts import read_to_end
from tests.lifecycle.test_supervisor import wait_until

pytestmark = [
    pytest.mark.mps_binary,
    pytest.mark.skipif(os.geteuid() != 0, reason="a writer of another UID needs root"),
]
TENANT = 1000

# Opens the FIFO for writing, writes until it is full (never blocking), writes its PID on the
# pid pipe, then keeps the FIFO open until the release pipe ends (the test closes its end, or
# exits). Pipes, not files under pytest's tmp tree: another pytest session chmods
# /tmp/pytest-of-root back to 0700, and UID 1000 then sees no file there.
FILLER = """
import os, select, sys
path, pid_fd, release_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
try:
    while True:
        os.write(fd, bytes(4096))
except BlockingIOError:
    pass
os.write(pid_fd, str(os.getpid()).encode())
os.close(pid_fd)
select.select([release_fd], [], [], 120)  # readable at end of file: released
"""


class Filler:
    """A UID-1000 process that fills ``<pipeDir>/log`` and holds it open until released."""

    def __init__(self, fifo: str) -> None:
        pid_r, pid_w = os.pipe()
        release_r, self._release = os.pipe()
        try:
            self.proc = subprocess.Popen(
                ["/usr/bin/python3", "-c", FILLER, fifo, str(pid_w), str(release_r)],
                user=TENANT, group=TENANT, extra_groups=[], pass_fds=(pid_w, release_r),
            )
        except BaseException:
            os.close(pid_r)
            os.close(self._release)
            raise
        finally:
            os.close(pid_w)  # the filler's copy is the only one left: end of file once it has written
            os.close(release_r)
        try:
            said = read_to_end(pid_r)
        finally:
            os.close(pid_r)
        assert said, f"the filler exited with {self.proc.wait(30)} before filling the FIFO"
        self.pid = int(said)

    def release(self) -> None:
        os.close(self._release)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.every_mps_version
def test_a_writer_filling_the_log_fifo_after_a_restart_never_gets_the_daemon_killed(make_config, run_supervisor):
    config = make_config(**{"health-timeout": "1s", "verdict-timeout": "2s"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    first = r.sup.status().pid
    os.kill(first, signal.SIGKILL)  # a restart: the new daemon makes a new `log`, pods' /dev/null detached
    wait_until(lambda: r.sup.status().pid not in (None, first) and r.sup.status().state == "running"
               and _ready(r.board)[0], what="the daemon restarted")
    pid, restarts = r.sup.status().pid, r.sup.status().restarts
    filler = Filler(os.path.join(config.pipe_dir, "log"))
    try:
        wait_until(lambda: not _ready(r.board)[0] or r.sup.status().pid != pid, what="readiness lost")
        assert r.sup.status().pid == pid and r.sup.status().restarts == restarts, r.sup.status().last_error
        reason = _ready(r.board)[1]
        assert "log FIFO" in reason and f"pid {filler.pid} " in reason, reason
        time.sleep(4 * config.health_timeout)  # more silent checks: still contested, never killed
        assert r.sup.status().pid == pid and r.sup.status().restarts == restarts, r.sup.status().last_error
        assert os.path.exists(f"/proc/{pid}") and r.sup.status().verdict_age > 0
    finally:
        filler.release()
    time.sleep(2 * config.health_timeout)  # the writer gone, the daemon still blocked: still not killed
    assert r.sup.status().pid == pid and r.sup.status().restarts == restarts, r.sup.status().last_error
    assert "log FIFO" in _ready(r.board)[1] and "no process but the daemon" in _ready(r.board)[1]


@pytest.mark.every_mps_version
def test_a_daemon_blocked_on_its_log_fifo_is_seen_from_its_threads(make_config):
    # logfifo.blocked alone: nothing while the daemon serves; once 48 bytes it cannot parse end
    # its reader thread and the FIFO is full, its main thread is in write() on `log`, the
    # queue is read without taking anything from it, and the writer holding it is named.
    config = make_config()
    daemon = start(config)
    fifo = os.path.join(config.pipe_dir, "log")
    try:
        assert logfifo.blocked(daemon, config.pipe_dir) is None
        filler = Filler(fifo)
        try:
            try:  # a command makes the daemon log a line: it blocks there, and the front-end waits
                subprocess.run([config.control_binary], input="get_server_list\n", timeout=5,
                               env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=config.pipe_dir),
                               capture_output=True, text=True, check=False)
            except subprocess.TimeoutExpired:
                pass
            wait_until(lambda: logfifo.blocked(daemon, config.pipe_dir) is not None, what="the daemon blocked")
            found = logfifo.blocked(daemon, config.pipe_dir)
            assert found is not None and found.fifo == fifo and found.threads, found
            assert found.writers == (filler.pid,), found
            before = found.queued
            assert before is not None and before >= 65536 - 4096, found
            again = logfifo.blocked(daemon, config.pipe_dir)
            assert again is not None and again.queued == before  # looking takes nothing out
        finally:
            filler.release()
        found = logfifo.blocked(daemon, config.pipe_dir)
        assert found is not None and found.writers == ()
    finally:
        kill_and_reap(daemon)
