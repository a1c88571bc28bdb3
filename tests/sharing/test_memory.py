"""Memory limited by the driver per cgroup: the fake NVML's Set/GetMemoryLimits_v1 loaded by the
real pynvml (documented semantics), then mpsd's DRA and device plugin on the v3 stand-in setting,
reading back, restoring and clearing them, and dropping the shim only where the driver holds the
whole slice."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mpsd.inventory import nvml as inventory
from mpsd.dra.cdi import CdiDir
from mpsd.dra.claims import ClaimRef
from mpsd.dra.prepared import PreparedClaim, Preparer
from mpsd.errors import DraError, InventoryError
from mpsd.inventory.nvml import Inventory
from mpsd.alloc.state import StateStore
from mpsd.lifecycle.v3 import supervision_for
from mpsd.sharing.build import build, host_paths
from mpsd.sharing.detect import Choice
from mpsd.sharing.memory import NvmlLimits, cgroup_v2_path, pod_cgroup_candidates
from mpsd.sharing.toml3 import namespace_name

from tests.dra.conftest import Claims, claim, result

from tests.plugin.conftest import allocate, stub
from tests.sharing.conftest import wait_for
from tests.sharing.test_v3_node import GPUS, node, plugin, up  # noqa: F401 (fixtures)

GIB = 1 << 30
MAX = (1 << 64) - 1
POD = "0f0e0d0c-1111-2222-3333-444455556666"


def nvml_text(limits_file: Path, mig: bool = False, extra: str = "") -> str:
    lines = [f"gpu {g.index} {g.uuid} {g.memory_total} 0 9 0 {int(mig and g.index == 1)} Fake H100" for g in GPUS]
    return "\n".join(lines) + f"\ndriver 615.20.01\nmemlimits {limits_file}\n{extra}"


@pytest.fixture
def nvml(fake_nvml_lib, tmp_path, monkeypatch):
    """open(mig=False, extra="") -> the fake NVML initialised with memory partitioning on."""
    opened = []

    def open_(mig: bool = False, extra: str = "", limits: bool = True) -> Inventory:
        conf = tmp_path / "nvml.conf"
        text = nvml_text(tmp_path / "limits", mig, extra)
        conf.write_text(text if limits else text.replace(f"memlimits {tmp_path / 'limits'}", ""))
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(conf))
        inv = Inventory(library_path=str(fake_nvml_lib))
        opened.append(inv)
        return inv

    yield open_
    for inv in opened:
        inv.close()


def test_fake_nvml_limits_have_the_documented_semantics(nvml, tmp_path):
    nvml(mig=True)
    cg = tmp_path / "cg"
    cg.mkdir()
    assert inventory.memory_limits(0, str(cg)) == (0, MAX, 0)  # none set: soft 0, hard MAX
    inventory.set_memory_limits(0, str(cg), 2 * GIB, 4 * GIB)
    assert inventory.memory_limits(0, str(cg)) == (2 * GIB, 4 * GIB, 0)
    assert inventory.memory_limits(1 - 1, str(cg))[:2] == (2 * GIB, 4 * GIB)
    with pytest.raises(InventoryError, match="Invalid Argument"):  # soft above hard
        inventory.set_memory_limits(0, str(cg), 5 * GIB, 4 * GIB)
    with pytest.raises(InventoryError, match="Not Supported"):  # a MIG handle
        inventory.set_memory_limits(1, str(cg), 0, GIB)
    with pytest.raises(InventoryError, match="Not Found"):  # not a cgroup directory
        inventory.memory_limits(0, str(tmp_path / "nothing"))
    inventory.set_memory_limits(0, str(cg), 0, MAX)  # cleared
    assert inventory.memory_limits(0, str(cg)) == (0, MAX, 0)
    inventory.set_memory_limits(0, str(cg), GIB, GIB)
    cg.rmdir()  # removing the cgroup clears its limits
    with pytest.raises(InventoryError, match="Not Found"):
        inventory.memory_limits(0, str(cg))


def test_without_memory_partitioning_the_calls_are_not_supported(nvml, tmp_path):
    nvml(limits=False)
    with pytest.raises(InventoryError, match="Not Supported"):
        inventory.memory_limits(0, str(tmp_path))


def test_setting_limits_needs_root(fake_nvml_lib):
    shared = Path(tempfile.mkdtemp(prefix="nvml-", dir="/tmp"))  # another user must reach it
    try:
        os.chmod(shared, 0o755)
        lib = shared / "libnvidia-ml.so.1"
        shutil.copy(fake_nvml_lib, lib)
        conf = shared / "nvml.conf"
        conf.write_text(nvml_text(shared / "limits"))
        (shared / "limits").write_text("")
        os.chmod(shared / "limits", 0o666)
        (shared / "cg").mkdir()
        code = ("import sys, pynvml; sys.path.insert(0, %r); from mpsd.inventory import nvml as i; i.use_library(%r); "
                "pynvml.nvmlInit(); print(i.memory_limits(0, %r)); i.set_memory_limits(0, %r, 1, 2)")
        cg = str(shared / "cg")
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                               code % (str(Path(__file__).parents[2]), str(lib), cg, cg)],
                              env=dict(os.environ, FAKE_NVML_CONFIG=str(conf)), capture_output=True, text=True)
    finally:
        shutil.rmtree(shared)
    assert f"(0, {MAX}, 0)" in proc.stdout, proc.stderr  # reading is for anyone
    assert proc.stderr.rstrip().endswith("failed: Insufficient Permissions")  # setting is root's


@pytest.mark.parametrize("text, path", [
    ("0::/kubepods/burstable/podx/abc\n", "/kubepods/burstable/podx/abc"),
    ("12:memory:/x\n0::/\n", "/"),
    ("0::/../etc\n", None),
    ("1:name=systemd:/x\n", None),
])
def test_cgroup_v2_path(text, path):
    assert cgroup_v2_path(text) == path


def test_pod_cgroup_layouts():
    found = pod_cgroup_candidates("/sys/fs/cgroup", POD)
    assert f"/sys/fs/cgroup/kubepods/burstable/pod{POD}" in found
    assert ("/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
            f"{POD.replace('-', '_')}.slice") in found


@pytest.fixture
def cgroot(short_tmp):
    root = short_tmp / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory dmem\n")
    return root


def v3_with_memory(node, cgroot, **overrides):  # noqa: F811
    config, _, running = node(**{"cgroup-root": str(cgroot), **overrides})
    backend = build(config, Choice(3, "test"), lambda: GPUS, NvmlLimits())
    v3 = supervision_for(backend, config)
    running.sup.v3 = v3  # the same daemon, this backend (node() built one without NVML)
    return config, backend, running


def preparer_for(config, backend, short_tmp, claims):
    p = Preparer(driver="gpu.mpsd.io", node="node-a", pool="node-a", gpus=GPUS, slices_per_gpu=4,
                 paths=host_paths(config), cdi_dir=CdiDir(str(short_tmp / "cdi")),
                 store=StateStore(str(short_tmp / "state" / "dra.json"), record=PreparedClaim), get_claim=claims,
                 dev_dir=str(short_tmp), backend=backend)
    p.store.load()
    return p


def env_of(preparer, rec):
    spec = preparer.cdi.read(rec.spec_name)
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def test_a_claims_pod_cgroup_is_limited_at_prepare_restored_and_cleared(nvml, node, cgroot, short_tmp):  # noqa: F811
    nvml()
    config, backend, running = v3_with_memory(node, cgroot)
    up(running)
    assert backend.memory is not None, backend.memory_problem
    pod_cg = cgroot / "kubepods" / "burstable" / f"pod{POD}"  # made by the kubelet before it prepares
    pod_cg.mkdir(parents=True)
    claims = Claims()
    c = claim(uid="u1", results=[result(device="gpu-0", memory="10Gi")])
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "pod-a", "uid": POD}]
    claims.put(c)
    preparer = preparer_for(config, backend, short_tmp, claims)
    rec = preparer.prepare(ClaimRef("ns", "c1", "u1"))
    assert inventory.memory_limits(0, str(pod_cg))[:2] == (10 * GIB, 10 * GIB)
    env = env_of(preparer, rec)
    assert "LD_PRELOAD" not in env and "MPSSHIM_REGION" not in env  # shim auto: the driver holds the pod
    assert "driver per pod cgroup" in backend.enforcement(preparer.slices(rec)[0])

    inventory.set_memory_limits(0, str(pod_cg), 0, 70 * GIB)  # changed behind mpsd's back
    notes = backend.memory_round()
    assert any("restored" in n for n in notes) and backend.memory.restored == 1
    assert inventory.memory_limits(0, str(pod_cg))[:2] == (10 * GIB, 10 * GIB)

    preparer.unprepare(ClaimRef("ns", "c1", "u1"))
    assert inventory.memory_limits(0, str(pod_cg))[:2] == (0, MAX)


def test_limits_the_driver_refuses_fail_prepare_in_one_line(nvml, node, cgroot, short_tmp):  # noqa: F811
    nvml(extra="fail nvmlDeviceSetMemoryLimits_v1 4\n")
    config, backend, running = v3_with_memory(node, cgroot)
    up(running)
    (cgroot / "kubepods" / f"pod{POD}").mkdir(parents=True)
    claims = Claims()
    c = claim(uid="u1", results=[result(device="gpu-0", memory="10Gi")])
    c["status"]["reservedFor"] = [{"resource": "pods", "name": "pod-a", "uid": POD}]
    claims.put(c)
    preparer = preparer_for(config, backend, short_tmp, claims)
    with pytest.raises(DraError) as exc:
        preparer.prepare(ClaimRef("ns", "c1", "u1"))
    assert "refused" in str(exc.value) and "Insufficient Permissions" in str(exc.value) and "\n" not in str(exc.value)
    assert namespace_name("claim-u1") not in {n.name for n in backend.control().namespace_list("g0")}
    assert preparer.cdi.ours() == []


def test_a_claim_shared_by_two_pods_keeps_the_shim(nvml, node, cgroot, short_tmp):  # noqa: F811
    nvml()
    config, backend, running = v3_with_memory(node, cgroot)
    up(running)
    other = "aaaaaaaa-1111-2222-3333-444455556666"
    for uid in (POD, other):
        (cgroot / "kubepods" / f"pod{uid}").mkdir(parents=True)
    claims = Claims()
    c = claim(uid="u1", results=[result(device="gpu-0", memory="10Gi")])
    c["status"]["reservedFor"] = [{"resource": "pods", "name": n, "uid": u} for n, u in (("a", POD), ("b", other))]
    claims.put(c)
    preparer = preparer_for(config, backend, short_tmp, claims)
    rec = preparer.prepare(ClaimRef("ns", "c1", "u1"))
    assert env_of(preparer, rec)["LD_PRELOAD"]  # each pod's cgroup has the claim's limit: the shim caps the sum
    assert inventory.memory_limits(0, str(cgroot / "kubepods" / f"pod{other}"))[:2] == (10 * GIB, 10 * GIB)


def test_a_device_plugin_container_is_limited_once_its_client_connects(nvml, node, plugin, cgroot):  # noqa: F811
    nvml()
    config, backend, running = v3_with_memory(node, cgroot)
    up(running)
    dp = plugin(config, backend)
    channel, s = stub(dp)
    with channel:
        reply = allocate(s, [f"{GPUS[1].uuid}::0"]).container_responses[0]
    assert reply.envs["LD_PRELOAD"]  # the container's cgroup is not known at Allocate: the shim stays
    with open("/proc/self/cgroup") as f:
        mine = cgroot / cgroup_v2_path(f.read()).lstrip("/")  # this process plays the container
    mine.mkdir(parents=True, exist_ok=True)
    assert backend.memory_round() == []  # no client yet: nothing known
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
        client.connect(os.path.join(reply.envs["CUDA_MPS_PIPE_DIRECTORY"], "control"))
        notes: list[str] = []
        assert wait_for(lambda: notes.extend(backend.memory_round()) or any(str(mine) in n for n in notes))
    assert inventory.memory_limits(1, str(mine))[:2] == (4 * GIB, 4 * GIB)
    dp.tracker.collect(dp.store.all())
    assert inventory.memory_limits(1, str(mine))[:2] == (0, MAX)
