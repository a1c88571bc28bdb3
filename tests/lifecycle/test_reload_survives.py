"""A SIGHUP whose new config fails to load, for any reason, keeps ``mpsd run``, the running
config and the control daemon (and with it every MPS client of the node), and logs one line.
The real ``mpsd run`` with the real nvidia-cuda-mps-control, real files, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mpsd import cli
from mpsd import config as cfg
from mpsd.errors import ConfigError
from tests import procs
from tests.test_cli import flags, mpsd
from tests.config.test_config_file import BAD_FILES

REPO = Path(__file__).resolve().parents[2]
GOOD = "version: v1\nactiveThreadPercentage: 70\n"
UUID = "GPU-00000000-1111-2222-3333-444444444444"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ ")
BAD_IN_E2E = [
    "latin1-comment",
    "int-5000-digits",
    "float-x",
    "timestamp-word",
    "python-apply",
    "deep-flow-list",
    "alias-bomb",
    "nul-byte",
    "value-with-newlines",
    "too-large",
]


class Output:
    """mpsd's merged stdout/stderr, read line by line in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def join(self) -> None:
        self._thread.join(30)


def start_run(config: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Output]:
    """``mpsd run --config CONFIG ARGS``, its merged output read in a thread."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpsd", "run", "--config", str(config), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    return proc, Output(proc)


def wait_until(predicate, proc: subprocess.Popen, out: Output, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"mpsd exited with {proc.returncode} waiting for {what}:\n" + "\n".join(out.lines)
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + "\n".join(out.lines[-20:])
        time.sleep(0.1)


def control_daemons(pid: int) -> list[int]:
    return [d.pid for d in procs.control_daemons(pid)]


def make_bad(path: Path, case: str) -> None:
    if case == "directory":
        path.unlink()
        path.mkdir()
    elif case == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif case == "missing":
        path.unlink()
    else:
        path.write_bytes(BAD_FILES[case][0])


def make_good(path: Path, text: str = GOOD) -> None:
    if path.is_dir():
        path.rmdir()
    elif path.exists() and not path.is_file():
        path.unlink()
    path.write_text(text)


@pytest.mark.mps_binary
def test_a_failed_reload_keeps_mpsd_the_daemon_and_the_running_config(mps_control, mps_dirs, tmp_path):
    config = tmp_path / "mpsd.yaml"
    config.write_text(GOOD)
    args = flags(mps_control, mps_dirs)
    proc, out = start_run(config, args)

    def atp():
        result = mpsd("status", "--json", *args)
        return json.loads(result.stdout)["settings"].get("activeThreadPercentage") if result.stdout else None

    cases = BAD_IN_E2E + ["directory", "fifo", "missing"]
    try:
        wait_until(lambda: atp() == 70.0, proc, out, "the first config applied")
        daemons = control_daemons(proc.pid)
        assert len(daemons) == 1
        for n, case in enumerate(cases, start=1):
            make_bad(config, case)
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda n=n: out.count("reload failed, keeping the running config") == n, proc, out, case, 30)
            assert control_daemons(proc.pid) == daemons, f"{case}: the control daemon changed"
            make_good(config)
        assert atp() == 70.0, "the running defaults changed"
        make_good(config, "version: v1\nactiveThreadPercentage: 35\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: atp() == 35.0, proc, out, "a good config after the bad ones")
        assert control_daemons(proc.pid) == daemons
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()
    failures = [line for line in out.lines if "reload failed" in line]
    assert len(failures) == len(cases), "\n".join(failures)
    for case, line in zip(cases, failures, strict=True):
        assert str(config) in line, (case, line)
    # one line each: every line mpsd wrote is a log line (no traceback, no message running on)
    assert [line for line in out.lines if not LOG_LINE.match(line)] == []
    assert "reloaded applied=activeThreadPercentage" in "\n".join(out.lines)


def test_the_reloader_turns_any_failure_into_one_config_error_line(monkeypatch, tmp_path):
    config = tmp_path / "mpsd.yaml"
    config.write_text(GOOD)
    args = cli.build_parser().parse_args(["run", "--config", str(config)])
    reload = cli.reloader(args, {})
    assert reload().active_thread_percentage == 70.0

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(cfg, "load", broken)
    with pytest.raises(ConfigError, match=r"^unexpected RuntimeError: a bug over two lines$"):
        reload()

    def recursing(*_args, **_kwargs):
        return recursing()

    monkeypatch.setattr(cfg, "load", recursing)
    with pytest.raises(ConfigError, match="^unexpected RecursionError"):
        reload()


@pytest.mark.mps_binary
def test_an_unexpected_reload_error_keeps_the_supervisor_and_daemon(make_config, run_supervisor, tmp_path, monkeypatch):
    """The same through the Supervisor in process, with a failure no file can cause today."""
    config_file = tmp_path / "mpsd.yaml"
    config_file.write_text(GOOD)
    base = make_config()
    argv = ["run", "--config", str(config_file), f"--control-binary={base.control_binary}"]
    argv += [f"--pipe-dir={base.pipe_dir}", f"--log-dir={base.log_dir}", "--metrics-address=", "--health-interval=0.3s"]
    args = cli.build_parser().parse_args(argv)
    first = cli.resolve(args, {})
    r = run_supervisor(first, reload=cli.reloader(args, {}))
    r.wait_for(lambda s: s.daemon_up and s.configured, what="daemon up")
    pid = r.sup.status().pid
    real_load = cfg.load
    monkeypatch.setattr(cfg, "load", lambda *a, **k: 1 / 0)
    r.sup.reload()
    state = r.wait_for(lambda s: "reload failed" in s.last_error, what="reload failure")
    assert "unexpected ZeroDivisionError" in state.last_error and "\n" not in state.last_error
    assert r.thread.is_alive() and r.sup.status().pid == pid and r.sup.config is first
    assert r.sup.status().config_generation == 1
    monkeypatch.setattr(cfg, "load", real_load)
    config_file.write_text("version: v1\nactiveThreadPercentage: 35\n")
    r.sup.reload()
    deadline = time.monotonic() + 30
    while r.sup.config.active_thread_percentage != 35.0:
        assert time.monotonic() < deadline, "the good config was not reloaded"
        time.sleep(0.05)
    assert r.sup.status().pid == pid


@pytest.mark.mps_binary
def test_a_sighup_while_mpsd_starts_is_a_reload_not_its_death(mps_control, mps_dirs, tmp_path):
    """SIGHUP's default action is to terminate: one sent while ``mpsd run`` was still starting
    (here: stopped inside NVML's init, which reads the fake's config from a FIFO until the test
    writes it) killed mpsd before its handlers were installed. Now it is remembered and acted on."""
    from tests.fakes.nvml_build import build_fake_nvml, nvml_config_text

    nvml = build_fake_nvml(tmp_path / "nvml")
    fifo = tmp_path / "nvml.conf"
    os.mkfifo(fifo)
    config = tmp_path / "mpsd.yaml"
    config.write_text(GOOD)
    args = flags(mps_control, mps_dirs, **{"nvml-library": str(nvml), "log-level": "info"})
    env = dict(os.environ, FAKE_NVML_CONFIG=str(fifo))
    proc, out = start_run(config, args, env)
    try:
        deadline = time.monotonic() + 60
        while True:  # a writer can open the FIFO once mpsd, inside nvmlInit, opened it to read
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "\n".join(out.lines)
                time.sleep(0.01)
        proc.send_signal(signal.SIGHUP)
        os.set_blocking(fd, True)
        try:  # the signal may end the fake's read early (EINTR): it then sees no GPU, and goes on
            with os.fdopen(fd, "w") as w:
                w.write(nvml_config_text([(UUID, 1 << 34, 0, (9, 0), False, "Fake")]))
        except BrokenPipeError:
            pass
        wait_until(lambda: out.count("reloaded applied=") == 1, proc, out, "the reload asked for while starting")
        assert out.count("SIGHUP received while starting") == 1
        assert len(control_daemons(proc.pid)) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "\n".join(out.lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.join()


def test_a_reload_stuck_reading_the_file_gives_up_in_bounded_time(monkeypatch, tmp_path):
    """A config on a hung mount blocks open() for ever; the supervisor loop that called the
    reloader must get a one-line error back in bounded time, and later reloads work again
    once the read returns."""
    config = tmp_path / "mpsd.yaml"
    config.write_text(GOOD)
    args = cli.build_parser().parse_args(["run", "--config", str(config)])
    reload = cli.reloader(args, {}, timeout=0.5)
    release = threading.Event()
    real_load = cfg.load

    def hung(*a, **kw):
        release.wait(60)
        return real_load(*a, **kw)

    monkeypatch.setattr(cfg, "load", hung)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(config))}: not read within 0.5s \(a hung filesystem\?\)"):
        reload()
    assert time.monotonic() - started < 5
    with pytest.raises(ConfigError, match="an earlier reload is still reading it"):
        reload()  # at once: no second thread stuck behind the first
    release.set()
    deadline = time.monotonic() + 30
    while True:
        try:
            assert reload().active_thread_percentage == 70.0
            break
        except ConfigError as exc:
            assert "still reading" in str(exc) and time.monotonic() < deadline
            time.sleep(0.05)
