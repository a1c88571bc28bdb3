"""CDI specs: what a claim's containers get, written atomically into a real directory only."""

from __future__ import annotations

import json
import os

import pytest

from mpsd.dra import cdi
from mpsd.dra.claims import ClaimRef, plan_claim
from mpsd.errors import DraError
from mpsd.alloc.container import HostPaths

from tests.dra.conftest import DRIVER, NODE, claim, gpus, result

PATHS = HostPaths(pipe_dir="/run/mps/pipe", region_dir="/var/lib/mpsd/regions", shim_host_dir="/var/lib/mpsd/lib")


def spec(**kw):
    p = plan_claim(claim(results=[result(memory="20Gi")]), ClaimRef("ns", "c1", "uid-1"), driver=DRIVER, node=NODE,
                   pool=NODE, gpus=gpus(80), slices_per_gpu=4).plan
    return cdi.claim_spec("uid-1", p, kw.pop("paths", PATHS), "/var/lib/mpsd/regions/claim-uid-1-0123456789ab", **kw)


def test_the_spec_gives_limits_shim_region_and_a_read_only_pipe_dir():
    s = spec(client_priority=1, nodes=["/dev/nvidiactl", "/dev/nvidia0"])
    assert (s["cdiVersion"], s["kind"]) == ("0.5.0", "mpsd.io/claim")
    (device,) = s["devices"]
    assert device["name"] == "uid-1"
    env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps/pipe"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20G"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert env["LD_PRELOAD"] == "/run/mpsd-shim/libmpsshim.so.3"
    assert env["MPSSHIM_REGION"] == "/run/mpsd/region"
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpus(80)[0].uuid
    # the claim's containers share one cap: frameworks allocate on demand (issue 21, defect 8)
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    mounts = {m["containerPath"]: m for m in device["containerEdits"]["mounts"]}
    assert mounts["/run/mps/pipe"]["hostPath"] == "/run/mps/pipe" and "ro" in mounts["/run/mps/pipe"]["options"]
    assert mounts["/run/mps/pipe/log"]["hostPath"] == "/dev/null"  # the daemon's log FIFO out of the pod's reach
    paths = [m["containerPath"] for m in device["containerEdits"]["mounts"]]
    assert paths.index("/run/mps/pipe") < paths.index("/run/mps/pipe/log")  # mounted over the pipe dir's
    assert mounts["/run/mpsd"]["hostPath"].endswith("claim-uid-1-0123456789ab")
    assert "rw" in mounts["/run/mpsd"]["options"]
    assert mounts["/run/mpsd-shim"]["hostPath"] == "/var/lib/mpsd/lib" and "ro" in mounts["/run/mpsd-shim"]["options"]
    assert device["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia0"}]


def test_tmpfs_ipc_mode_mounts_the_shared_shm():
    paths = HostPaths(pipe_dir="/p", region_dir="/r", shim_host_dir="/l", ipc_mode="tmpfs", shm_dir="/s")
    mounts = {m["containerPath"]: m["hostPath"] for m in spec(paths=paths)["devices"][0]["containerEdits"]["mounts"]}
    assert mounts["/dev/shm"] == "/s"


def test_device_nodes_are_those_the_host_has_at_the_hosts_path(tmp_path):
    """Each node is at /dev/<name> in the container; its hostPath, where the runtime opens it, is
    NVIDIA's spec's for that path, else under dev_root, never where mpsd sees it (``dev_dir``)."""
    for name in ("nvidiactl", "nvidia1"):
        (tmp_path / name).touch()
    names = cdi.node_names([0, 1])
    assert names == ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1"]
    assert cdi.device_nodes(names, str(tmp_path)) == [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia1"}]
    assert cdi.device_nodes(names, str(tmp_path), dev_root="/run/nvidia/driver") == [
        {"path": "/dev/nvidiactl", "hostPath": "/run/nvidia/driver/dev/nvidiactl"},
        {"path": "/dev/nvidia1", "hostPath": "/run/nvidia/driver/dev/nvidia1"}]
    hosts = {"/dev/nvidia-uvm": "/drv/dev/nvidia-uvm", "/dev/nvidia1": "/drv/dev/nvidia1"}
    assert cdi.device_nodes(names, str(tmp_path), hosts=hosts, brought={"/dev/nvidiactl"}) == [
        {"path": "/dev/nvidia-uvm", "hostPath": "/drv/dev/nvidia-uvm"},  # named by NVIDIA's spec: on the host
        {"path": "/dev/nvidia1", "hostPath": "/drv/dev/nvidia1"}]


@pytest.mark.parametrize("uid", ["", "../x", "a/b", "-a", "a-", "a b", "x" * 129, "ü"])
def test_uids_that_cannot_name_a_file_or_a_cdi_device_are_refused(uid):
    with pytest.raises(DraError, match="bad claim UID"):
        cdi.spec_file_name(uid)


def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path):
    d = cdi.CdiDir(str(tmp_path / "cdi"))
    path = d.write("mpsd.io-claim_u.json", {"a": 1})
    assert json.loads(open(path).read()) == {"a": 1}
    d.write("mpsd.io-claim_u.json", {"a": 2})
    assert os.listdir(tmp_path / "cdi") == ["mpsd.io-claim_u.json"]
    assert d.read("mpsd.io-claim_u.json") == {"a": 2}
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    assert d.ours() == ["mpsd.io-claim_u.json"]
    d.remove("mpsd.io-claim_u.json")
    d.remove("mpsd.io-claim_u.json")  # gone already: fine
    assert os.listdir(tmp_path / "cdi") == []


def test_a_symlinked_cdi_dir_is_refused_and_nothing_is_written_through_it(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cdi").symlink_to(tmp_path / "elsewhere")
    d = cdi.CdiDir(str(tmp_path / "cdi"))
    with pytest.raises(DraError, match="is a symlink: expected a real directory") as info:
        d.write("mpsd.io-claim_u.json", {"a": 1})
    assert "\n" not in str(info.value)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_a_cdi_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "cdi").write_text("x")
    with pytest.raises(DraError, match="is not a directory"):
        cdi.CdiDir(str(tmp_path / "cdi")).check()


def test_a_symlink_planted_as_the_spec_name_is_replaced_not_followed(tmp_path):
    d = cdi.CdiDir(str(tmp_path / "cdi"))
    d.check()
    (tmp_path / "victim").write_text("keep")
    (tmp_path / "cdi" / "mpsd.io-claim_u.json").symlink_to(tmp_path / "victim")
    assert d.read("mpsd.io-claim_u.json") is None
    d.write("mpsd.io-claim_u.json", {"a": 1})
    assert (tmp_path / "victim").read_text() == "keep"
    assert not os.path.islink(tmp_path / "cdi" / "mpsd.io-claim_u.json")


def test_a_relative_cdi_dir_is_refused():
    with pytest.raises(DraError, match="expected an absolute path"):
        cdi.CdiDir("run/cdi")


def test_a_read_only_cdi_dir_is_refused_in_one_line(tmp_path):
    """A directory mpsd cannot write: as root a mode is no bar, so a read-only bind mount stands
    in for it (skipped where this test may not mount)."""
    ro = tmp_path / "cdi"
    ro.mkdir()
    if os.geteuid() != 0 or os.system(f"mount --bind {ro} {ro} 2>/dev/null && mount -o remount,bind,ro {ro}") != 0:
        pytest.skip("cannot make a read-only bind mount here")
    try:
        with pytest.raises(DraError) as info:
            cdi.CdiDir(str(ro)).write("mpsd.io-claim_u.json", {"a": 1})
        assert "not writable" in str(info.value) or "Read-only file system" in str(info.value)
        assert "\n" not in str(info.value)
    finally:
        os.system(f"umount {ro}")
    assert os.listdir(ro) == []
