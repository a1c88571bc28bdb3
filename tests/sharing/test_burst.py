"""Guaranteed + burst: a claim's consumed memory (a container's slices) is its soft limit, a
ClaimConfig memoryLimit (devicePlugin.memoryLimit) its hard limit, where the driver enforces
both; refused in one line below the guarantee, above the GPU, or where the backend cannot."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from mpsd import config as cfg
from mpsd.inventory import nvml as inventory
from mpsd.daemon.control3 import Limits3
from mpsd.dra.claims import ClaimRef, plan_claim
from mpsd.errors import DraError, PluginError
from mpsd.plugin import run_plugin
from mpsd.alloc.slicing import plan_allocation
from mpsd.sharing.burst import burst_limits
from mpsd.sharing.memory import cgroup_v2_path
from mpsd.sharing.toml3 import namespace_name

from tests.dra.conftest import DRIVER, NODE, Claims, claim, opaque, result
from tests.plugin.conftest import allocate, stub
from tests.sharing.test_memory import GIB, POD, cgroot, nvml, preparer_for, v3_with_memory  # noqa: F401 (fixtures)
from tests.sharing.conftest import wait_for
from tests.sharing.test_v3_node import GPUS, node, plugin, up  # noqa: F401 (fixtures)

REF = ClaimRef("ns", "c1", "u1")


def config_claim(limit, memory="10Gi", device="gpu-0"):
    params = {"apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig", "memoryLimit": limit}
    c = claim(uid="u1", results=[result(device=device, memory=memory)], config=[opaque(params)])
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "pod-a", "uid": POD}]
    return c


def plan(c):
    return plan_claim(c, REF, driver=DRIVER, node=NODE, pool=NODE, gpus=GPUS, slices_per_gpu=4)


def test_memory_limit_is_the_hard_limit_per_gpu():
    assert plan(config_claim("20Gi")).memory_limit == 20 * GIB
    assert plan(claim(uid="u1")).memory_limit is None


@pytest.mark.parametrize("limit, message", [
    ("4Gi", "below the"), ("81Gi", "above GPU 0's"), ("lots", "bad quantity"), (20, "bad quantity"),
])
def test_memory_limit_refused_in_one_line(limit, message):
    with pytest.raises(DraError) as exc:
        plan(config_claim(limit))
    assert message in str(exc.value) and "memoryLimit" in str(exc.value) and "\n" not in str(exc.value)


def test_burst_is_lent_under_v3_with_memory_partitioning(nvml, node, cgroot, short_tmp):  # noqa: F811
    nvml()
    config, backend, running = v3_with_memory(node, cgroot)
    up(running)
    pod_cg = cgroot / "kubepods" / f"pod{POD}"
    pod_cg.mkdir(parents=True)
    claims = Claims()
    claims.put(config_claim("20Gi"))
    preparer = preparer_for(config, backend, short_tmp, claims)
    rec = preparer.prepare(REF)
    assert inventory.memory_limits(0, str(pod_cg))[:2] == (10 * GIB, 20 * GIB)  # guarantee, burst
    ns = {n.name: n.limits for n in backend.control().namespace_list("g0")}[namespace_name(preparer.slices(rec)[0].key)]
    assert ns.pinned_memory_limit == "20G"
    # the journal keeps it: a restarted preparer asks for the same
    assert preparer.slices(rec)[0].memory_hard == {0: 20 * GIB}


def test_burst_is_refused_where_the_driver_cannot_enforce_it(node, short_tmp):  # noqa: F811
    config, backend, running = node()  # v3 without NVML: no memory partitioning
    up(running)
    claims = Claims()
    claims.put(config_claim("20Gi"))
    preparer = preparer_for(config, backend, short_tmp, claims)
    with pytest.raises(DraError) as exc:
        preparer.prepare(REF)
    assert "cannot be enforced" in str(exc.value) and "\n" not in str(exc.value)
    assert preparer.cdi.ours() == []


def test_burst_is_refused_under_v2(short_tmp):
    from tests.dra.conftest import Env

    from mpsd.dra.cdi import CdiDir
    from mpsd.dra.prepared import PreparedClaim, Preparer
    from mpsd.alloc.container import HostPaths
    from mpsd.alloc.state import StateStore

    paths = HostPaths(pipe_dir=str(short_tmp / "p"), region_dir=str(short_tmp / "r"), shim_host_dir=str(short_tmp / "l"))
    claims = Claims()
    claims.put(config_claim("20Gi"))
    p = Preparer(driver=DRIVER, node=NODE, pool=NODE, gpus=GPUS, slices_per_gpu=4, paths=paths,
                 cdi_dir=CdiDir(str(short_tmp / "cdi")), store=StateStore(str(short_tmp / "s.json"), record=PreparedClaim),
                 get_claim=claims)
    p.store.load()
    with pytest.raises(DraError) as exc:
        p.prepare(REF)
    assert "MPS v2 caps a slice at its guarantee" in str(exc.value) and "\n" not in str(exc.value)
    del Env


@pytest.mark.parametrize("limit, devices, want", [
    ("", ["::0"], {}),
    ("50%", ["::0"], {0: 40 * GIB}),  # one slice of 80G (8G) may reach half the GPU
    ("4G", ["::0", "::1"], {0: 16 * GIB}),  # never below the guarantee
    ("40G", ["::0"], {0: 40 * GIB}),
])
def test_device_plugin_burst_limits(limit, devices, want):
    p = plan_allocation([GPUS[0].uuid + d for d in devices], GPUS, 10)
    assert burst_limits(limit, GPUS)(p) == want


def test_device_plugin_burst_above_a_gpu_is_refused():
    with pytest.raises(PluginError, match="above GPU 1's 40G"):
        burst_limits("60G", GPUS)


def test_device_plugin_burst_under_v2_is_refused_at_start(short_tmp):
    config = cfg.load(None, {}, {"memory-limit": "50%", "region-dir": str(short_tmp / "r"),
                                 "shim-host-dir": str(short_tmp / "l"), "kubelet-dir": str(short_tmp / "k"),
                                 "state-dir": str(short_tmp / "s"), "pipe-dir": str(short_tmp / "p")})
    with pytest.raises(PluginError) as exc:
        run_plugin(config, pipe_dir=config.pipe_dir, gpus=GPUS, board=None, metrics=None,
                   shim_library=str(short_tmp / "none"), stop=threading.Event())
    assert "cannot be enforced on this node: MPS v2" in str(exc.value) and "\n" not in str(exc.value)


def test_device_plugin_burst_under_v3(nvml, node, plugin, cgroot):  # noqa: F811
    nvml()
    config, backend, running = v3_with_memory(node, cgroot, **{"memory-limit": "50%"})
    up(running)
    dp = plugin(config, backend)
    dp.memory_hard = burst_limits(config.device_plugin.memory_limit, GPUS)
    channel, s = stub(dp)
    with channel:
        reply = allocate(s, [f"{GPUS[1].uuid}::0"]).container_responses[0]
    ns = namespace_name(dp.store.all()[0].allocation_id)
    assert {n.name: n.limits for n in backend.control().namespace_list("g1")}[ns] == Limits3("20G", "10", "")
    with open("/proc/self/cgroup") as f:
        mine = cgroot / cgroup_v2_path(f.read()).lstrip("/")
    mine.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
        client.connect(os.path.join(reply.envs["CUDA_MPS_PIPE_DIRECTORY"], "control"))
        assert wait_for(lambda: backend.memory_round() is not None
                        and inventory.memory_limits(1, str(mine))[:2] == (4 * GIB, 20 * GIB))
