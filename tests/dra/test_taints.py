"""Device taints from the health board (mpsd/dra/taints.py): tables over a fake clock."""
from __future__ import annotations

import kubernetes_validate
import pytest

from mpsd.dra.slices import build_devices, build_slices
from mpsd.dra.taints import Tainter, reason, rfc3339
from mpsd.lifecycle.health import HealthState
from mpsd.inventory.nvml import Gpu
from tests.dra.apirules import resource_slice_errors

HEALTHY = HealthState(daemon_up=True, configured=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("state, index, why", [
    (HEALTHY, 0, ""),
    (HealthState(daemon_up=False), 0, "MPSDaemonDown"),
    (HealthState(daemon_up=True, configured=False), 1, "MPSNotConfigured"),
    (HealthState(daemon_up=True, configured=True, faulted_gpus=frozenset({1})), 1, "MPSServerFault"),
    (HealthState(daemon_up=True, configured=True, faulted_gpus=frozenset({1})), 0, ""),
    # a held control session blinds the health check: any pod can do that, so it taints nothing
    (HealthState(daemon_up=True, configured=True, unverified="control session held 45s"), 0, ""),
])
def test_reason(state: HealthState, index: int, why: str) -> None:
    assert reason(state, index) == why


def tainter(effect: str = "NoSchedule", after: float = 30.0) -> tuple[Tainter, Clock]:
    clock = Clock()
    return Tainter("gpu.mpsd.io", effect, after, clock=clock, wall=lambda: 1_800_000_000.0 + clock.now), clock


def test_a_gpu_is_tainted_once_unhealthy_for_taint_after_and_untainted_at_once_on_recovery() -> None:
    t, clock = tainter()
    down = HealthState(daemon_up=True, configured=True, faulted_gpus=frozenset({1}))
    assert t.taints(down, [0, 1]) == {}
    assert t.next_due() == 130.0
    clock.now = 129.9
    assert t.taints(down, [0, 1]) == {}
    clock.now = 130.0
    assert t.taints(down, [0, 1]) == {1: [{"key": "gpu.mpsd.io/unhealthy", "value": "MPSServerFault",
                                           "effect": "NoSchedule", "timeAdded": rfc3339(1_800_000_130.0)}]}
    assert t.next_due() is None
    clock.now = 500.0
    assert t.taints(down, [0, 1])[1][0]["timeAdded"] == rfc3339(1_800_000_130.0)  # the time stays
    assert t.taints(HEALTHY, [0, 1]) == {}
    clock.now = 501.0
    assert t.taints(down, [0, 1]) == {}  # a new episode waits its own taintAfter


def test_a_new_reason_is_a_new_taint_with_its_own_wait() -> None:
    t, clock = tainter(after=10)
    t.taints(HealthState(daemon_up=True, configured=True, faulted_gpus=frozenset({0})), [0])
    clock.now += 8
    assert t.taints(HealthState(daemon_up=False), [0]) == {}
    clock.now += 10
    assert t.taints(HealthState(daemon_up=False), [0])[0][0]["value"] == "MPSDaemonDown"


@pytest.mark.parametrize("effect", ["NoExecute", "none"])
def test_the_effect_is_the_operators(effect: str) -> None:
    t, clock = tainter(effect, after=0)
    out = t.taints(HealthState(daemon_up=False), [0, 1])
    assert out == {} if effect == "none" else {i: [dict(out[i][0], effect="NoExecute")] for i in (0, 1)}
    assert t.next_due() is None


def test_a_bad_effect_is_one_line() -> None:
    with pytest.raises(ValueError, match="^bad dra.taintEffect 'Evict': expected one of NoSchedule, NoExecute, none$"):
        Tainter("gpu.mpsd.io", "Evict")


@pytest.mark.parametrize("mode, n", [("capacity", 10), ("slices", 100)])
def test_tainted_slices_pass_the_strict_schema_of_the_newest_version(mode: str, n: int) -> None:
    """kubernetes-validate knows spec.devices[].taints of resource.k8s.io/v1 (1.37, GA)."""
    assert tuple(int(x) for x in kubernetes_validate.latest_version().split(".")[:2]) >= (1, 37)
    t, _ = tainter("NoExecute", after=0)
    taints = t.taints(HealthState(daemon_up=False), [0])
    gpus = [Gpu(i, f"GPU-{i}", "NVIDIA L4", 24 << 30, 0, (8, 9), False) for i in range(2)]
    for obj in build_slices(build_devices(gpus, mode, n, taints=taints), "gpu.mpsd.io", "node-a", 1):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert resource_slice_errors(obj) == []
