"""A GPU in MIG mode is never served whole: MPS cannot use it as one GPU (its instances have
daemons of their own). Before MIG support the device plugin offered it as whole-GPU slices."""

from __future__ import annotations

from types import SimpleNamespace

from mpsd.node import managed_gpus


def gpu(index: int, mig: bool):
    return SimpleNamespace(index=index, uuid=f"GPU-{index}", mig_enabled=mig, memory_total=1 << 30)


def test_a_gpu_in_mig_mode_is_not_managed_whole():
    gpus = [gpu(0, False), gpu(1, True), gpu(2, False)]
    assert [g.index for g in managed_gpus(gpus, None)] == [0, 2]
    assert [g.index for g in managed_gpus(gpus, "0,1")] == [0]
    assert [g.index for g in managed_gpus(gpus, "MIG-x")] == [0, 2]
