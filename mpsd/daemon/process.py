"""The ``nvidia-cuda-mps-control -f`` child process: started, its output copied to
control.log, its exit reported, killed with its session. The wiring of ``mpsd run`` is in
mpsd/node.py, ``mpsd status`` in mpsd/status.py."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Protocol, Sequence

from .. import config as cfg
from .control import Control
from ..errors import ControlError, SetupError
from .logfiles import LogFile

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# Run by the interpreter in the child, in place of a preexec_fn: forking a threaded process
# (gRPC's device plugin) and running Python before exec crashed that child now and then.
# prctl(PR_SET_PDEATHSIG) survives the exec: the daemon is SIGKILLed when the thread that
# started it (the supervisor loop) dies, so a SIGKILLed mpsd leaves no daemon behind whose
# control_lock would stop the next ``mpsd run`` on that pipe dir.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('mpsd exited before its control daemon started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def daemon_command(binary: str, *options: str) -> list[str]:
    """The command line that becomes ``BINARY -f [OPTIONS]`` (through _DIE_WITH_PARENT on Linux)."""
    path = shutil.which(binary)
    if path is None:
        raise SetupError(
            f"cannot start control binary {binary!r}: not found or not executable; "
            "expected a name on PATH or an absolute path"
        )
    if not sys.platform.startswith("linux") or not sys.executable:
        return [path, "-f", *options]
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), os.path.abspath(path), "-f", *options]


def spawn(binary: str, env: dict[str, str], *options: str) -> subprocess.Popen:
    """``BINARY -f [OPTIONS]`` in a session of its own, its output on one pipe; SetupError
    when it cannot be started."""
    try:
        return subprocess.Popen(
            daemon_command(binary, *options),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        raise SetupError(f"cannot start control binary {binary!r}: {exc.strerror}") from exc


def daemon_env(config: cfg.Config) -> dict[str, str]:
    """mpsd's environment with the daemon's pipe and log dirs and devices, and without any
    CUDA_MPS_* default: only the configuration decides those."""
    env = dict(os.environ)
    env["CUDA_MPS_PIPE_DIRECTORY"] = config.pipe_dir
    env["CUDA_MPS_LOG_DIRECTORY"] = config.log_dir
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for name in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_CLIENT_PRIORITY"):
        env.pop(name, None)
    if config.visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = config.visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # indices as nvidia-smi and NVML number them
    return env


class DaemonProcess:
    """One ``nvidia-cuda-mps-control -f`` child: its log goes to logDir/control.log. It is
    killed by the kernel if the thread that started it (the supervisor loop) dies."""

    def __init__(
        self,
        config: cfg.Config,
        on_exit: Callable[["DaemonProcess", int], None],
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        full_env = daemon_env(config)  # args, env: the sharing backend's (MPS v3: -p 3 -a FILE)
        full_env.update(env or {})
        self.proc = spawn(config.control_binary, full_env, *options, *args)  # options: mpsd.daemon.multiuser
        self.pid = self.proc.pid
        self.started = time.monotonic()
        self.returncode: int | None = None
        self.retired_because = ""  # why the supervisor killed it, if it did
        self.on_line: Callable[[str], None] | None = None  # sees each line it prints (contest.WriterWatch)
        self._log = LogFile(os.path.join(config.log_dir, "control.log"), config.log_max_size, config.log_keep)
        self.last_line = ""  # the daemon's last line of output (why it exited at start, say)
        self._pump_thread = threading.Thread(target=self._pump, name=f"mps-log-{self.pid}", daemon=True)
        self._pump_thread.start()
        threading.Thread(target=self._wait, args=(on_exit,), name=f"mps-wait-{self.pid}", daemon=True).start()
        log.info(
            "daemon started pid=%d binary=%s options=%s pipe_dir=%s",
            self.pid, config.control_binary, " ".join(options) or "-", config.pipe_dir,
        )

    def _pump(self) -> None:
        """Copy the daemon's output to control.log until it closes. The output is always read,
        whatever the file does: a daemon whose stdout fills up blocks, and with it every client."""
        assert self.proc.stdout is not None
        out = self._log  # opened at its first line
        with self.proc.stdout:
            for line in self.proc.stdout:
                out.write(line)
                text = line.decode(errors="replace").rstrip()
                self.last_line = text[:300] or self.last_line
                level = logging.WARNING if (b"exited with status" in line or b"fatal" in line) else logging.DEBUG
                log.log(level, "daemon pid=%d says %s", self.pid, text)
                if self.on_line is not None:
                    try:
                        self.on_line(text)
                    except Exception:  # the output must go on being read
                        log.exception("daemon output watcher failed")
        out.close()

    def _wait(self, on_exit: Callable[["DaemonProcess", int], None]) -> None:
        self.returncode = self.proc.wait()
        on_exit(self, self.returncode)

    def said(self, timeout: float = 1.0) -> str:
        """``: <its last line>`` once its output is read to the end (bounded), "" if it said nothing."""
        self._pump_thread.join(timeout)
        return f": {' '.join(self.last_line.split())}" if self.last_line else ""

    def alive(self) -> bool:
        return self.returncode is None and self.proc.poll() is None

    def exit_status(self) -> int | None:
        """Its exit status once it has exited, else None."""
        return self.proc.poll()

    def release(self) -> None:
        """Nothing to let go of: a child is watched until it is reaped."""

    def kill(self) -> None:
        """SIGKILL the daemon and everything in its session (its servers). The daemon itself
        only while it is not reaped: its PID may belong to another process by then. Its group
        ID stays reserved while a member (a server) is left, so the group is signalled always."""
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: self.proc.send_signal(signal.SIGKILL)):
            try:
                target()
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                log.error("cannot kill daemon pid=%d error=%s", self.pid, exc)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def quit_daemon(control: Control | Quitter, daemon, limit: float) -> str:
    """``quit -t LIMIT`` through ``control``, a wait of up to ``limit`` seconds in all, then
    SIGKILL of what is left of ``daemon`` and its servers: "stopped (quit)" or "killed ..."."""
    began = time.monotonic()
    try:
        control.quit(timeout_s=max(1, math.ceil(limit)), wait=limit)
    except ControlError as exc:
        log.warning("quit failed pid=%d error=%s", daemon.pid, exc)
    quitted = daemon.wait(max(0.0, limit - (time.monotonic() - began)))
    if not quitted:
        log.warning("daemon pid=%d still running after %gs: killing it", daemon.pid, limit)
    daemon.kill()  # also servers left in its session
    daemon.wait(5.0)
    return "stopped (quit)" if quitted else f"killed: still running {limit:g}s after quit"


class Quitter(Protocol):
    """What quit_daemon needs of a front-end: ``quit -t`` (mpsd.daemon.control.Control has it)."""

    def quit(self, timeout_s: int, wait: float) -> None: ...
