"""A real CUDA client through a read-only pipe dir (issue 16 defect 4, the GPU side).

Pods get the pipe dir read-only (mpsd/alloc/container.py); without a GPU,
tests/daemon/test_pipe_dir_readonly.py shows that the real front-end reaches the daemon
that way from a podman container. Here a PyTorch client does real work through MPS with the
pipe dir remounted read-only in a private mount namespace (``unshare --mount``, root only), and
the test records what the client, its server and the daemon created in /dev/shm (what
``ipcMode: tmpfs`` shares between pods, docs/security.md).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.gpu.conftest import clean_env

READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
WORK = (
    "import torch\n"
    "a = torch.randn(2048, 2048, device='cuda')\n"
    "print(float((a @ a).sum()) != 0.0, flush=True)\n"
)


def shm_entries() -> dict[str, str]:
    found = {}
    for entry in Path("/dev/shm").iterdir():
        try:
            st = entry.lstat()
        except OSError:
            continue
        found[entry.name] = f"mode {stat.S_IMODE(st.st_mode):o} uid {st.st_uid} size {st.st_size}"
    return found


def test_a_cuda_client_works_through_a_read_only_pipe_dir(node, torch_python, record):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to remount the pipe dir read-only")
    pipe = node["pipe"]
    before_shm = shm_entries()
    env = clean_env(CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(node["logs"]))
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY, "sh", str(pipe),
         "sh", "-c", f'touch "{pipe}/x" 2>&1; exec "$@"', "sh", torch_python, "-c", WORK],
        env=env, capture_output=True, text=True, timeout=300,
    )
    control_log = (node["logs"] / "control.log").read_text()
    created_shm = {k: v for k, v in shm_entries().items() if before_shm.get(k) != v}
    record(returncode=probe.returncode, stdout=probe.stdout[-500:], stderr=probe.stderr[-2000:],
           pipe_dir_after=sorted(os.listdir(pipe)), dev_shm_created=created_shm)
    assert "Read-only file system" in probe.stdout, probe.stdout  # the mount was read-only indeed
    assert probe.returncode == 0 and "True" in probe.stdout, probe.stdout + probe.stderr
    assert "Starting new server" in control_log or "NEW CLIENT" in control_log, control_log[-2000:]
    assert "x" not in os.listdir(pipe)  # what the server itself adds there is recorded above
