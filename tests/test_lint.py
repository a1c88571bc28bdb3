"""The linter and the type checker pass on the whole tree, as configured in pyproject.toml
([tool.ruff], [tool.mypy]): a finding fails the suite (and so .ci/run), with its lines in the
failure. Both come with the test extras."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)


def test_ruff_finds_nothing() -> None:
    done = run("ruff", "check", "--output-format", "concise", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    done = run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))
    assert done.returncode == 0, done.stdout + done.stderr
