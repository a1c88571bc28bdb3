import threading

from mpsd.alloc.clientenv import client_env
from mpsd.lifecycle.health import HealthBoard


def test_board_update_bumps_generation_only_on_change():
    board = HealthBoard()
    s1 = board.update(daemon_up=True, configured=True)
    assert s1.generation == 1 and s1.gpu_healthy(0)
    assert board.update(daemon_up=True).generation == 1
    s2 = board.update(faulted_gpus={1})
    assert s2.generation == 2 and s2.gpu_healthy(0) and not s2.gpu_healthy(1)


def test_wait_change_wakes_on_update_and_times_out_without():
    board = HealthBoard()
    assert board.wait_change(0, timeout=0.05).generation == 0
    threading.Timer(0.05, board.update, kwargs={"daemon_up": True}).start()
    assert board.wait_change(0, timeout=5).daemon_up


def test_client_env_full_slice():
    env = client_env(
        pipe_dir="/tmp/nvidia-mps",
        active_thread_percentage=30,
        memory_limits={0: 4 << 30},
        shim_library="/opt/libmpsshim.so",
        region_path="/run/mpsd/region",
    )
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G",
        "LD_PRELOAD": "/opt/libmpsshim.so",
        "MPSSHIM_REGION": "/run/mpsd/region",
        # processes sharing a region's cap: frameworks allocate on demand (mpsd/alloc/frameworks.py)
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }


def test_client_env_minimal_and_fractional_percentage():
    assert client_env(pipe_dir="/p") == {"CUDA_MPS_PIPE_DIRECTORY": "/p"}
    assert client_env(pipe_dir="/p", active_thread_percentage=12.5)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "12.5"
