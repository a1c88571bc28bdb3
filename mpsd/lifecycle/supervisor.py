"""Keeps one ``nvidia-cuda-mps-control -f`` alive, configured and observed.

One loop owns every decision. Signal handlers, the child's exit watcher and ``stop()`` only
put events on a queue; the loop takes them one at a time, with the next timer (health check
or restart) as its wait timeout. The child runs in its own session, so a terminal's Ctrl-C
reaches mpsd only and shutdown stays in order: ``quit -t N``, a bounded wait, then SIGKILL of
the daemon's process group (its servers included).

Restarts back off exponentially (``restartBackoffInitial`` doubling up to ``restartBackoffMax``);
the count of failures in a row resets once a daemon passes a periodic health check.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..daemon import dirs, drift, multiuser, peer
from . import independent
from ..daemon.computemode import ComputeMode
from ..config import Config
from ..daemon.control import Control
from .adoption import Adoption
from ..daemon.process import DaemonProcess, quit_daemon
from ..errors import ConfigError, ControlBusy, ControlError, ControlImpostor, ControlTimeout, SetupError
from ..daemon.faults import FaultHandler
from .health import HealthBoard
from .keeper import Keeper
from ..config.reload import DEFAULT_KEYS, _early_reloads, merge_live
from .snapshot import Status
from ..units import format_limits

if TYPE_CHECKING:
    from .v3 import V3Supervision

log = logging.getLogger(__name__)

HUNG_AFTER = 2  # health checks in a row with no answer within healthTimeout before a daemon is killed

READY_POLL = 0.02


def backoff_delay(failures_in_row: int, initial: float, maximum: float) -> float:
    """initial, 2*initial, 4*initial ... capped at maximum (failures_in_row >= 1)."""
    return min(maximum, initial * 2 ** max(failures_in_row - 1, 0))


class Supervisor:
    def __init__(
        self,
        config: Config,
        board: HealthBoard,
        *,
        reload: Callable[[], Config] | None = None,
        gpu_indices: Callable[[], list[int]] = list,
        on_status: Callable[[Status], None] | None = None,
        v3: "V3Supervision | None" = None,
        daemon_args: tuple[str, ...] = (),
    ) -> None:
        self.config = c = config
        self.daemon_args = daemon_args  # v2: extra daemon flags (-S: static SM partitions, daemon/smpartition.py)
        self.v3 = v3  # an MPS v3 daemon (mpsd/lifecycle/v3.py); None: v2's interactive shell
        self.board = board
        self._reload = reload
        self._gpu_indices = gpu_indices
        self._on_status = on_status
        # SimpleQueue: its put is reentrant. A signal handler runs in the main thread between two
        # bytecodes, possibly while the loop is inside get() holding a queue.Queue's lock.
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._daemon: DaemonProcess | independent.AdoptedDaemon | None = None
        self._status = Status()
        self._status_lock = threading.Lock()
        self._next_at: float | None = None  # next health check or restart
        self._defaults = Keeper(config)  # the daemon's defaults, set, read back and put back (never a restart)
        self._silent_checks = (0, 0)  # (daemon pid, health checks in a row it did not answer)
        self._independent = c.daemon_lifecycle == "independent"  # the daemon outlives mpsd (mpsd.lifecycle.independent)
        if self._independent and v3 is not None:  # the holder and a detached start know only v2's command line
            raise SetupError("daemonLifecycle independent is not supported with MPS v3 yet: "
                             "set mps.protocol 2, or daemonLifecycle owned")
        self._adopting = False  # the first health check of an adopted daemon: its defaults are set, not "restored"
        self._adoption = Adoption(self)  # what an independent start found: adopted, awaited or refused
        self._faults = FaultHandler(c.health_timeout, is_client=self._mps_client_problem)
        self._verdict_at = time.monotonic()  # the last conclusive health check (or start)
        self._compute = ComputeMode(
            config.nvidia_smi, config.visible_devices.split(",") if config.visible_devices else None
        )
        self._uid_policy: multiuser.UidPolicy | None = None  # resolved once, at the first start
        self._waiting = multiuser.WaitingWatch(c.pipe_dir)
        self.loop_alive = threading.Event()

    # ---- thread-safe entry points

    def stop(self) -> None:
        self._events.put(("stop",))

    def reload(self) -> None:
        self._events.put(("reload",))

    def status(self) -> Status:
        with self._status_lock:
            return self._status

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop, SIGHUP reloads; the handlers only enqueue (main thread only)."""
        signal.signal(signal.SIGTERM, lambda *_: self._events.put(("stop",)))
        signal.signal(signal.SIGINT, lambda *_: self._events.put(("stop",)))
        signal.signal(signal.SIGHUP, lambda *_: self._events.put(("reload",)))
        if _early_reloads:  # one reload stands for any number asked before now
            _early_reloads.clear()
            log.info("SIGHUP received while starting: reloading once started")
            self._events.put(("reload",))

    def control(self, timeout: float | None = None) -> Control:
        c = self.config
        return Control(c.control_binary, c.pipe_dir, c.log_dir, c.health_timeout if timeout is None else timeout)

    # ---- the loop

    def run(self) -> int:
        """Start the daemon and supervise it until stop(); 0 on a clean stop. SetupError if
        the first start cannot even begin (directories, binary, compute mode)."""
        if self.config.exclusive_process:
            self._compute.set_exclusive()
        try:
            self.loop_alive.set()
            self._resolve_uid_policy()
            self._start(first=True)
            while True:
                timeout = None if self._next_at is None else max(0.0, self._next_at - time.monotonic())
                try:
                    event = self._events.get(timeout=timeout)
                except queue.Empty:
                    event = ("timer",)
                if event[0] == "stop":
                    self._shutdown()
                    return 0
                self._dispatch(event)
        finally:
            self.loop_alive.clear()
            if self._independent and self._daemon is not None:  # mpsd's own failure leaves it running
                self._daemon.release()
            elif self._daemon is not None and self._daemon.alive():  # left by an unexpected error
                self._daemon.kill()
            if self.config.exclusive_process and not self._independent:  # the mode belongs with the daemon
                self._compute.restore()

    def _resolve_uid_policy(self) -> None:
        """multiUser against the binary (mpsd.daemon.multiuser): SetupError for ``on`` without support."""
        c = self.config
        if self.v3 is not None:  # v3's own -m, no probe of v2's option (mpsd.daemon.multiuser.resolve_v3)
            self._uid_policy = self.v3.uid_policy(c.multi_user)
        else:
            self._uid_policy = multiuser.resolve(c.multi_user, c.control_binary, c.health_timeout)
        # info: a client that does wait for another UID's server is warned about when it happens
        log.info("%s", multiuser.describe_policy(self._uid_policy))
        self._publish(multi_user=self._uid_policy.multi_user)

    def _dispatch(self, event: tuple) -> None:
        kind = event[0]
        if kind == "exited":
            self._on_exited(event[1], event[2])
        elif kind == "reload":
            self._do_reload()
        elif kind == "timer":
            if self._daemon is None:
                self._start(first=False)
            else:
                self._health_check()

    def _publish(self, **changes) -> None:
        with self._status_lock:
            self._status = replace(self._status, **changes)
            status = self._status
        if self._on_status is not None:
            try:
                self._on_status(status)
            except Exception:  # a metrics bug must not stop supervision
                log.exception("status observer failed")

    # ---- start, exit, restart

    def _start(self, first: bool) -> None:
        status = self.status()
        counted = 0 if first else 1  # independent: only a daemon found or started counts, not a wait
        self._publish(state="starting", restarts=status.restarts + (0 if self._independent else counted))
        try:
            self._daemon = self._launch()
        except independent.Waiting as exc:
            return self._adoption.wait(str(exc))
        except independent.Refused as exc:
            return self._adoption.refused(exc)
        except (SetupError, ControlError) as exc:  # ControlError: a detached start that did not come up
            if first and isinstance(exc, SetupError) and not self._independent:
                raise
            self._failed(f"cannot start the daemon: {exc}")
            return
        self._faults.reset()
        self._adoption.said = ""
        if self._independent:
            self._publish(restarts=status.restarts + counted)
        if isinstance(self._daemon, independent.AdoptedDaemon) and not self._daemon.fresh:
            return self._adoption.adopt(self._daemon)
        self._adopting = False
        self._waiting.clear()
        if isinstance(self._daemon, DaemonProcess):  # its output: who wrote the defaults (mpsd.daemon.contest)
            self._daemon.on_line = self._defaults.new_daemon(self._daemon.pid, self.config.pipe_dir).line
        else:
            self._defaults.new_daemon(self._daemon.pid, self.config.pipe_dir)
        pending = ""
        try:
            self._wait_listening(self._daemon)
            self._refuse_impostor(self._daemon)
            if self.v3 is not None:  # what it cannot read: /readyz says it, no restart
                pending = self.v3.configure(self.config)
            else:
                pending = self._defaults.start(self.control(), self.config, self._devices())
        except ControlError as exc:
            daemon, self._daemon = self._daemon, None
            daemon.kill()
            daemon.wait(5.0)
            self._failed(f"daemon pid={daemon.pid} did not come up configured: {exc}")
            return
        self._verdict_at = time.monotonic()
        configured = not self._defaults.stale  # else set at the next health check
        self.board.update(daemon_up=True, configured=configured, last_error=pending,
                          unverified=pending if self.v3 is not None else "")
        self._publish(state="running", pid=self._daemon.pid, last_error=pending, defaults_contested=0.0)
        self._next_at = time.monotonic() + self.config.health_interval
        log.info(
            "daemon configured pid=%d active_thread_percentage=%g pinned_mem_limit=%s client_priority=%s",
            self._daemon.pid,
            self.config.active_thread_percentage,
            format_limits(self.config.pinned_mem_limit) or "none",
            self.config.client_priority,
        )

    def _launch(self) -> DaemonProcess | independent.AdoptedDaemon:
        options = self._uid_policy.options if self._uid_policy else ()  # mpsd.daemon.multiuser
        if self._independent:
            return independent.attach(self.config, self._exited_cb, self._adoption.report, options)
        dirs.prepare(self.config.pipe_dir, self.config.log_dir, self.config.control_binary)
        return DaemonProcess(self.config, self._exited_cb, options=options,
                             **(self.v3.daemon_options() if self.v3 else {"args": self.daemon_args}))

    def _wait_listening(self, daemon: DaemonProcess | independent.AdoptedDaemon) -> None:
        deadline = time.monotonic() + self.config.health_timeout
        control = self.control()
        while True:
            if not daemon.alive():
                said = daemon.said() if isinstance(daemon, DaemonProcess) else ""
                raise ControlError(f"control daemon exited at start with status {daemon.exit_status()}{said}")
            try:
                self.v3.ping() if self.v3 is not None else control.get_server_list()
                return
            except ControlTimeout:
                raise
            except ControlError:
                if time.monotonic() >= deadline:
                    raise ControlError(f"control daemon not listening after {self.config.health_timeout:g}s") from None
                time.sleep(READY_POLL)

    def _exited_cb(self, daemon, returncode: int | None) -> None:
        self._events.put(("exited", daemon, returncode))

    def _on_exited(self, daemon, returncode: int | None) -> None:
        current = self._daemon
        if current is None or daemon is not current:
            return  # one we already retired
        self._daemon = None
        current.kill()  # its servers, if any are left
        current.release()
        status = "" if returncode is None else f" (status {returncode})"  # None: not mpsd's child
        if current.retired_because:  # killed by us: the reason stays what /readyz says until the restart
            self._failed(f"{current.retired_because}; killed{status}")
        else:
            self._failed(f"daemon pid={current.pid} exited" + (f" with status {returncode}" if status else ""))

    def _failed(self, message: str, quiet: bool = False) -> None:
        failures = self.status().failures_in_row + 1
        delay = backoff_delay(failures, self.config.restart_backoff_initial, self.config.restart_backoff_max)
        if failures >= 3:
            message = f"{message}; crash loop: {failures} failures in a row, next start in {delay:.1f}s"
            if not quiet:
                log.error("%s", message)
        elif not quiet:
            log.warning("%s; restarting in %.1fs", message, delay)
        self.board.update(daemon_up=False, configured=False, last_error=message, unverified="")
        self._publish(
            state="backoff", pid=None, failures_in_row=failures, last_error=message, servers=(), server_states={}
        )
        self._next_at = time.monotonic() + delay

    # ---- health

    def _health_check(self) -> None:
        daemon = self._daemon
        assert daemon is not None
        if self.v3 is not None:
            return self.v3.health_check(self, daemon)
        control = self.control()
        began = time.monotonic()
        unreachable = dirs.client_socket_problem(Path(self.config.pipe_dir))
        if unreachable:  # a restart makes the daemon create it again
            self._retire(daemon, f"daemon pid={daemon.pid} failed its health check: {unreachable}")
            return
        devices = self._devices()
        try:
            self._refuse_impostor(daemon)
            defaults = drift.read(control, self._defaults.applied, devices)
            servers = control.get_server_list()
            states = self._faults.server_states(control, servers)
            self._refuse_impostor(daemon, ("control_privileged",))  # what mpsd read came from its daemon
        except ControlTimeout as exc:
            return self._no_answer(daemon, exc)
        except ControlBusy as exc:  # it refused us, so it runs: no reason to kill it and its clients
            found = peer.sessions(daemon.pid, self.config.pipe_dir)
            return self._inconclusive(daemon, exc, found.holders, found.unreadable)
        except ControlError as exc:
            self._retire(daemon, f"daemon pid={daemon.pid} failed its health check: {exc}")
            return
        self._silent_checks, self._verdict_at = (daemon.pid, 0), time.monotonic()
        latency = time.monotonic() - began
        if self._defaults.stale:
            pending = self._apply_reloaded_defaults()
        else:
            pending = self._restore_defaults(defaults, devices)
        faulted = [pid for pid, state in states.items() if state == "FAULT"]
        gpus = frozenset(self._gpu_indices()) if faulted else frozenset()
        error = f"MPS server(s) {','.join(map(str, faulted))} in FAULT: clients of those servers must exit"
        if faulted:
            log.error("%s gpus=%s", error, sorted(gpus))
        action = self._faults.handle(self.config.fault_policy, control, faulted)
        if action:
            error = f"MPS server(s) {','.join(map(str, faulted))} in FAULT: {action}"
        error = "; ".join(filter(None, [error if faulted else "", pending]))
        now, contest = time.monotonic(), self._defaults.contest
        unverified = contest.reason(now, self.config.verdict_timeout)  # defaults changed again and again
        self.board.update(daemon_up=True, configured=True, faulted_gpus=gpus, last_error=error, unverified=unverified)
        single_uid = self._uid_policy is not None and not self._uid_policy.multi_user
        self._publish(
            defaults_restored=self._defaults.restored,
            defaults_contested=contest.age(now),
            waiting=self._waiting.check(daemon.pid, servers) if single_uid else (),
            verdict_age=0.0,
            fault_terminations=dict(self._faults.counts),
            state="running",
            failures_in_row=0,
            health_latency=latency,
            health_checks=self.status().health_checks + 1,
            servers=tuple(servers),
            server_states=states,
            last_error=error,
        )
        self._next_at = time.monotonic() + self.config.health_interval

    def _no_answer(self, daemon: DaemonProcess | independent.AdoptedDaemon, exc: ControlTimeout) -> None:
        """A health check the daemon did not answer in time: checked again at once, killed as hung
        after HUNG_AFTER silent checks in a row (v2 and v3 alike). Not hung, inconclusive, while a
        session is held on its control sockets (it waits on it) or mpsd cannot read its sessions:
        a tenant can hold one, so it is no proof of anything (docs/security.md, verdicts)."""
        found = peer.sessions(daemon.pid, self.config.pipe_dir)
        if found.holders or found.unreadable:
            return self._inconclusive(daemon, exc, found.holders, found.unreadable)
        silent = self._silent_checks[1] + 1 if self._silent_checks[0] == daemon.pid else 1
        self._silent_checks = (daemon.pid, silent)
        if silent >= HUNG_AFTER:
            self._retire(daemon, f"daemon pid={daemon.pid} hung: {exc} ({silent} health checks in a row)")
            return
        # One slow answer can be a loaded node; killing the daemon kills every client with it.
        log.warning("health check of daemon pid=%d got no answer, checking again at once: %s", daemon.pid, exc)
        self._publish(last_error=f"{exc} (check {silent} of {HUNG_AFTER} before it is killed as hung)")
        self._next_at = time.monotonic()

    def _refuse_impostor(self, daemon: DaemonProcess | independent.AdoptedDaemon,
                         names: tuple[str, ...] = peer.CONTROL_SOCKETS) -> None:
        """ControlImpostor (counted) if a control socket is served by another process than ``daemon``."""
        found = peer.impostor(self.config.pipe_dir, daemon.pid, names)
        if found:
            self._publish(impostors=self.status().impostors + 1)
            raise ControlImpostor(f"control socket impostor: {found}; the daemon is restarted to take its sockets back")

    def _inconclusive(self, daemon: DaemonProcess | independent.AdoptedDaemon, exc: ControlError,
                      holders: list[int], unreadable: str = "") -> None:
        """No verdict: another front-end holds the daemon, or its sessions cannot be read. It is not
        killed (that would hand the holder a lever on every client); past verdictTimeout /readyz
        says so (docs/operations.md)."""
        self._silent_checks, age = (daemon.pid, 0), time.monotonic() - self._verdict_at
        who = peer.describe_all(holders, unreadable=unreadable)
        log.warning("health check of daemon pid=%d inconclusive: %s; held by %s", daemon.pid, exc, who)
        self._publish(last_error=f"{exc}; held by {who}", verdict_age=age)  # the metric before /readyz
        if age >= self.config.verdict_timeout:
            self.board.update(unverified=peer.held_reason(age, self.config.verdict_timeout, who))
        self._next_at = time.monotonic() + self.config.health_interval

    def _restore_defaults(self, got: drift.Defaults, devices: set[int]) -> str:
        """Put back defaults changed through ``control`` (mpsd.lifecycle.keeper: reported, never a restart):
        "" when none were. An adopted daemon's first round sets the config's defaults where they
        differ: another config's, or its holder restarted it, not tampering."""
        adopting, self._adopting = self._adopting, False
        if not adopting:
            return self._defaults.restore(self.control(), got, devices, self.config.verdict_timeout)
        message = self._defaults.adopt(self.control(), got, devices)
        if self._defaults.stale:  # busy: the next round tries again, still as adoption
            self._defaults.stale, self._adopting = False, True
        return message

    def _mps_client_problem(self, pid: int, server: int) -> str:
        """"" if ``pid`` is shown to be a client of ``server`` of the running daemon (mpsd.daemon.peer)."""
        daemon = self._daemon
        return "no daemon running" if daemon is None else peer.mps_client_problem(pid, daemon.pid, [server])

    def _retire(self, daemon: DaemonProcess | independent.AdoptedDaemon, message: str) -> None:
        """Kill a daemon that is hung or broken; its exit event then schedules the restart."""
        log.error("%s: killing it", message)
        daemon.retired_because = message
        self.board.update(daemon_up=False, configured=False, last_error=message)
        self._publish(last_error=message)
        daemon.kill()
        self._next_at = time.monotonic() + self.config.health_interval  # the exit event should come first

    # ---- reload and shutdown

    def _do_reload(self) -> None:
        if self._reload is None:
            log.warning("SIGHUP: no config source to reload")
            return
        try:
            new = self._reload()
        except ConfigError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self.board.update(last_error=f"reload failed: {exc}")
            return
        merged, live, later = merge_live(self.config, new)
        for key in later:
            log.warning("reload key=%s changed: applies only after mpsd restarts", key)
        self.config = merged
        if "logLevel" in live:
            logging.getLogger().setLevel(merged.log_level.upper())
        self._publish(config_generation=self.status().config_generation + 1)
        log.info("reloaded applied=%s deferred=%s", ",".join(sorted(live)) or "-", ",".join(later) or "-")
        if live & DEFAULT_KEYS and self._daemon is not None:
            self._apply_reloaded_defaults()

    def _apply_reloaded_defaults(self) -> str:
        """Bring the running daemon's defaults to self.config: "" when done, the reason when
        the daemon did not take them (tried again at the next health check)."""
        if self.v3 is not None:
            try:
                self.v3.apply_defaults(self.config)
                self._defaults.applied, self._defaults.stale = self.config, False
                return ""
            except ControlError as exc:
                self._defaults.stale = True
                message = f"new defaults not applied yet, trying again at the next health check: {exc}"
                log.error("%s", message)
        else:
            message = self._defaults.reload(self.control(), self.config, self._devices())
        if self._defaults.stale:
            self.board.update(last_error=message)
            self._publish(last_error=message)
        else:
            self.board.update(configured=True)
        return message

    def _devices(self) -> set[int]:
        """The daemon's device ordinals (CUDA_VISIBLE_DEVICES renumbers them 0..n-1)."""
        return set(range(len(self._gpu_indices())))

    def _shutdown(self) -> None:
        self._publish(state="stopping")
        daemon, self._daemon = self._daemon, None
        if daemon is not None and self._independent:
            daemon.release()
            log.info("left the control daemon pid=%d running (daemonLifecycle: independent); "
                     "mpsd stop-daemon stops it", daemon.pid)  # fmt: skip
        elif daemon is not None and daemon.alive():
            quitter = self.v3 if self.v3 is not None else self.control()
            how = quit_daemon(quitter, daemon, self.config.shutdown_timeout)
            log.info("daemon stopped pid=%d status=%s: %s", daemon.pid, daemon.exit_status(), how)
        self.board.update(daemon_up=False, configured=False)
        self._publish(state="stopped", pid=None)

