"""Builds the C core's test drivers (tests/core/Makefile) once per session and talks to them.

- `core_bin`: the build directory holding limits_cli, region_cli, track_test, each also as a
  `*_san` twin built with AddressSanitizer + UndefinedBehaviorSanitizer, and region_cli_tsan
  (ThreadSanitizer) and region_cli_fault (fault injection: MPSSHIM_FAULT, csrc/region_impl.h).
- `LineProc`: a driver process answering one stdout line per stdin line.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import pytest

HERE = Path(__file__).resolve().parent
VARIANTS = ["", "_san"]
# Sanitizer runs must fail loudly; leak checking off (drivers exit with live tables on purpose).
SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
}


def driver_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(SAN_ENV)
    env.pop("LD_PRELOAD", None)
    return env


@pytest.fixture(scope="session")
def core_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built per session in a temporary directory, so concurrent sessions never share binaries."""
    build = tmp_path_factory.mktemp("corebin")
    proc = subprocess.run(
        ["make", "-s", "-j2", "-C", str(HERE), f"BUILD={build}"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"building the core test drivers failed:\n{proc.stdout}{proc.stderr}")
    return build


class LineProc:
    """A long-running driver: ask(line) writes one line and returns its one-line answer."""

    def __init__(
        self, argv: list[str | os.PathLike[str]], extra_env: dict[str, str] | None = None, **popen: object
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.killed = False
        self._stderr = ""
        self.proc = subprocess.Popen(  # noqa: S603 - our own test driver
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**driver_env(), **(extra_env or {})},
            **popen,  # type: ignore[arg-type]
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, line: str | bytes, within: float | None = None) -> str:
        """One line in, one line out; with `within`, fail unless the answer comes in that many
        seconds (a driver blocked on someone else's behalf)."""
        data = line if isinstance(line, bytes) else line.encode()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()
        if within is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], within)
            assert ready, f"{self.argv} gave no answer to {data!r} within {within} s (blocked)"
        answer = self.proc.stdout.readline()
        if not answer:
            self.proc.wait(timeout=10)
            err = self.stderr_text()
            raise AssertionError(f"{self.argv} died ({self.proc.returncode}) on {data!r}:\n{err}")
        return answer.decode(errors="replace").rstrip("\n")

    def close(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self._stderr = self.proc.stderr.read().decode(errors="replace")
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash): the driver's exit status is then not checked."""
        self.killed = True
        self.proc.kill()
        self.proc.wait(timeout=20)

    def stderr_text(self) -> str:
        if self.proc.stderr is not None and not self.proc.stderr.closed and self.proc.poll() is not None:
            self._stderr = self.proc.stderr.read().decode(errors="replace")
        return self._stderr

    def __enter__(self) -> LineProc:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        rc = self.close()
        if t is None and not self.killed and rc != 0:
            raise AssertionError(f"{self.argv} exited {rc}:\n{self.stderr_text()}")


Repl = Callable[..., LineProc]


@pytest.fixture
def repl(core_bin: Path) -> Iterator[Repl]:
    procs: list[LineProc] = []

    def start(variant: str = "_san", **popen: object) -> LineProc:
        proc = LineProc([core_bin / f"region_cli{variant}", "repl"], **popen)
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        rc = p.close()
        assert p.killed or rc == 0, p.stderr_text()


def snap(proc: LineProc, path: Path) -> dict[str, object]:
    """Parse the driver's snapshot line: version, nprocs, cap0, used0, used1, procs [(pid, alive, used0)]."""
    line = proc.ask(f"snapshot {path}")
    assert line.startswith("ok "), line
    fields = dict(f.split("=", 1) for f in line[3:].split())
    procs = [tuple(int(x) for x in p.split(":")) for p in fields.pop("procs").split(",") if p]
    out: dict[str, object] = {k: int(v) for k, v in fields.items()}
    out["procs"] = procs
    return out


@pytest.fixture
def start(core_bin: Path) -> Iterator[Callable[..., LineProc]]:
    """start(*args, variant="", fault=None): a driver (repl unless args say otherwise), with
    MPSSHIM_FAULT=fault for the _fault build; stopped ones are continued, all killed at the end."""
    procs: list[LineProc] = []

    def run(*args: str, variant: str = "", fault: str | None = None) -> LineProc:
        p = LineProc(
            [core_bin / f"region_cli{variant}", *(args or ("repl",))],
            extra_env={"MPSSHIM_FAULT": fault} if fault else None,
        )
        procs.append(p)
        return p

    yield run
    for p in procs:
        if p.proc.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        else:
            p.close()
