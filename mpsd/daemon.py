"""The ``nvidia-cuda-mps-control -f`` child process: started, its output copied to
control.log, its exit reported, killed with its session. The wiring of ``mpsd run`` is in
mpsd/node.py, ``mpsd status`` in mpsd/status.py."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from . import config as cfg
from .errors import SetupError

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


def daemon_command(binary: str) -> list[str]:
    """The command line that becomes ``BINARY -f`` (through _DIE_WITH_PARENT on Linux)."""
    path = shutil.which(binary)
    if path is None:
        raise SetupError(
            f"cannot start control binary {binary!r}: not found or not executable; "
            "expected a name on PATH or an absolute path"
        )
    if not sys.platform.startswith("linux") or not sys.executable:
        return [path, "-f"]
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), os.path.abspath(path), "-f"]


class DaemonProcess:
    """One ``nvidia-cuda-mps-control -f`` child: its log goes to logDir/control.log. It is
    killed by the kernel if the thread that started it (the supervisor loop) dies."""

    def __init__(self, config: cfg.Config, on_exit: Callable[["DaemonProcess", int], None]) -> None:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = config.pipe_dir
        env["CUDA_MPS_LOG_DIRECTORY"] = config.log_dir
        env.pop("CUDA_VISIBLE_DEVICES", None)
        for name in (
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "CUDA_MPS_CLIENT_PRIORITY",
        ):
            env.pop(name, None)  # mpsd's own environment must not change the daemon's defaults
        if config.visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = config.visible_devices
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # indices as nvidia-smi and NVML number them
        try:
            self.proc = subprocess.Popen(
                daemon_command(config.control_binary),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise SetupError(f"cannot start control binary {config.control_binary!r}: {exc.strerror}") from exc
        self.pid = self.proc.pid
        self.started = time.monotonic()
        self.returncode: int | None = None
        self._log_path = os.path.join(config.log_dir, "control.log")
        threading.Thread(target=self._pump, name=f"mps-log-{self.pid}", daemon=True).start()
        threading.Thread(target=self._wait, args=(on_exit,), name=f"mps-wait-{self.pid}", daemon=True).start()
        log.info("daemon started pid=%d binary=%s pipe_dir=%s", self.pid, config.control_binary, config.pipe_dir)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            out = open(self._log_path, "ab")
        except OSError as exc:
            log.warning("cannot write daemon log path=%s error=%s", self._log_path, exc.strerror)
            out = None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if out is not None:
                    out.write(line)
                    out.flush()
                text = line.decode(errors="replace").rstrip()
                level = logging.WARNING if (b"exited with status" in line or b"fatal" in line) else logging.DEBUG
                log.log(level, "daemon pid=%d says %s", self.pid, text)
        if out is not None:
            out.close()

    def _wait(self, on_exit: Callable[["DaemonProcess", int], None]) -> None:
        self.returncode = self.proc.wait()
        on_exit(self, self.returncode)

    def alive(self) -> bool:
        return self.returncode is None and self.proc.poll() is None

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
