"""pipeDir is bounded by what the real control daemon can listen on: its sockets
(PIPE/control_privileged) must fit a unix socket address. A longer pipe dir used to make
`mpsd run` loop on "control daemon exited at start" with no reason given."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.errors import ConfigError

LIMIT = cfg.MAX_PIPE_DIR_BYTES


def padded_dir(base: Path, length: int) -> Path:
    """A path under ``base`` of exactly ``length`` bytes."""
    path = base / ("p" * (length - len(str(base)) - 1))
    assert len(os.fsencode(str(path))) == length
    return path


def test_a_pipe_dir_at_the_limit_is_accepted_one_byte_more_is_one_line():
    at_limit = "/" + "a" * (LIMIT - 1)
    assert cfg.load(None, {}, {"pipe-dir": at_limit}).pipe_dir == at_limit
    with pytest.raises(ConfigError) as exc:
        cfg.load(None, {}, {"pipe-dir": at_limit + "b"})
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("flag --pipe-dir: pipeDir: expected a path of at most 87 bytes")
    with pytest.raises(ConfigError, match=r"^environment MPSD_PIPE_DIR: pipeDir: expected a path of at most"):
        cfg.load(None, {"MPSD_PIPE_DIR": at_limit + "/x"}, {})


def _daemon_serves(binary: Path, pipe: Path) -> bool:
    """Start the real daemon (-d) on ``pipe``; True if a front-end gets an answer. Quits it."""
    pipe.mkdir(parents=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe)}
    subprocess.run([str(binary), "-d"], env=env, capture_output=True, timeout=20)
    try:
        answer = subprocess.run(
            [str(binary)], input="get_default_active_thread_percentage\n", env=env,
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        return answer.returncode == 0 and answer.stdout.strip() == "100.0"
    finally:
        subprocess.run([str(binary)], input="quit\n", env=env, capture_output=True, text=True, timeout=20)


@pytest.mark.every_mps_version
@pytest.mark.mps_binary
def test_the_limit_is_the_real_daemons(mps_control):
    base = Path(tempfile.mkdtemp(prefix="pl", dir="/tmp"))
    try:
        assert _daemon_serves(mps_control, padded_dir(base / "ok", LIMIT))
        assert not _daemon_serves(mps_control, padded_dir(base / "long", LIMIT + 1))
    finally:
        shutil.rmtree(base, ignore_errors=True)
