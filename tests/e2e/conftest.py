"""Helpers for end-to-end tests: run a snippet of driver-client Python in a child process.

`run_py(code, env)` runs `code` after `from tests.e2e.cudrv import *` in a fresh interpreter
(so the driver and the shim load exactly as in a real client) and returns a ClientResult with
the JSON objects the snippet printed with `emit(...)` and its stderr; it fails the test with
the child's output if the exit status is not the expected one.
"""
from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PRELUDE = "from tests.e2e.cudrv import *\n"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class ClientResult:
    records: list[dict[str, Any]]
    stderr: str

    @property
    def one(self) -> dict[str, Any]:
        assert len(self.records) == 1, self.records
        return self.records[0]


RunPy = Callable[..., ClientResult]


@pytest.fixture
def run_py(run_client: Callable[..., Any]) -> RunPy:
    def run(code: str, env: Mapping[str, str], timeout: float = 60, expect_rc: int = 0) -> ClientResult:
        proc = run_client([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=env, timeout=timeout)
        if proc.returncode != expect_rc:
            pytest.fail(f"client exited {proc.returncode} (wanted {expect_rc})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        return ClientResult(records, proc.stderr)

    return run


@pytest.fixture
def fake_env(fake_cuda_dir: Any) -> Callable[..., dict[str, str]]:
    """Environment for a client of the bare fake driver (no shim)."""

    def make(devices: str = "16G", **extra: str) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": str(fake_cuda_dir), "FAKE_CUDA_DEVICES": devices, **extra}

    return make
