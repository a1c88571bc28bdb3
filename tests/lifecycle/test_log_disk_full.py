"""A tenant flooding the daemon's log on a small log filesystem (issue 33, row 6), as it runs: a
UID-1000 front-end sends long unknown commands through ``control`` without end (the daemon logs
each, twice its length), the daemon started detached writes control.log itself, and mpsd has
adopted it with a health interval far longer than the flood needs to fill the disk. The disk
must free itself: the size is watched far more often than the health interval, and a copy that
the full disk refuses does not keep the file from being truncated."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.daemon import genuine
from tests.daemon.test_genuine import kill_and_reap, start
from tests.lifecycle.test_supervisor import wait_until

pytestmark = [
    pytest.mark.mps_binary,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs and a flooder of another UID need root"),
]
DISK = 4 << 20
MAX_SIZE = 256 << 10
FLOOD = "import sys\nline = 'bogus' + 'x' * 4000 + '\\n'\nwhile True:\n    sys.stdout.write(line)\n"


@pytest.fixture
def small_log_disk(mps_dirs):
    _pipe, logs = mps_dirs
    logs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0755", "tmpfs", str(logs)], check=True)
    yield logs
    subprocess.run(["umount", "-l", str(logs)], check=True)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def flooder(binary: str, pipe_dir: str) -> subprocess.Popen:
    """A UID-1000 front-end fed long unknown commands for ever, started again when it ends."""
    loop = f'while :; do /usr/bin/python3 -c "$0" | {binary} >/dev/null 2>&1; done'
    return subprocess.Popen(["sh", "-c", loop, FLOOD], env=dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir),
                            user=1000, group=1000, extra_groups=[], start_new_session=True)


def test_a_flood_on_a_small_log_disk_frees_itself_between_health_rounds(make_config, run_supervisor, small_log_disk):
    config = make_config(**{"daemon-lifecycle": "independent", "health-interval": "120s",
                            "log-max-size": str(MAX_SIZE), "log-keep": "1"})
    log = small_log_disk / "control.log"
    pid = start(config)
    flood = None
    try:
        r = run_supervisor(config)
        r.wait_for(lambda s: s.daemon_up and s.configured, what="the daemon adopted")
        checks = r.sup.status().health_checks
        flood = flooder(config.control_binary, config.pipe_dir)
        wait_until(lambda: log.stat().st_size > 2 * MAX_SIZE or free(small_log_disk) < MAX_SIZE,
                   timeout=60, what="the flood writing the log")
        time.sleep(10)  # the flood goes on: the disk fills again and again
        os.killpg(flood.pid, 9)
        flood.wait()
        flood = None
        # Whatever the last look found, the disk frees itself well before the next health round.
        wait_until(lambda: free(small_log_disk) >= DISK // 2 and log.stat().st_size <= MAX_SIZE + (64 << 10),
                   timeout=30, what=f"the log disk freed (free {free(small_log_disk)}, log {log.stat().st_size})")
        assert r.sup.status().health_checks == checks, "a health round came: the test proves nothing"
        assert genuine.control_lock_holder(config.pipe_dir) == pid and r.sup.status().restarts == 0
        r.stop()
    finally:
        if flood is not None:
            os.killpg(flood.pid, 9)
            flood.wait()
        while (held := genuine.control_lock_holder(config.pipe_dir)) is not None:
            kill_and_reap(held)


def test_keeps_the_config_flags_this_test_relies_on():
    # the names above are the config's (a rename would make the test above set nothing)
    c = cfg.load(None, {}, {"log-max-size": str(MAX_SIZE), "log-keep": "1", "health-interval": "120s"})
    assert (c.log_max_size, c.log_keep, c.health_interval) == (MAX_SIZE, 1, 120.0)
