"""A second ``mpsd run`` on a pipe dir another one holds, during a rollout: it stands by.

Only one ``mpsd run`` supervises a pipe dir (the flock on its run lock in ``stateDir/locks``,
where no pod can open it: mpsd/daemon/dirs.py). A
DaemonSet rolling with ``maxSurge`` starts the new mpsd pod while the old one still runs on
the node, and deletes the old one only once the new one is Ready: a new mpsd that exited there
would crash-loop and stall the rollout for good. So, under ``daemonLifecycle: independent``
and as one instance of a rollout, the new one stands by:

- **An instance of a rollout** is an mpsd with ``POD_UID`` set (the DaemonSet sets it from
  the downward API). The same variable gives its kubelet sockets names of their own
  (mpsd/alloc/served.py), without which two instances' faces could not serve side by side at
  all. Without it (bare metal, systemd, a second mpsd started by hand) or under ``owned`` (the
  daemon goes with the old mpsd), the second one exits 1 naming the first, as before.
- **While standing by** it serves its own kubelet faces (its DRA plugin and device plugin
  instances: the kubelet moves to the newest), /healthz, /readyz and /metrics
  (``mpsd_standby`` 1), and never sends the daemon a command.
- **Ready** while its faces serve and the daemon is supervised by the other instance: the
  lock is held by a live process (the failed ``flock``: the kernel drops a lock with the last
  descriptor of the process that took it, and only root or mpsd's user can open the 0600 file
  in a state dir mpsd checked, which no pod is handed) and the daemon on the pipe dir is proven genuine
  (mpsd.daemon.genuine.prove: SO_PEERCRED, F_GETLK, /proc; it connects to the sockets and sends
  nothing), every healthInterval. What the other supervisor's health checks find (a FAULT, a
  hang) is not seen here: that one's /readyz says it.
- **Taking over**: the lock is tried every POLL seconds, and at once when the holder's pidfd
  says it exited. With the lock this mpsd is the supervisor: ``Supervisor.run`` proves the
  daemon again and adopts it (mpsd/lifecycle/independent.py): no restart, no ``quit``, no server touched.
- **SIGTERM or SIGINT while standing by**: the faces stop and ``mpsd run`` exits 0, having
  sent the daemon nothing; prepared claims and allocations stay for the other instance.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from typing import Callable, Mapping

from .. import config as cfg
from ..daemon import dirs, genuine, peer
from .health import HealthBoard

log = logging.getLogger(__name__)

POLL = 0.05  # seconds between two tries of the pipe dir's lock, at most (each: a few stat calls and a flock)


def instance_of(config: cfg.Config, environ: Mapping[str, str] = os.environ) -> str:
    """The instance name (``POD_UID``) under which this mpsd may stand by; "" when it may not."""
    if config.daemon_lifecycle != "independent":
        return ""
    from ..alloc.served import instance_id  # grpc: imported only on this path

    return instance_id(environ)


class Standby:
    """Stands by until the holder of the pipe dir's lock is gone (see the module docstring).
    Built in place of the lock (:meth:`instead_of`); ``fd`` is the lock once taken."""

    def __init__(self, config: cfg.Config, held: dirs.PipeDirHeld, instance: str, poll: float = POLL) -> None:
        self.config, self.instance, self.poll = config, instance, poll
        self.fd: int | None = None
        self.stopped = False
        self.waiting = True  # until the lock is taken or the standby stopped (/healthz: live meanwhile)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._board: HealthBoard | None = None
        self._metrics = None
        self._on_observe: Callable[[], None] = lambda: None
        self._holder: int | None = None
        self._holder_fd: int | None = None  # a pidfd of the holder, readable once it exits
        self._said = "-"
        self._began = time.monotonic()
        self._follow(held.pid)
        log.info("pipe dir %s: another mpsd run (%s) holds %s: standing by as instance %s until it exits "
                 "(daemonLifecycle independent; the kubelet faces serve meanwhile)", config.pipe_dir,
                 self._who(), dirs.lock_path(config.state_dir, config.pipe_dir, "run"), instance)  # fmt: skip

    @classmethod
    def instead_of(cls, config: cfg.Config, held: dirs.PipeDirHeld, environ: Mapping[str, str] = os.environ,
                   poll: float = POLL) -> Standby:  # fmt: skip
        """A standby for ``config`` whose pipe dir is ``held``, its SIGTERM and SIGINT handlers
        installed; ``held`` raised again when this mpsd is no instance of a rollout."""
        instance = instance_of(config, environ)
        if not instance:
            raise held
        standby = cls(config, held, instance, poll)
        standby.install_signal_handlers()
        return standby

    # ---- signals (main thread)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())

    def stop(self) -> None:
        """End the standby (safe in a signal handler and from any thread)."""
        self.stopped = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    # ---- what the probes and metrics show

    def attach(self, board: HealthBoard, metrics=None, on_observe: Callable[[], None] | None = None) -> None:
        """Show the standby on ``board`` (read by /readyz and the faces) and ``metrics``, and
        call ``on_observe`` after each look at the daemon (the NVML pump's refresh)."""
        self._board, self._metrics = board, metrics
        if on_observe is not None:
            self._on_observe = on_observe
        if metrics is not None:
            metrics.set_standby(True)
        self.observe()

    def observe(self) -> bool:
        """Prove the pipe dir's daemon genuine (no command sent); True when it is. The board
        then says up and configured (by the other supervisor), else why not."""
        c = self.config
        proof = genuine.prove(c.pipe_dir, c.control_binary)
        if proof.pidfd is not None:
            os.close(proof.pidfd)
        if proof.pid is not None:
            reason = ""
            said = f"standing by: the control daemon pid={proof.pid} is genuine, supervised by mpsd run {self._who()}"
        else:
            reason = f"standing by for mpsd run {self._who()}: " + (
                proof.problem or f"no control daemon on pipe dir {c.pipe_dir}")  # fmt: skip
            said = reason
        if said != self._said:
            log.log(logging.WARNING if reason else logging.INFO, "%s", said)
            self._said = said
        if self._board is not None:
            self._board.update(daemon_up=not reason, configured=not reason, last_error=reason, unverified="")
        if self._metrics is not None:
            self._metrics.set_daemon_up(not reason)
        self._on_observe()
        return not reason

    # ---- waiting

    def take_over(self, install_signal_handlers: Callable[[], None]) -> bool:
        """Wait for the lock; with it, hand the signals to the supervisor (``install_signal_handlers``).
        True when this mpsd is to supervise now, False when it was stopped first (``fd`` is
        then still to be released if it was taken)."""
        if self.wait() is None:
            return False
        install_signal_handlers()
        return not self.stopped  # a SIGTERM between the lock and the supervisor's handlers

    def wait(self) -> int | None:
        """The pipe dir's lock once its holder lets it go (kept in ``fd``); None when stopped
        first. SetupError (one line) if the pipe dir becomes one mpsd must not use."""
        interval = max(self.config.health_interval, self.poll)
        next_look = time.monotonic() + interval
        while not self.stopped:
            try:  # no PID yet: a holder that has just taken it, or one letting it go (tried again soon)
                self.fd = dirs.hold_pipe_dir(self.config.pipe_dir, self.config.state_dir, pid_wait=0)
            except dirs.PipeDirHeld as exc:
                if exc.pid is not None:
                    self._follow(exc.pid, announce=True)
            else:
                break
            if time.monotonic() >= next_look:
                self.observe()
                next_look = time.monotonic() + interval
            self._sleep(min(self.poll, max(next_look - time.monotonic(), 0.0)))
        self.waiting = False
        if self.fd is None:
            log.info("stopped while standing by: the control daemon and the other mpsd run left alone")
            return None
        if self._metrics is not None:
            self._metrics.set_standby(False)
        log.info("pipe dir %s: mpsd run %s let it go after %.2fs in standby: this mpsd supervises the daemon now",
                 self.config.pipe_dir, self._who(), time.monotonic() - self._began)  # fmt: skip
        return self.fd

    def _sleep(self, timeout: float) -> None:
        """Until ``timeout``, a stop, or the holder's exit."""
        watched = [self._wake_r] + ([self._holder_fd] if self._holder_fd is not None else [])
        ready, _, _ = select.select(watched, [], [], timeout)
        if self._holder_fd is not None and self._holder_fd in ready:  # gone: the lock is tried at once
            os.close(self._holder_fd)
            self._holder_fd = None  # the same PID is not watched again (its file may still name it)

    def _follow(self, pid: int | None, announce: bool = False) -> None:
        """Watch ``pid``, the holder the lock file names, through a pidfd (not if already)."""
        if pid == self._holder:
            return
        if self._holder_fd is not None:
            os.close(self._holder_fd)
            self._holder_fd = None
        self._holder = pid
        if pid is not None:
            try:
                self._holder_fd = os.pidfd_open(pid)
            except OSError:
                pass  # gone already: the next try takes the lock, or names the next holder
        if announce:
            log.info("pipe dir %s: now held by %s: still standing by", self.config.pipe_dir, self._who())

    def _who(self) -> str:
        return peer.describe(self._holder) if self._holder is not None else "pid unknown"

    def close(self) -> None:
        """Close the descriptors; a signal handled after this writes to none (-1)."""
        write, self._wake_w = self._wake_w, -1
        for fd in (write, self._wake_r, self._holder_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._wake_r, self._holder_fd = -1, None
