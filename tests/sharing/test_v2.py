"""The MPS v2 backend is today's behaviour behind the seam: the same environment and mounts the
faces computed themselves before, nothing created per slice, a burst limit refused in one line."""

from __future__ import annotations

import pytest

from mpsd.errors import BackendError
from mpsd.alloc.container import HostPaths, container_env, container_mounts
from mpsd.alloc.slicing import plan_allocation
from mpsd.sharing import SliceRequest
from mpsd.sharing.v2 import V2Backend

from tests.plugin.conftest import GIB, FakeGpu

G = [FakeGpu(0, "GPU-a", "x", 80 * GIB), FakeGpu(1, "GPU-b", "x", 80 * GIB)]
PATHS = HostPaths(pipe_dir="/run/mps", region_dir="/var/lib/mpsd/regions", shim_host_dir="/var/lib/mpsd/lib",
                  ipc_mode="tmpfs", shm_dir="/var/lib/mpsd/shm")


def test_edits_are_the_faces_former_environment_and_mounts():
    plan = plan_allocation(["GPU-b::0", "GPU-a::3"], G, 10)
    grant = V2Backend(PATHS).grant(SliceRequest("k", plan, "/var/lib/mpsd/regions/k-1", client_priority=1))
    assert grant.env == container_env(plan, "/run/mps", client_priority=1)
    assert [(m.host, m.container, m.read_only) for m in grant.mounts] == [
        (m.host, m.container, m.read_only) for m in container_mounts(plan, PATHS, "/var/lib/mpsd/regions/k-1")]


def test_release_and_adopt_change_nothing(tmp_path):
    backend = V2Backend(PATHS)
    assert backend.release("unknown") is None
    assert backend.adopt([]) is None


def test_a_hard_limit_above_the_guarantee_is_refused_in_one_line():
    plan = plan_allocation(["GPU-a::0"], G, 10)
    request = SliceRequest("alloc-x", plan, "/r", memory_hard={0: 40 * GIB})
    with pytest.raises(BackendError) as exc:
        V2Backend(PATHS).grant(request)
    message = str(exc.value)
    assert "\n" not in message and "alloc-x" in message and "40G" in message and "8G" in message
    assert "MPS v3" in message
    # a hard limit at the guarantee is no burst: granted
    assert V2Backend(PATHS).grant(SliceRequest("alloc-x", plan, "/r", memory_hard={0: 8 * GIB}))
