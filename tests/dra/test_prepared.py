"""Prepare and Unprepare: idempotent, refusing in one line without writing anything, and crash-safe
(a real process SIGKILLed at each step; the next start converges)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mpsd.dra.claims import ClaimRef
from mpsd.dra import cdi
from mpsd.dra.prepared import PREPARED, PreparedClaim
from mpsd.errors import DraError, MpsdError

from tests.dra.conftest import GIB, NODE, claim, opaque, result

REF = ClaimRef("ns", "c1", "uid-1")


def files(env):
    """What exists: claim directories, CDI specs, records."""
    regions = sorted(os.listdir(env.paths.region_dir)) if os.path.isdir(env.paths.region_dir) else []
    specs = sorted(os.listdir(env.cdi_dir)) if os.path.isdir(env.cdi_dir) else []
    return regions, specs


def test_prepare_writes_a_directory_and_a_spec_and_records_them(env):
    env.claims.put(claim(results=[result(memory="20Gi")], pods=("pod-a", "pod-b")))
    p = env.loaded()
    rec = p.prepare(REF)
    assert rec.phase == PREPARED and rec.memory_limits == {0: 20 * GIB} and rec.pods == ("pod-a", "pod-b")
    regions, specs = files(env)
    assert regions == [os.path.basename(rec.region_dir)] and regions[0].startswith("claim-uid-1-")
    assert oct(os.stat(rec.region_dir).st_mode & 0o777) == "0o777"
    assert specs == ["mpsd.io-claim_uid-1.json"]
    spec = json.loads((env.cdi_dir / specs[0]).read_text())
    assert spec["devices"][0]["name"] == "uid-1_gpu"
    # a restarted mpsd knows it
    assert [r.uid for r in env.loaded().prepared()] == ["uid-1"]


def test_prepare_again_answers_the_same_without_asking_the_api_server(env):
    env.claims.put(claim())
    p = env.loaded()
    first = p.prepare(REF)
    calls = env.claims.calls
    assert p.prepare(REF) == first
    assert env.claims.calls == calls
    assert len(files(env)[0]) == 1


def test_two_claims_on_one_gpu_have_their_own_directory_and_cap(env):
    env.claims.put(claim(results=[result(memory="20Gi")]))
    env.claims.put(claim(uid="uid-2", name="c2", results=[result(memory="8Gi")]))
    p = env.loaded()
    a, b = p.prepare(REF), p.prepare(ClaimRef("ns", "c2", "uid-2"))
    assert a.region_dir != b.region_dir
    assert (a.memory_limits, b.memory_limits) == ({0: 20 * GIB}, {0: 8 * GIB})
    assert len(files(env)[1]) == 2


def test_unprepare_removes_spec_directory_and_record_also_after_a_restart(env):
    env.claims.put(claim())
    env.loaded().prepare(REF)
    p = env.loaded()  # restarted
    p.unprepare(REF)
    assert files(env) == ([], [])
    assert env.loaded().prepared() == []
    p.unprepare(REF)  # the kubelet retries: nothing to do is fine


def test_a_claim_prepared_before_a_reboot_gets_its_directory_and_spec_back(env):
    env.claims.put(claim())
    rec = env.loaded().prepare(REF)
    os.rmdir(rec.region_dir)
    os.unlink(env.cdi_dir / rec.spec_name)  # /var/run/cdi and a tmpfs regionDir are empty after a reboot
    env.loaded()
    assert os.path.isdir(rec.region_dir) and (env.cdi_dir / rec.spec_name).exists()


def test_a_changed_spec_is_written_again(env):
    env.claims.put(claim())
    p = env.loaded()
    rec = p.prepare(REF)
    (env.cdi_dir / rec.spec_name).write_text('{"cdiVersion": "0.5.0", "kind": "mpsd.io/claim", "devices": []}')
    p.prepare(REF)
    assert json.loads((env.cdi_dir / rec.spec_name).read_text())["devices"][0]["name"] == "uid-1_gpu"


@pytest.mark.parametrize("setup, match", [
    (lambda env: env.claims.put(claim(node="node-b")), "allocated to another node"),
    (lambda env: env.claims.put(claim(uid="uid-9")), "UID 'uid-9' on the API server"),
    (lambda env: env.claims.put(claim(results=[result(memory="81Gi")])), "consumed memory 81Gi is outside"),
    (lambda env: env.claims.put(claim(config=[opaque({"apiVersion": "gpu.mpsd.io/v1alpha1", "kind": "ClaimConfig",
                                                      "x": 1})])), "unknown field 'x'"),
    (lambda env: None, "404 Not Found"),
    (lambda env: setattr(env.claims, "error", MpsdError("API server https://10.0.0.1: timed out after 5.0s")),
     "timed out after 5.0s"),
    (lambda env: setattr(env.claims, "error", ConnectionRefusedError(111, "Connection refused")),
     "API server: ConnectionRefusedError"),
])
def test_refusals_are_one_line_and_write_nothing(env, setup, match):
    p = env.loaded()
    setup(env)
    with pytest.raises(DraError, match=match) as info:
        p.prepare(REF)
    assert "\n" not in str(info.value) and "ns/c1" in str(info.value)
    assert files(env) == ([], [])
    assert p.store.all() == []


def test_a_symlinked_cdi_dir_refuses_prepare_and_nothing_is_left(env):
    env.claims.put(claim())
    (env.root / "elsewhere").mkdir()
    env.cdi_dir.symlink_to(env.root / "elsewhere")
    p = env.preparer()
    p.store.load()
    with pytest.raises(DraError, match="is a symlink"):
        p.prepare(REF)
    assert os.listdir(env.root / "elsewhere") == [] and p.store.all() == []
    assert not os.path.isdir(env.paths.region_dir) or os.listdir(env.paths.region_dir) == []


def test_a_failure_after_the_directory_rolls_everything_back(env, monkeypatch):
    env.claims.put(claim())
    p = env.loaded()

    def full(name, spec):
        raise DraError("cannot write CDI spec: No space left on device")

    monkeypatch.setattr(p.cdi, "write", full)
    with pytest.raises(DraError, match="No space left"):
        p.prepare(REF)
    assert files(env) == ([], []) and p.store.all() == []
    monkeypatch.undo()
    assert p.prepare(REF).phase == PREPARED  # the kubelet's retry


CRASH = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {repo!r})
    from tests.dra.conftest import Env, Claims
    from mpsd.dra.claims import ClaimRef
    from mpsd.alloc.container import HostPaths
    from pathlib import Path
    root = Path({root!r})
    env = Env(root, HostPaths(pipe_dir=str(root / "pipe"), region_dir=str(root / "regions"),
              shim_host_dir=str(root / "lib")), root / "cdi", root / "state" / "dra-state.json",
              root / "plugins", root / "registry")
    env.claims.put(json.loads({claim!r}))
    p = env.loaded()
    def step(name):
        if name == {step!r}:
            os.kill(os.getpid(), signal.SIGKILL)
    p.step = step
    ref = ClaimRef("ns", "c1", "uid-1")
    getattr(p, {call!r})(ref)
    print("no crash")
""")


def run_and_kill(env, call, step):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = CRASH.format(repo=repo, root=str(env.root), claim=json.dumps(claim()), step=step, call=call)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr


@pytest.mark.parametrize("step", ["directory", "spec", "prepared"])
def test_killed_during_prepare_the_next_start_converges(env, step):
    """SIGKILL after each step of Prepare: the restarted mpsd leaves either nothing (rolled back:
    the kubelet asks again and gets a fresh preparation) or the prepared claim, never a leak."""
    run_and_kill(env, "prepare", step)
    p = env.loaded()
    regions, specs = files(env)
    if step == "prepared":
        (rec,) = p.prepared()
        assert regions == [os.path.basename(rec.region_dir)] and specs == [rec.spec_name]
    else:
        assert (regions, specs, p.store.all()) == ([], [], [])
    env.claims.put(claim())
    rec = p.prepare(REF)  # the kubelet's retry
    assert files(env) == ([os.path.basename(rec.region_dir)], [rec.spec_name])
    p.unprepare(REF)
    assert files(env) == ([], []) and env.loaded().store.all() == []


@pytest.mark.parametrize("step", ["spec removed", "directory removed"])
def test_killed_during_unprepare_the_kubelets_retry_finishes_it(env, step):
    env.claims.put(claim())
    env.loaded().prepare(REF)
    run_and_kill(env, "unprepare", step)
    p = env.loaded()  # the record is still there: the restart puts the spec and directory back ...
    assert [r.uid for r in p.prepared()] == ["uid-1"]
    p.unprepare(REF)  # ... and the kubelet's retry removes everything
    assert files(env) == ([], []) and env.loaded().store.all() == []


def test_orphans_of_ours_are_removed_at_start_and_others_left(env):
    env.cdi_dir.mkdir()
    os.makedirs(os.path.join(env.paths.region_dir, "claim-uid-7-0123456789ab"))
    os.makedirs(os.path.join(env.paths.region_dir, "alloc-0123456789abcdef-0123456789ab"))  # the device plugin's
    (env.cdi_dir / "mpsd.io-claim_uid-7.json").write_text("{}")
    (env.cdi_dir / "nvidia.yaml").write_text("{}")
    env.loaded()
    assert files(env) == (["alloc-0123456789abcdef-0123456789ab"], ["nvidia.yaml"])


def test_the_node_name_is_checked_against_the_allocation(env):
    env.claims.put(claim(node=NODE))
    assert env.loaded().prepare(REF).phase == PREPARED


def test_a_deep_tree_a_pod_left_in_its_claims_directory_is_removed_by_unprepare(env):
    """3000 nested directories (shutil.rmtree would raise RecursionError) and a symlink to a host
    file: Unprepare removes the tree through mpsd.trees, never following the link."""
    env.claims.put(claim())
    p = env.loaded()
    rec = p.prepare(REF)
    victim = env.root / "victim"
    victim.write_text("keep")
    fd = os.open(rec.region_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            new = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = new
        os.symlink(str(victim), "link", dir_fd=fd)
    finally:
        os.close(fd)
    p.unprepare(REF)
    assert files(env) == ([], []) and victim.read_text() == "keep"
    assert env.loaded().store.all() == []


def test_the_claims_of_one_call_are_recorded_in_one_journal_line(env):
    for i in range(4):
        env.claims.put(claim(uid=f"uid-{i}", name=f"c{i}", results=[result(memory="1Gi")]))
    p = env.loaded()
    lines = p.store.journal_lines
    out = p.prepare_many([ClaimRef("ns", f"c{i}", f"uid-{i}") for i in range(4)] + [ClaimRef("ns", "c0", "uid-0")])
    assert sorted(out) == ["uid-0", "uid-1", "uid-2", "uid-3"] and all(r.phase == PREPARED for r in out.values())
    assert p.store.journal_lines == lines + 1
    assert len(files(env)[0]) == 4  # named twice, prepared once
    refs = [ClaimRef("ns", f"c{i}", f"uid-{i}") for i in range(4)]
    assert p.unprepare_many(refs) == {f"uid-{i}": "" for i in range(4)}
    assert p.store.journal_lines == lines + 2 and files(env) == ([], [])


def test_a_journal_that_cannot_be_written_fails_every_claim_of_the_call_and_leaves_nothing(env, monkeypatch):
    from mpsd.errors import PluginError

    for i in range(2):
        env.claims.put(claim(uid=f"uid-{i}", name=f"c{i}"))
    p = env.loaded()

    def full(items):
        raise PluginError("cannot write dra-state.json.journal: No space left on device")

    monkeypatch.setattr(p.store, "put_many", full)
    out = p.prepare_many([ClaimRef("ns", "c0", "uid-0"), ClaimRef("ns", "c1", "uid-1")])
    assert all("No space left on device" in out[u] and "\n" not in out[u] for u in ("uid-0", "uid-1"))
    assert files(env) == ([], [])


def test_a_claim_recorded_before_requests_had_devices_keeps_its_one_device(env):
    """A record written by an mpsd before per-request devices (no ``requests``): its running
    containers name ``mpsd.io/claim=<uid>`` and a restart names it again, so the spec written back
    after an upgrade still has that one device, with the claim's limits and its ``region``."""
    env.claims.put(claim(results=[result(memory="20Gi", compute="25")]))
    p = env.loaded()
    rec = p.prepare(REF)
    old = {k: v for k, v in rec.to_json().items() if k != "requests"}
    p.store.put_many([PreparedClaim.from_json(old)])
    p.store.close()
    (env.cdi_dir / rec.spec_name).unlink()  # a reboot emptied /var/run/cdi
    again = env.loaded()
    (device,) = json.loads((env.cdi_dir / rec.spec_name).read_text())["devices"]
    edits = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
    assert (device["name"], edits["MPSSHIM_REGION"], edits["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
        "uid-1", "/run/mpsd/region", "0=20G")
    assert again.prepare(REF).requests == ()


def test_a_claim_recorded_before_shim_layouts_keeps_preloading_the_shim_it_started_with(env):
    """A record written by an mpsd before shim files were named by layout (no ``shim``): its
    containers preload /run/mpsd-shim/libmpsshim.so (layout 2) and share a layout-2 region, so the
    spec written back after an upgrade names that file again, never the new layout's; a claim
    prepared now preloads libmpsshim.so.3 (mpsd/alloc/shimfile.py)."""
    env.claims.put(claim(results=[result(memory="20Gi", compute="25")]))
    p = env.loaded()
    rec = p.prepare(REF)
    assert rec.shim == "libmpsshim.so.3"
    old = {k: v for k, v in rec.to_json().items() if k != "shim"}
    p.store.put_many([PreparedClaim.from_json(old)])
    p.store.close()
    (env.cdi_dir / rec.spec_name).unlink()  # a reboot emptied /var/run/cdi
    again = env.loaded()
    (device,) = json.loads((env.cdi_dir / rec.spec_name).read_text())["devices"]
    assert dict(e.split("=", 1) for e in device["containerEdits"]["env"])["LD_PRELOAD"] == (
        "/run/mpsd-shim/libmpsshim.so")
    assert again.prepare(REF).shim == "libmpsshim.so"


def test_a_record_naming_no_shim_file_is_refused_in_one_line():
    from mpsd.alloc.shimfile import shim_name

    with pytest.raises(MpsdError, match=r"bad shim file name '../x': expected libmpsshim.so or"):
        shim_name("../x")


@pytest.mark.parametrize("request_name", ["B", "a_b", "-a", "a" * 64, "a/b"])
def test_a_request_name_that_cannot_name_a_cdi_device_is_refused(request_name):
    with pytest.raises(DraError, match="bad request name"):
        cdi.device_name("uid-1", request_name)


def test_device_nodes_are_named_by_nvmls_minor_number_not_the_index(env):
    """GPU 0 whose minor number is 3 is /dev/nvidia3: its container must not get /dev/nvidia0
    (another GPU's node, or none)."""
    from mpsd.inventory.nvml import Gpu

    for name in ("nvidiactl", "nvidia0", "nvidia3"):
        (env.root / "dev" / name).touch()
    listed = [Gpu(0, "GPU-00000000-aaaa-bbbb-cccc-000000000000", "Fake H100", 80 * GIB, 0, (9, 0), False, 3)]
    env.claims.put(claim(results=[result(memory="20Gi")]))
    p = env.loaded(gpu_list=listed)
    rec = p.prepare(REF)
    (device,) = json.loads((env.cdi_dir / rec.spec_name).read_text())["devices"]
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia3"]
