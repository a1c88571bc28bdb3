"""Inside a MIG instance the shim caps the instance's slice: the container's one CUDA device is the
instance (cuMemGetInfo reports the cap), and NVML shows both the GPU (index 0, the limit's ordinal)
and the instance's MIG device handle, whose NVML index counts MIG devices under the GPU (here 2):
it is matched through the CUDA device with its UUID, not by that index (without it the handle
reported the whole instance)."""

from __future__ import annotations

import subprocess
import sys

from tests.fakes.nvml_build import mig_line, nvml_config_text

from tests.shim.conftest import G, ShimEnv

MIG_UUID = "MIG-face0000-0000-0000-0000-000000000000"  # the fake libcuda's device 0, as a MIG device

CLIENT = r"""
import ctypes, pynvml
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cuda.cuCtxSetCurrent(ctx) == 0
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2)
print(total.value, pynvml.nvmlDeviceGetMemoryInfo(gpu).total, pynvml.nvmlDeviceGetMemoryInfo(mig).total,
      pynvml.nvmlDeviceGetMemoryInfo(mig, pynvml.nvmlMemory_v2).total)
"""


def test_cuda_and_nvml_report_the_instances_slice(shim: ShimEnv) -> None:
    (shim.tmp / "nvml.conf").write_text(
        nvml_config_text([("GPU-00000000-0000-0000-0000-0000000000a0", 80 * G, 0, (9, 0), True, "NVIDIA H100")],
                         privileged=True)  # the GPU's own memory query; unprivileged NVML refuses it in MIG mode
        + "".join(mig_line(0, i, f"MIG-beef000{i}-0000-0000-0000-000000000000", 2 + i, 0, 1, 1, 16, 10 * G, 0,
                           "1g.10gb") for i in range(2))  # NVML indices count instances: this one is the third
        + mig_line(0, 2, MIG_UUID, 1, 0, 1, 1, 16, 10 * G, 0, "1g.10gb"))
    env = shim.env("0=2G", extra={"FAKE_CUDA_DEVICES": "10G"})  # the container sees the instance
    proc = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(2 * G)] * 4
