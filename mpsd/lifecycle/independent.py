"""``daemonLifecycle: independent``: a control daemon that outlives ``mpsd run``.

The daemon is either kept by a holder (``mpsd holder``, mpsd/lifecycle/holder.py: its parent, which
restarts it) or, where no holder runs or ran and mpsd is in no service unit or container that
would take it down with mpsd, started by mpsd detached (``controlBinary -d``: it forks into a
session of its own, re-parented to init, and writes logDir/control.log itself). Either
way mpsd supervises it without being its parent: it proves the daemon genuine first
(mpsd.daemon.genuine), then holds it through a pidfd — watched for its exit, signalled through it (a
PID that may have been reused is never signalled) and let go when mpsd stops. docs/operations.md
("Upgrading mpsd") says who keeps the daemon when.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from typing import Callable

from .. import config as cfg
from ..daemon import dirs, genuine, logfiles, peer
from ..daemon.control import Control
from ..daemon.process import daemon_env, quit_daemon
from ..errors import ControlError, MpsdError, SetupError

log = logging.getLogger(__name__)

# mpsd.daemon.dirs.lock_path's kind for the holder's lock (in stateDir/locks, where no pod can
# open it): write-locked (POSIX) by the holder for its life, and left there after it as the sign
# that this pipe dir's daemon is a holder's (mpsd run then waits for it, never starting one).
HOLDER = "holder"
LEGACY_HOLDER_LOCK = "mpsd-holder.lock"  # where holders before 0.2 took it: in the pipe dir


class Waiting(ControlError):
    """No daemon yet, and not mpsd's to start: the holder's (or one that is starting) is awaited."""


class Refused(ControlError):
    """The daemon on the pipe dir is not adopted (mpsd.daemon.genuine.Proof says why)."""

    def __init__(self, proof: genuine.Proof) -> None:
        super().__init__(proof.problem)
        self.impostor, self.owner = proof.impostor, proof.owner


def holder_pid(config: cfg.Config) -> int | None:
    """The PID of the ``mpsd holder`` keeping this pipe dir's daemon, None when none runs (a
    read lock is anyone's). A holder of an earlier release locks the file in the pipe dir,
    where no pod can take a write lock (a read-only mount gives read-only descriptors)."""
    path = dirs.lock_path(config.state_dir, config.pipe_dir, HOLDER)
    pid = genuine.write_lock_holder(str(path))
    return pid if pid is not None else genuine.write_lock_holder(os.path.join(config.pipe_dir, LEGACY_HOLDER_LOCK))


def holder_marker(config: cfg.Config) -> str:
    """The holder's lock file if one was ever made for this pipe dir ("" if none): a holder is
    installed here, and its daemon is awaited rather than replaced."""
    for path in (str(dirs.lock_path(config.state_dir, config.pipe_dir, HOLDER)),
                 os.path.join(config.pipe_dir, LEGACY_HOLDER_LOCK)):  # fmt: skip
        if os.path.lexists(path):
            return path
    return ""


class AdoptedDaemon:
    """A control daemon that is not mpsd's child, proven genuine and held through ``pidfd``.
    ``fresh``: this mpsd started it (detached), so it is configured as a new daemon; otherwise
    it was adopted, and only what differs from the config is set again."""

    def __init__(self, pid: int, pidfd: int, on_exit: Callable[["AdoptedDaemon", int | None], None],
                 fresh: bool, logs: logfiles.HeldLogs | None = None) -> None:  # fmt: skip
        self.pid, self.fresh = pid, fresh
        self._logs = logs  # the logs it writes itself, kept to size by the watcher
        self.started = time.monotonic()
        self.returncode: int | None = None  # never known: only a parent can read it
        self.retired_because = ""
        self._pidfd: int | None = pidfd
        self._group = _leads_group(pid)  # its servers are in its process group
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._watcher = threading.Thread(target=self._watch, args=(on_exit,), name=f"mps-watch-{pid}", daemon=True)
        self._watcher.start()

    def _watch(self, on_exit: Callable[["AdoptedDaemon", int | None], None]) -> None:
        pidfd = self._pidfd
        if pidfd is None:
            return
        every = None if self._logs is None else self._logs.CHECK_EVERY
        while True:
            ready, _, _ = select.select([pidfd, self._wake_r], [], [], every)
            if self._wake_r in ready:
                return
            if pidfd in ready:
                return on_exit(self, None)
            if self._logs is not None:
                self._logs.check(self.pid)

    def alive(self) -> bool:
        return self._pidfd is not None and not genuine.exited(self._pidfd)

    def exit_status(self) -> int | None:
        return None

    def wait(self, timeout: float) -> bool:
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], max(timeout, 0.0))[0])

    def kill(self) -> None:
        """SIGKILL the daemon through its pidfd, and while it still runs, its process group (its
        servers) where it leads one: a group ID cannot be reused while its leader runs. Once it
        is gone, what is left is its parent's to clean up (the holder's; MPS servers exit with
        their control daemon)."""
        if self._pidfd is None or genuine.exited(self._pidfd):
            return
        if self._group:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.error("cannot kill daemon pid=%d error=%s", self.pid, exc)

    def release(self) -> None:
        """Let the daemon go (mpsd stops, or it is gone): stop watching, close the pidfd."""
        if self._pidfd is None:
            return
        os.write(self._wake_w, b"x")
        self._watcher.join(5.0)
        for fd in (self._pidfd, self._wake_r, self._wake_w):
            os.close(fd)
        self._pidfd = None


def _leads_group(pid: int, proc: str = "/proc") -> bool:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[2]) == pid  # state, ppid, pgrp
    except (OSError, IndexError, ValueError):
        return False


def start_detached(config: cfg.Config, options: tuple[str, ...] = ()) -> None:
    """Run ``controlBinary -d [OPTIONS]`` (OPTIONS: mpsd.daemon.multiuser's): the daemon forks into its
    own session and the command returns once it listens. ControlError (one line) when it does
    not, in healthTimeout."""
    path = shutil.which(config.control_binary)
    if path is None:
        raise SetupError(
            f"cannot start control binary {config.control_binary!r}: not found or not executable; "
            "expected a name on PATH or an absolute path"
        )
    try:
        proc = subprocess.run(
            [path, "-d", *options], env=daemon_env(config), stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=config.health_timeout, start_new_session=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ControlError(f"{path} -d did not return in {config.health_timeout:g}s") from None
    except OSError as exc:
        raise SetupError(f"cannot start control binary {config.control_binary!r}: {exc.strerror}") from exc
    if proc.returncode != 0:
        said = " ".join((proc.stdout + proc.stderr).split())[:300] or "nothing"
        raise ControlError(f"{path} -d exited with status {proc.returncode}: {said}")


_said_no_holder: set[str] = set()


def confining_cgroup(cgroup: str) -> str:
    """What stops every process of a /proc/PID/cgroup text's group when its main process stops:
    a Kubernetes pod or a container (its runtime kills the rest, with hostPID too: containerd's
    ShouldKillAllOnExit), or a systemd service unit (KillMode control-group or mixed); "" for
    anything else (a login session, a scope, a bare host)."""
    owner = peer.cgroup_owner(cgroup)
    if owner:
        return owner
    for line in cgroup.splitlines():
        last = line.split(":", 2)[-1].rstrip("/").rsplit("/", 1)[-1]
        if last.endswith(".service"):
            return f"the systemd unit {last}"
    return ""


def _self_cgroup() -> str:
    try:
        return peer._read("/proc/self/cgroup").decode(errors="replace")
    except OSError:
        return ""


def attach(config: cfg.Config, on_exit: Callable[[AdoptedDaemon, int | None], None],
           on_refused: Callable[[Refused], object], options: tuple[str, ...] = ()) -> AdoptedDaemon:  # fmt: skip
    """The pipe dir's genuine daemon, adopted; where none runs and no holder keeps one, one
    started detached. Waiting while a holder (or a daemon that is starting) is to bring one up;
    Refused (one line) for a daemon that is not adopted; SetupError, ControlError at a start.
    Sockets served by an impostor while no daemon of this pipe dir runs are reported to
    ``on_refused`` and replaced: a new daemon (the holder's, or one started here) binds them."""
    proof = genuine.prove(config.pipe_dir, config.control_binary)
    if proof.pid is not None:
        logs = _held_logs(config)
        return AdoptedDaemon(proof.pid, proof.pidfd, on_exit, fresh=False, logs=logs)  # type: ignore[arg-type]
    if proof.problem:
        if not proof.impostor or proof.owner is not None or \
                genuine.daemon_lock_holder(config.pipe_dir, config.control_binary):  # fmt: skip
            raise Refused(proof)
        on_refused(Refused(proof))
    holder = holder_pid(config)
    if holder is not None:
        raise Waiting(f"no control daemon on pipe dir {config.pipe_dir}: waiting for the holder "
                      f"{peer.describe(holder)} to start it")  # fmt: skip
    marker = holder_marker(config)
    if marker:  # a holder is installed here: its daemon is awaited, not replaced by one of ours
        raise Waiting(f"no control daemon on pipe dir {config.pipe_dir} and no mpsd holder running, though one "
                      f"kept it before ({marker}): waiting for the holder; remove that file if it is gone for good")
    where = confining_cgroup(_self_cgroup())
    if where:  # a daemon started here would be stopped with mpsd: only a holder can keep it
        raise Waiting(f"no control daemon and no mpsd holder on pipe dir {config.pipe_dir}: mpsd runs in {where}, "
                      "which stops every process in it when mpsd stops; start mpsd holder (docs/operations.md, "
                      "Upgrading mpsd)")  # fmt: skip
    if config.pipe_dir not in _said_no_holder:  # once per process: the daemon's fate, not a failure
        _said_no_holder.add(config.pipe_dir)
        log.warning(
            "no mpsd holder on pipe dir %s: starting the control daemon detached; it outlives mpsd's "
            "process, not the cgroup of its container or service (docs/operations.md, Upgrading mpsd)",
            config.pipe_dir,
        )
    if proof.absent and os.path.lexists(os.path.join(config.pipe_dir, "control_privileged")):
        log.warning("pipe dir %s: nobody answers control_privileged (files of a daemon that is gone): "
                    "replacing them", config.pipe_dir)  # fmt: skip
    if genuine.daemon_lock_holder(config.pipe_dir, config.control_binary) is not None:
        raise Waiting(f"a control daemon is starting on pipe dir {config.pipe_dir}")  # raced in since the proof
    dirs.prepare(config.pipe_dir, config.log_dir, config.control_binary)
    start_detached(config, options)
    proof = genuine.prove(config.pipe_dir, config.control_binary)
    if proof.pid is None:
        raise Refused(proof) if proof.problem else ControlError(f"the daemon started on {config.pipe_dir} is gone")
    return AdoptedDaemon(proof.pid, proof.pidfd, on_exit, fresh=True, logs=_held_logs(config))  # type: ignore[arg-type]


def _held_logs(config: cfg.Config) -> logfiles.HeldLogs:
    return logfiles.HeldLogs(config.log_dir, config.log_max_size, config.log_keep)


def kill_verified(pid: int, config: cfg.Config) -> bool:
    """SIGKILL ``pid`` if it still is this pipe dir's genuine daemon (it holds control_lock and
    runs controlBinary for this pipe dir); True if it was signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if genuine.control_lock_holder(config.pipe_dir) != pid:
            return False
        if genuine.process_problem(pid, config.pipe_dir, config.control_binary)[0]:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def stop_daemon(config: cfg.Config) -> str:
    """``mpsd stop-daemon``: quit the pipe dir's genuine daemon (``quit -t shutdownTimeout``,
    then SIGKILL of what is left), holding the pipe dir meanwhile so that no ``mpsd run`` starts
    one. What was done, in one line; MpsdError (one line) when it is not this command's to do."""
    lock = dirs.hold_pipe_dir(config.pipe_dir, config.state_dir)  # SetupError naming a running mpsd run
    try:
        holder = holder_pid(config)
        if holder is not None:
            raise MpsdError(
                f"pipe dir {config.pipe_dir}: the holder {peer.describe(holder)} keeps the daemon and would start "
                "it again: stop the holder instead (SIGTERM; it quits the daemon)"
            )
        proof = genuine.prove(config.pipe_dir, config.control_binary)
        if proof.pid is None:
            if proof.absent:
                return f"no control daemon runs on pipe dir {config.pipe_dir}"
            raise MpsdError(f"not stopped: {proof.problem}")
        daemon = AdoptedDaemon(proof.pid, proof.pidfd, lambda *_: None, fresh=False)  # type: ignore[arg-type]
        control = Control(config.control_binary, config.pipe_dir, config.log_dir, config.shutdown_timeout)
        try:
            how = quit_daemon(control, daemon, config.shutdown_timeout)
        finally:
            daemon.release()
        return f"control daemon pid {daemon.pid} on pipe dir {config.pipe_dir} {how}"
    finally:
        dirs.release_pipe_dir(lock)
