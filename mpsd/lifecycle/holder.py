"""``mpsd holder``: keeps one pipe dir's ``nvidia-cuda-mps-control -f`` running, and nothing else.

The holder is the daemon's parent under ``daemonLifecycle: independent``: it starts the daemon,
copies its output to logDir/control.log, starts it again with backoff when it exits, and quits it
on SIGTERM — the one way to stop the daemon on purpose while a holder runs. It reads no GPU, serves
no metrics, sets no defaults and sends the daemon no command but ``quit``: everything that changes
from release to release is in ``mpsd run``, which adopts the holder's daemon and supervises it
(health, defaults, FAULT, killing it when it hangs: the holder then starts a new one). So the
holder is installed once and rarely upgraded (its own DaemonSet with ``updateStrategy: OnDelete``,
or its own systemd unit), while ``mpsd run`` rolls.

Its contract with ``mpsd run``: a POSIX write lock on its lock file in ``stateDir/locks``
(mpsd.daemon.dirs.lock_path: where no pod can open it) for the holder's life (``F_GETLK``
names its PID), and the daemon's own sockets and ``control_lock``. A daemon that runs when the
holder starts (one ``mpsd run`` started detached while no holder ran) is waited for, not
replaced: the holder starts its own once that one exits. A write lock on ``control_lock`` is a
daemon's only once its holder is proven one (mpsd.daemon.genuine.daemon_lock_holder): a local
user waiting for that lock on the 0666 file is nobody, and the file is replaced.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import signal
import sys
import time
from pathlib import Path

from .. import config as cfg
from ..daemon import dirs, genuine, multiuser, peer
from ..daemon.control import Control
from ..daemon.process import DaemonProcess, quit_daemon
from ..errors import SetupError
from .independent import HOLDER
from .supervisor import backoff_delay

log = logging.getLogger(__name__)

FOREIGN_POLL = 1.0  # seconds between looks at a daemon the holder did not start, besides its pidfd


def hold_lock(config: cfg.Config) -> int:
    """Create and check the pipe dir, then take the holder's lock (in stateDir) for the
    caller's life (the fd returned). SetupError naming the other holder's PID when one runs."""
    pipe = Path(os.path.normpath(config.pipe_dir))
    if not pipe.is_absolute():
        raise SetupError(f"pipe dir {config.pipe_dir!r}: expected an absolute path")
    dirs.ensure_dir(pipe, 0o755, "pipe dir")
    fd, path = dirs.open_lock(config.state_dir, str(pipe), HOLDER)
    try:
        kind, pid = _lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    if kind is None:
        return fd
    os.close(fd)
    raise SetupError(
        f"pipe dir {pipe}: another mpsd holder (pid {pid or 'unknown'}) holds {path}; one holder per pipe dir"
    )


def _lock(fd: int, path: Path) -> tuple[int | None, int]:
    """(None, 0) once ``fd`` is write-locked; else the kind and PID of the lock in the way."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None, 0
    except OSError:
        return genuine.lock_holder(fd)


class Holder:
    """The loop: start the daemon, wait for its exit or SIGTERM, back off, start it again."""

    def __init__(self, config: cfg.Config) -> None:
        self.config = config
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._failures = 0

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self._events.put(("stop",)))
        signal.signal(signal.SIGINT, lambda *_: self._events.put(("stop",)))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nothing to reload: what changes is mpsd run's

    def stop(self) -> None:
        self._events.put(("stop",))

    def run(self) -> int:
        """Until SIGTERM (stop()); 0 then. The daemon is started multi-user where multiUser and
        the binary allow (mpsd.daemon.multiuser, asked of the binary once)."""
        c = self.config
        policy = multiuser.resolve(c.multi_user, c.control_binary, c.health_timeout)
        log.info("%s", multiuser.describe_policy(policy))
        while True:
            foreign = genuine.daemon_lock_holder(self.config.pipe_dir, c.control_binary)
            if foreign is not None:
                if self._await_foreign(foreign):
                    return 0
                continue
            try:
                dirs.prepare(self.config.pipe_dir, self.config.log_dir, c.control_binary)
                daemon = DaemonProcess(self.config, lambda d, code: self._events.put(("exited", d, code)),
                                       options=policy.options)
            except SetupError as exc:
                if self._back_off(f"cannot start the daemon: {exc}"):
                    return 0
                continue
            if self._serve(daemon):
                return 0

    def _serve(self, daemon: DaemonProcess) -> bool:
        """Until the daemon exits (False: start another) or a stop (True: it is quit)."""
        while True:
            event = self._events.get()
            if event[0] == "stop":
                how = quit_daemon(self._control(), daemon, self.config.shutdown_timeout)
                log.info("daemon pid=%d %s", daemon.pid, how)
                return True
            if event[0] == "exited" and event[1] is daemon:
                break
        daemon.kill()  # its servers, if any are left
        if time.monotonic() - daemon.started >= self.config.restart_backoff_max:
            self._failures = 0  # it ran long enough: not a crash loop
        return self._back_off(f"daemon pid={daemon.pid} exited with status {event[2]}")

    def _back_off(self, message: str) -> bool:
        """Log the failure, wait the backoff; True if a stop came meanwhile."""
        self._failures += 1
        c = self.config
        delay = backoff_delay(self._failures, c.restart_backoff_initial, c.restart_backoff_max)
        if self._failures >= 3:
            log.error("%s; crash loop: %d failures in a row, next start in %.1fs", message, self._failures, delay)
        else:
            log.warning("%s; restarting in %.1fs", message, delay)
        return self._sleep(delay)

    def _await_foreign(self, pid: int) -> bool:
        """A daemon this holder did not start holds the pipe dir: wait for it to exit (True if
        a stop came first). Its exit is not a failure of the holder's."""
        log.warning(
            "pipe dir %s: a control daemon the holder did not start runs (%s): starting one once it exits",
            self.config.pipe_dir, peer.describe(pid),
        )  # fmt: skip
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return False  # gone already
        try:
            while not genuine.exited(pidfd) and genuine.control_lock_holder(self.config.pipe_dir) == pid:
                if self._sleep(FOREIGN_POLL, pidfd):
                    return True
        finally:
            os.close(pidfd)
        log.info("the control daemon pid=%d exited: the holder starts its own", pid)
        return False

    def _sleep(self, seconds: float, pidfd: int | None = None) -> bool:
        """Wait ``seconds`` (less if ``pidfd`` turns readable); True if a stop came."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._events.get(timeout=min(left, 0.05 if pidfd is not None else left))
            except queue.Empty:
                if pidfd is not None and genuine.exited(pidfd):
                    return False
                continue
            if event[0] == "stop":
                return True
        return False

    def _control(self) -> Control:
        c = self.config
        return Control(c.control_binary, c.pipe_dir, c.log_dir, c.shutdown_timeout)


def holder_main(config: cfg.Config) -> int:
    """``mpsd holder``: 0 after SIGTERM; SetupError (exit 1) when another holder runs or the
    pipe dir cannot be trusted."""
    from ..logs import LOG_FORMAT

    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger().setLevel(config.log_level.upper())
    holder = Holder(config)
    holder.install_signal_handlers()
    lock = hold_lock(config)
    try:
        log.info("holder pid=%d pipe_dir=%s control_binary=%s", os.getpid(), config.pipe_dir, config.control_binary)
        return holder.run()
    finally:
        os.close(lock)
