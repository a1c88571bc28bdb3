"""What the allocation path asks the driver: in a process that sees one device, no per-allocation
device lookup; with several, the current context's device on every allocation."""

from __future__ import annotations

import pytest

from tests.shim.conftest import G, M, ShimEnv

MODES = ["link", "dlsym", "gpa", "gpa2"]


@pytest.mark.parametrize("mode", MODES)
def test_one_device_is_charged_without_a_device_lookup_per_allocation(shim: ShimEnv, mode: str) -> None:
    script = ["init", "ctx", 0, "alloc", 512 * M, "alloc", 256 * M, "usage", 0, "alloc", 512 * M, "free", "free"]
    r = shim.run(
        mode, [*script, "usage", 0, "calls", "cuCtxGetDevice"], limit="0=1G", extra={"FAKE_CUDA_DEVICES": "16G"}
    )
    assert r.rcs("alloc") == [0, 0, 2]
    assert [line["used"] for line in r.of("usage")] == [768 * M, 0]
    assert r.of("calls")[0]["n"] == 0


def test_one_device_without_a_current_context_gets_the_drivers_error_and_keeps_nothing(shim: ShimEnv) -> None:
    r = shim.run(
        "gpa2",
        ["init", "alloc", M, "calls", "cuMemAlloc_v2", "usage", 0, "ctx", 0, "alloc", G, "alloc", 1, "usage", 0],
        limit="0=1G",
        extra={"FAKE_CUDA_DEVICES": "16G"},
    )
    assert r.rcs("alloc") == [201, 0, 2]  # the driver's CUDA_ERROR_INVALID_CONTEXT; then the cap is whole
    assert r.of("calls")[0]["n"] == 1
    assert [line["used"] for line in r.of("usage")] == [0, G]


def test_several_devices_charge_the_current_contexts_device_on_every_allocation(shim: ShimEnv) -> None:
    r = shim.run(
        "gpa2",
        ["init", "ctx", 1, "alloc", 512 * M, "ctx", 0, "alloc", 256 * M, "ctx", 1, "alloc", M]
        + ["calls", "cuCtxGetDevice", "usage", 0, "usage", 1],
        limit="0=1G,1=1G",
    )
    assert r.rcs("alloc") == [0, 0, 0]
    assert r.of("calls")[0]["n"] == 3
    assert [line["used"] for line in r.of("usage")] == [256 * M, 513 * M]
