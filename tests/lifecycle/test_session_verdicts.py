"""Hung or inconclusive (issue 33, rows 3 and 4): a session held on the daemon's control sockets
makes a silent health check inconclusive, never a kill, however the holder hides: a front-end
that forked, exited and left the socket to its child (SO_PEERCRED then names a dead PID), or
a daemon whose descriptors mpsd cannot read (EPERM from pidfd_getfd: Yama ``ptrace_scope=1``
over a daemon that is not mpsd's child, or no CAP_SYS_PTRACE). The real daemons, every
Debian version; the holder runs as UID 1000."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import time

import pytest

from mpsd.daemon import genuine, peer
from mpsd.node import _ready
from tests.daemon.test_genuine import kill_and_reap, start
from tests.lifecycle.test_supervisor import wait_until

pytestmark = [
    pytest.mark.mps_binary,
    pytest.mark.skipif(os.geteuid() != 0, reason="a holder of another UID needs root"),
]
TENANT = 1000

# Connects to the socket, forks, and the parent exits: the child keeps the session, silent,
# until the release pipe ends (the test closes its end, or exits). Its PID goes out on the pid
# pipe. Pipes, not files: a file under pytest's tmp tree stops being reachable to UID 1000 as
# soon as another pytest session starts (it chmods /tmp/pytest-of-root back to 0700), and the
# child then never sees its release and holds the session until its own deadline.
FORKED_HOLDER = """
import os, select, socket, sys
path, pid_fd, release_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
if os.fork():
    os._exit(0)
os.setsid()
os.write(pid_fd, str(os.getpid()).encode())
os.close(pid_fd)
select.select([release_fd], [], [], 120)  # readable at end of file: released
"""


def gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie (its parent exited, so whoever inherits it reaps it
    when it will: in a container that may be never). Its sockets are closed either way."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(b")") + 2:].startswith(b"Z")


def read_to_end(fd: int, timeout: float = 60.0) -> bytes:
    """What is written into the pipe ``fd`` until its writers have all closed it (bounded)."""
    deadline, chunks = time.monotonic() + timeout, []
    while True:
        assert select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0], "timed out reading a pipe"
        chunk = os.read(fd, 64)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


class ForkedHolder:
    """A UID-1000 front-end that connected to ``control`` and left the session to its child."""

    def __init__(self, pipe_dir: str) -> None:
        pid_r, pid_w = os.pipe()
        release_r, self._release = os.pipe()
        try:
            try:
                parent = subprocess.run(
                    ["/usr/bin/python3", "-c", FORKED_HOLDER, os.path.join(pipe_dir, "control"), str(pid_w),
                     str(release_r)],
                    user=TENANT, group=TENANT, extra_groups=[], timeout=60, check=True, pass_fds=(pid_w, release_r),
                )
            finally:
                os.close(pid_w)  # only the child's copy is left: end of file once it has written
                os.close(release_r)
            self.parent = parent.args  # exited: SO_PEERCRED names a PID that is gone
            self.child = int(read_to_end(pid_r))  # the child holding the session
        except BaseException:
            os.close(self._release)  # a child that did start lets go
            raise
        finally:
            os.close(pid_r)

    def release(self) -> None:
        """The child lets go (it closes the session by exiting); SIGKILLed if it does not."""
        os.close(self._release)
        try:
            wait_until(lambda: gone(self.child), what="the holder gone")
        finally:
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.every_mps_version
def test_a_session_left_to_a_forked_child_never_gets_the_daemon_killed(make_config, run_supervisor):
    config = make_config(**{"health-timeout": "1s", "verdict-timeout": "2s"})
    r = run_supervisor(config)
    r.wait_for(lambda s: s.configured, what="configured")
    pid = r.sup.status().pid
    holder = ForkedHolder(config.pipe_dir)
    try:
        wait_until(lambda: not _ready(r.board)[0] or r.sup.status().pid != pid, what="readiness lost")
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0, r.sup.status().last_error
        reason = _ready(r.board)[1]
        assert "no health verdict" in reason and "exited: a process it passed the socket to" in reason, reason
        time.sleep(4 * config.health_timeout)  # more silent checks while it is held: still not killed
        assert r.sup.status().pid == pid and r.sup.status().restarts == 0, r.sup.status().last_error
    finally:
        holder.release()
    wait_until(lambda: _ready(r.board)[0], what="ready again once the child let go")
    assert r.sup.status().pid == pid and r.sup.status().restarts == 0


def test_sessions_follow_the_socket_not_the_pid(make_config):
    # peer.sessions, alone: the session is held while the child holds the socket, although the
    # PID SO_PEERCRED names has exited; released, it is not held any more.
    config = make_config()
    daemon = start(config)
    try:
        holder = ForkedHolder(config.pipe_dir)
        try:
            found = peer.sessions(daemon, config.pipe_dir)
            assert found.unreadable == "" and len(found.peers) == 1, found
            (connected, uid), = found.peers
            assert uid == TENANT and connected != holder.child and not peer.alive(connected)
        finally:
            holder.release()
        wait_until(lambda: peer.sessions(daemon, config.pipe_dir).peers == (), what="the session gone")
    finally:
        kill_and_reap(daemon)


CAP_SYS_PTRACE = 19


def drop_ptrace_in_this_thread() -> None:
    """Take CAP_SYS_PTRACE out of the calling thread's effective and permitted sets (capset acts
    on one thread): it can then no longer read the descriptors of a process whose capabilities
    are not a subset of its own, as Yama ptrace_scope=1 forbids it for a non-descendant."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    data[0].effective &= ~(1 << CAP_SYS_PTRACE)
    data[0].permitted &= ~(1 << CAP_SYS_PTRACE)
    assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.every_mps_version
def test_sessions_mpsd_cannot_read_are_inconclusive_never_a_kill(make_config, run_supervisor):
    # An adopted daemon (started detached, with every capability; not mpsd's child), then the
    # supervisor's own thread loses CAP_SYS_PTRACE (the status callback runs in it): pidfd_getfd
    # and /proc/PID/fd/N answer EPERM/EACCES, as under Yama. A held session then makes the
    # checks silent: "cannot read" is inconclusive, reported with why, never a kill.
    config = make_config(**{"daemon-lifecycle": "independent", "health-timeout": "1s", "verdict-timeout": "2s"})
    daemon = start(config)
    dropped: list[bool] = []

    def on_status(status) -> None:
        if status.state == "running" and not dropped:
            drop_ptrace_in_this_thread()
            dropped.append(True)

    try:
        r = run_supervisor(config, on_status=on_status)
        r.wait_for(lambda s: s.daemon_up and s.configured and dropped, what="adopted, CAP_SYS_PTRACE dropped")
        holder = ForkedHolder(config.pipe_dir)
        try:
            wait_until(lambda: not _ready(r.board)[0] or r.sup.status().pid != daemon, what="readiness lost")
            assert r.sup.status().pid == daemon and r.sup.status().restarts == 0, r.sup.status().last_error
            reason = _ready(r.board)[1]
            assert "cannot read the daemon's descriptors" in reason and "CAP_SYS_PTRACE" in reason, reason
            time.sleep(4 * config.health_timeout)
            assert r.sup.status().pid == daemon and os.path.exists(f"/proc/{daemon}"), r.sup.status().last_error
        finally:
            holder.release()
        wait_until(lambda: _ready(r.board)[0], what="ready again once released")
        assert r.sup.status().pid == daemon
        r.stop()
    finally:
        while (pid := genuine.control_lock_holder(config.pipe_dir)) is not None:
            kill_and_reap(pid)
