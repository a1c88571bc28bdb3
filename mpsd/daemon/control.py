"""The MPS control protocol: one front-end call per command, parsed into values.

``nvidia-cuda-mps-control`` run without arguments is a front-end: it reads commands on stdin,
sends them to the daemon found through ``CUDA_MPS_PIPE_DIRECTORY`` and prints the answers.
It exits 0 whenever the daemon was reached, even when a command was rejected, so success is
read from what it prints. Every command goes through :meth:`Control.call`, which carries a
timeout; the parsing is done by pure functions below, tested by tables.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ControlBusy, ControlError, ControlTimeout, DaemonNotRunning
from ..units import UNITS, format_size_mps_control, is_decimal

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

NOT_RUNNING = ("Cannot find MPS control daemon process", "Cannot authenticate or connect to MPS control daemon")
# The daemon serves one front-end at a time. While another holds it, a front-end either exits 1
# with BUSY or exits 0 having printed nothing, its command never sent. So every command is
# followed by SENTINEL, whose answer is never empty: no output at all means "not served".
BUSY = "Cannot send command to MPS control daemon process"
SENTINEL = "get_default_active_thread_percentage"
# Ends each answer of a batch (Control.batch): an unknown command, answered on every version
# seen (535.216, 535.261, 550.163, 555.58) with one line, MARK_ANSWER, and nothing else.
MARK = "mpsd-end-of-answer"
MARK_ANSWER = f'Unknown command "{MARK}"'
BUSY_RETRY = (0.01, 0.1)  # first and longest wait between tries while busy, seconds
# Lines the front-end prints (with exit 0) when a command is rejected.
_REJECTIONS = (
    re.compile(r"^Unknown command \"(?P<cmd>[^\"]*)\""),
    re.compile(r"^Server \d+ not found!?$"),
    re.compile(r"^Invalid .*"),
    re.compile(r"^Insufficient privileges.*"),
    re.compile(r"^Not enough privilege.*"),
    re.compile(r"^A (?:server PID|user id \(UID\)) is required.*"),
    re.compile(r".* should be between .*"),
    re.compile(r"^Server not found$"),
)
SERVER_STATES = ("INITIALIZING", "ACTIVE", "FAULT")


class CommandRejected(ControlError):
    """The daemon answered, but refused the command (the line it printed is the message)."""


class UnknownCommand(CommandRejected):
    """This daemon version does not know the command (e.g. get_server_status before 550)."""


class UnexpectedOutput(ControlError):
    """The daemon answered, in a form the parser does not know (another driver version)."""


@dataclass(frozen=True)
class PsEntry:
    pid: int
    client_id: int
    server: int
    device: str
    namespace: str
    command: str


# ---------------------------------------------------------------- pure parsing


def _lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.strip()]


def check_rejection(command: str, output: str) -> None:
    """Raise CommandRejected (UnknownCommand) if ``output`` holds a rejection line."""
    for line in _lines(output):
        for pattern in _REJECTIONS:
            m = pattern.match(line)
            if m:
                exc = UnknownCommand if m.groupdict().get("cmd") is not None else CommandRejected
                raise exc(f"{command!r} rejected by the MPS control daemon: {line}")


def _busy(command: str, tries: int, limit: float) -> ControlBusy:
    return ControlBusy(
        f"{command!r}: the MPS control daemon did not take it in {tries} tries in {limit:g}s: "
        "another front-end holds its control connection"
    )


def strip_sentinel(output: str) -> str:
    """The answer to the command, without the last line (the SENTINEL's answer)."""
    lines = output.rstrip("\n").split("\n")
    return "".join(line + "\n" for line in lines[:-1])


def split_answers(output: str, count: int) -> list[str]:
    """The answers of a batch of ``count`` commands, each ended by MARK's answer line."""
    parts: list[str] = []
    current: list[str] = []
    for line in output.splitlines():
        if line.strip() == MARK_ANSWER:
            parts.append("".join(current))
            current = []
        else:
            current.append(line + "\n")
    if len(parts) != count or any(line.strip() for line in current):
        raise UnexpectedOutput(
            f"unexpected batch answer {output!r}: expected {count} answer(s) each ended by {MARK_ANSWER!r}"
        )
    return parts


def parse_pids(output: str) -> list[int]:
    """PIDs printed one a line or separated by spaces (get_server_list, get_client_list)."""
    pids = []
    for token in output.split():
        if not is_decimal(token):
            raise UnexpectedOutput(f"unexpected PID {token!r} in {output!r}: expected decimal process ids")
        pids.append(int(token))
    return pids


def parse_percentage(output: str) -> float:
    """``100.0`` -> 100.0 (get/set_default_active_thread_percentage)."""
    lines = _lines(output)
    try:
        return float(lines[-1])
    except (IndexError, ValueError):
        raise UnexpectedOutput(
            f"unexpected active thread percentage {output!r}: expected a number such as 100.0"
        ) from None


def parse_mem_limit(output: str) -> int | None:
    """``2G`` -> 2 GiB in bytes; nothing printed (no limit set) -> None."""
    lines = _lines(output)
    if not lines:
        return None
    m = re.fullmatch(r"([0-9]{1,20})([MG])", lines[-1])  # bounded: int() of 4301 digits raises
    if m is None:
        raise UnexpectedOutput(f"unexpected pinned memory limit {output!r}: expected <n>M or <n>G")
    return int(m.group(1)) * UNITS[m.group(2)]


def mem_limit_as_displayed(nbytes: int) -> int:
    """What ``get_default_device_pinned_mem_limit`` prints back, in bytes, for a limit set to
    ``nbytes``: whole MiB below 1 GiB, whole GiB (rounded down) from 1 GiB on."""
    mib = max(nbytes >> 20, 1)
    return (mib >> 10 << 30) if mib >= 1024 else mib << 20


def parse_priority(output: str) -> int:
    lines = _lines(output)
    if not lines or lines[-1] not in ("0", "1"):
        raise UnexpectedOutput(f"unexpected client priority {output!r}: expected 0 or 1")
    return int(lines[-1])


def parse_server_status(output: str) -> str:
    """``ACTIVE`` (possibly after the PID or a label) -> one of SERVER_STATES."""
    for word in reversed(output.replace(":", " ").split()):
        if word.upper() in SERVER_STATES:
            return word.upper()
    raise UnexpectedOutput(f"unexpected server status {output!r}: expected one of {', '.join(SERVER_STATES)}")


def parse_device_client_list(output: str) -> dict[str, list[int]]:
    """Lines ``DEVICE PID PID...`` (device UUID or ordinal, then client PIDs) -> {device: pids}."""
    result: dict[str, list[int]] = {}
    for line in _lines(output):
        device, *rest = line.replace(",", " ").split()
        result[device] = parse_pids(" ".join(rest))
    return result


def parse_ps(output: str) -> list[PsEntry]:
    """The ``ps`` table (``PID ID SERVER DEVICE NAMESPACE COMMAND``); COMMAND may hold spaces."""
    entries = []
    for line in _lines(output):
        if line.startswith("PID") or line == "Server not found":
            continue
        parts = line.split(None, 5)
        if len(parts) < 5 or not all(is_decimal(p) for p in parts[:3]):
            raise UnexpectedOutput(f"unexpected ps line {line!r}: expected PID ID SERVER DEVICE NAMESPACE COMMAND")
        pid, cid, server = (int(p) for p in parts[:3])
        entries.append(PsEntry(pid, cid, server, parts[3], parts[4], parts[5] if len(parts) > 5 else ""))
    return entries


def parse_terminate(output: str) -> int:
    """``terminate_client`` prints a CUresult last: 0 is success."""
    lines = _lines(output)
    if not lines or not is_decimal(lines[-1].removeprefix("-")):
        raise UnexpectedOutput(f"unexpected terminate_client answer {output!r}: expected a CUDA result code")
    return int(lines[-1])


# ---------------------------------------------------------------- the front-end


class Control:
    """Commands to the daemon serving ``pipe_dir``, through the front-end ``binary``."""

    def __init__(self, binary: str, pipe_dir: str, log_dir: str | None = None, timeout: float = 3.0) -> None:
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.timeout = timeout

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = self.pipe_dir
        if self.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        return env

    def call(self, command: str, timeout: float | None = None) -> str:
        """Send one command; the text printed. While another front-end holds the daemon, the
        command is tried again until the timeout. Raises DaemonNotRunning, ControlTimeout,
        ControlBusy, CommandRejected/UnknownCommand, ControlError."""
        sentinel = not command.startswith("quit")  # the daemon is gone after quit
        script = f"{command}\n{SENTINEL}\n" if sentinel else f"{command}\n"
        out = self._exchange(command, script, sentinel, timeout)
        answer = strip_sentinel(out) if sentinel else out
        check_rejection(command, answer)
        return answer

    def batch(self, commands: list[str], timeout: float | None = None) -> list[str]:
        """Send ``commands`` in ONE front-end session; the answer to each. The daemon serves one
        front-end at a time, so no other front-end's command comes between two of these (a
        value set and read back here is what this session set). Raises as :meth:`call`."""
        script = "".join(f"{command}\n{MARK}\n" for command in commands)
        label = f"{commands[0]} (+{len(commands) - 1} in one session)" if len(commands) > 1 else commands[0]
        answers = split_answers(self._exchange(label, script, True, timeout), len(commands))
        for command, answer in zip(commands, answers, strict=True):
            check_rejection(command, answer)
        return answers

    def _exchange(self, label: str, script: str, answers: bool, timeout: float | None) -> str:
        """Run one front-end session with ``script``; its stdout. ``answers``: the script ends
        in a command whose answer is never empty, so an empty stdout means "not served"."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        pause, tries, refused = BUSY_RETRY[0], 0, False
        while True:
            tries += 1
            try:
                proc = self._run_once(label, script, limit, max(deadline - time.monotonic(), 0.001))
            except ControlTimeout:
                if not refused:
                    raise
                # the last try ran out of the time left: the daemon had said it was busy, not hung
                raise _busy(label, tries, limit) from None
            out = proc.stdout + proc.stderr
            busy = BUSY in out if proc.returncode != 0 else (answers and not proc.stdout.strip())
            refused = refused or busy
            if not (busy or (proc.returncode != 0 and not out.strip())):  # a silent exit 1: try again too
                break
            if time.monotonic() + pause >= deadline:
                if not busy and not refused:
                    break  # only silent failures: reported as the front-end's failure below
                raise _busy(label, tries, limit)
            time.sleep(pause)
            pause = min(pause * 2, BUSY_RETRY[1])
        log.debug(
            "control command=%r rc=%d tries=%d seconds=%.3f output=%r",
            label,
            proc.returncode,
            tries,
            time.monotonic() - start,
            out,
        )
        if proc.returncode != 0:
            text = " ".join(_lines(out)) or f"exit status {proc.returncode}"
            if any(marker in out for marker in NOT_RUNNING):
                raise DaemonNotRunning(f"{label!r}: no MPS control daemon on pipe dir {self.pipe_dir}: {text}")
            raise ControlError(f"{label!r}: front-end failed: {text}")
        return proc.stdout

    def _run_once(self, command: str, script: str, limit: float, left: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.binary],
                input=script,
                capture_output=True,
                text=True,
                timeout=left,
                env=self.env(),
            )
        except subprocess.TimeoutExpired as exc:
            raise ControlTimeout(f"{command!r}: no answer from the MPS control daemon in {limit:g}s") from exc
        except OSError as exc:
            raise ControlError(f"cannot run control binary {self.binary!r}: {exc.strerror}") from exc

    # ---- daemon-wide defaults (apply to servers started afterwards)

    def get_default_active_thread_percentage(self) -> float:
        return parse_percentage(self.call("get_default_active_thread_percentage"))

    def set_default_active_thread_percentage(self, percent: float) -> float:
        """The value now in force as printed; it is the OLD value when the daemon rejected it."""
        return parse_percentage(self.call(f"set_default_active_thread_percentage {percent:g}"))

    def get_default_device_pinned_mem_limit(self, device: int | str) -> int | None:
        return parse_mem_limit(self.call(f"get_default_device_pinned_mem_limit {device}"))

    def set_default_device_pinned_mem_limit(self, device: int | str, value: str) -> None:
        self.call(f"set_default_device_pinned_mem_limit {device} {value}")

    def get_default_client_priority(self) -> int:
        return parse_priority(self.call("get_default_client_priority"))

    def set_default_client_priority(self, priority: int) -> None:
        self.call(f"set_default_client_priority {priority}")

    # ---- servers and clients

    def get_server_list(self) -> list[int]:
        return parse_pids(self.call("get_server_list"))

    def start_server(self, uid: int) -> None:
        self.call(f"start_server -uid {uid}")

    def shutdown_server(self, pid: int, force: bool = False) -> None:
        self.call(f"shutdown_server {pid}" + (" -f" if force else ""))

    def get_server_status(self, pid: int) -> str:
        """INITIALIZING, ACTIVE or FAULT; UnknownCommand before driver 550."""
        return parse_server_status(self.call(f"get_server_status {pid}"))

    def get_client_list(self, server: int) -> list[int]:
        return parse_pids(self.call(f"get_client_list {server}"))

    def get_device_client_list(self, server: int | None = None) -> dict[str, list[int]]:
        return parse_device_client_list(self.call("get_device_client_list" + ("" if server is None else f" {server}")))

    def set_active_thread_percentage(self, server: int, percent: float) -> float:
        return parse_percentage(self.call(f"set_active_thread_percentage {server} {percent:g}"))

    def set_device_pinned_mem_limit(self, server: int, device: int | str, value: str) -> None:
        self.call(f"set_device_pinned_mem_limit {server} {device} {value}")

    def terminate_client(self, server: int, client: int) -> int:
        """The CUresult of the termination (0: done)."""
        return parse_terminate(self.call(f"terminate_client {server} {client}"))

    def ps(self, pid: int | None = None) -> list[PsEntry]:
        try:
            return parse_ps(self.call("ps" + ("" if pid is None else f" -p {pid}")))
        except CommandRejected as exc:
            if "Server not found" in str(exc):  # no server running: no clients
                return []
            raise

    def quit(self, timeout_s: int | None = None, wait: float | None = None) -> None:
        """Synchronous: returns once the daemon exits. ``timeout_s`` forces servers down after it."""
        self.call("quit" + ("" if timeout_s is None else f" -t {timeout_s}"), timeout=wait)


# ---------------------------------------------------------------- servers started early


def limit_early_servers(control: Control, config: "Config") -> list[int]:
    """Servers that started between the daemon's first answer and the defaults (a client
    connected in that window) get the configured active thread percentage and pinned limits
    per server; those reach their new clients. The servers touched; one that exits
    meanwhile is skipped."""
    touched = []
    for server in control.get_server_list():
        try:
            control.set_active_thread_percentage(server, config.active_thread_percentage)
            for device, nbytes in config.pinned_mem_limit.items():
                control.set_device_pinned_mem_limit(server, device, format_size_mps_control(nbytes))
        except CommandRejected as exc:
            log.info("server gone before its settings were applied server=%d error=%s", server, exc)
            continue
        log.warning(
            "server started before the defaults were applied server=%d: settings applied to it for new clients", server
        )
        touched.append(server)
    return touched
