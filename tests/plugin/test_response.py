"""Allocate's environment and mounts as a pure function of the plan and the host paths."""

from __future__ import annotations

import pytest

from mpsd.errors import PluginError
from mpsd.alloc.container import HostPaths, container_env, container_mounts
from mpsd.alloc.slicing import plan_allocation

from tests.plugin.conftest import GIB, FakeGpu

G = [FakeGpu(0, "GPU-a", "x", 80 * GIB), FakeGpu(1, "GPU-b", "x", 80 * GIB)]
PATHS = HostPaths(pipe_dir="/run/mps", region_dir="/var/lib/mpsd/regions", shim_host_dir="/var/lib/mpsd/lib")


@pytest.mark.parametrize(
    "devices, expected",
    [
        (
            ["GPU-a::0"],
            {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G",
             "NVIDIA_VISIBLE_DEVICES": "GPU-a"},
        ),
        (
            ["GPU-b::0", "GPU-b::1", "GPU-a::5"],
            {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G,1=16G",
             "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"},
        ),
    ],
)
def test_container_env(devices, expected):
    env = container_env(plan_allocation(devices, G, 10), "/run/mps")
    assert env == {
        **expected,
        "CUDA_MPS_PIPE_DIRECTORY": "/run/mps",
        "LD_PRELOAD": "/run/mpsd-shim/libmpsshim.so.3",
        "MPSSHIM_REGION": "/run/mpsd/region",
        # the container's processes share one cap: frameworks allocate on demand (issue 21, defect 8)
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }


def test_container_mounts():
    # the pipe dir read-only: a pod can connect to the daemon's sockets, never plant, rename or
    # delete one (tests/e2e/test_pipe_dir_readonly.py runs the real front-end through it)
    plan = plan_allocation(["GPU-a::0"], G, 10)
    own = f"/var/lib/mpsd/regions/{plan.allocation_id}-0123456789ab"
    mounts = [(m.host, m.container, m.read_only) for m in container_mounts(plan, PATHS, own)]
    assert mounts == [
        ("/run/mps", "/run/mps", True),
        ("/dev/null", "/run/mps/log", True),  # the daemon's log FIFO, which a read-only mount leaves writable
        (own, "/run/mpsd", False),
        ("/var/lib/mpsd/lib", "/run/mpsd-shim", True),
    ]
    tmpfs = HostPaths(PATHS.pipe_dir, PATHS.region_dir, PATHS.shim_host_dir, ipc_mode="tmpfs", shm_dir="/var/lib/mpsd/shm")
    assert ("/var/lib/mpsd/shm", "/dev/shm", False) in [
        (m.host, m.container, m.read_only) for m in container_mounts(plan, tmpfs, own)
    ]


@pytest.mark.parametrize(
    "ipc_mode, shm_dir, message",
    [("hostipc", "", "bad ipcMode 'hostipc': expected one of hostIPC, tmpfs"), ("tmpfs", "", "ipcMode tmpfs needs shmDir")],
)
def test_host_paths_reject_bad_ipc_settings(ipc_mode, shm_dir, message):
    with pytest.raises(PluginError, match=message):
        HostPaths("/p", "/r", "/l", ipc_mode=ipc_mode, shm_dir=shm_dir)


@pytest.mark.parametrize(
    "paths, message",
    [
        (dict(pipe_dir="tmp/nvidia-mps"), "bad pipeDir 'tmp/nvidia-mps': expected an absolute host path"),
        (dict(region_dir="regions"), "bad regionDir 'regions'"),
        (dict(shim_host_dir="./lib"), "bad shimHostDir './lib'"),
        (dict(ipc_mode="tmpfs", shm_dir="shm"), "bad shmDir 'shm'"),
    ],
)
def test_host_paths_must_be_absolute(paths, message):
    fields = {"pipe_dir": "/p", "region_dir": "/r", "shim_host_dir": "/l", **paths}
    with pytest.raises(PluginError, match=message):
        HostPaths(**fields)
