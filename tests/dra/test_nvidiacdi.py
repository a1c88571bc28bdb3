"""NVIDIA's own CDI specs (nvidia-ctk cdi generate, the GPU operator): found in the CDI
directories, their device IDs answered beside mpsd's, and a podman container given both."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import yaml

from mpsd.dra.nvidiacdi import MAX_SPEC_BYTES, NvidiaSpecs, device_for

from mpsd.dra.claims import ClaimRef

from tests.dra.conftest import GIB, NODE, StandInKubelet, claim, gpus, result

UUID0 = gpus(80)[0].uuid
REF = ClaimRef("ns", "c1", "uid-1")
CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def nvidia_spec(names, env=("NVIDIA_FROM_CDI=1",), dev_root=None, minors=None):
    """What ``nvidia-ctk cdi generate`` writes, cut down: kind nvidia.com/gpu, a device per GPU
    (and ``all``), the driver's files as common edits (here only an environment variable). With
    ``dev_root`` (``--dev-root``), its device nodes too, as it writes them: ``path`` in the
    container, ``hostPath`` under dev_root on the host; the control nodes in the common edits,
    each GPU's node in its device (``minors``: name -> minor; ``all`` has every GPU's)."""
    def node(name):
        return {"path": f"/dev/{name}", "hostPath": f"{dev_root}/dev/{name}"}

    def edits(name):
        e = {"env": [f"NVIDIA_CDI_DEVICE={name}"]}
        if dev_root is not None:
            gpu_minors = sorted(minors.values()) if name == "all" else [minors[name]]
            e["deviceNodes"] = [node(f"nvidia{m}") for m in gpu_minors]
        return e

    common = {"env": list(env)}
    if dev_root is not None:
        common["deviceNodes"] = [node(n) for n in CONTROL]
    return {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": n, "containerEdits": edits(n)} for n in names], "containerEdits": common}


@pytest.mark.parametrize("names, want", [
    ({"0", "1", "all"}, "0"),                # --device-name-strategy=index (the default)
    ({UUID0, "all"}, UUID0),                 # uuid
    ({"gpu0", "gpu1", "all"}, "gpu0"),       # type-index
    ({"0", UUID0}, UUID0),                   # both: the UUID cannot name another GPU
    ({"1", "all"}, None),
])
def test_the_nvidia_device_of_a_gpu(names, want):
    assert device_for(names, UUID0, 0) == want


def test_specs_are_found_in_either_directory_and_others_ignored(tmp_path):
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    run.mkdir()
    (etc / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec(["0", "all"])))
    (run / "other.json").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "vendor.com/x", "devices": [
        {"name": "1", "containerEdits": {}}]}))
    (run / "broken.yaml").write_text("kind: [")
    (run / "notes.txt").write_text("kind: nvidia.com/gpu")
    (run / "mpsd.io-claim_u.json").write_text(json.dumps(nvidia_spec(["5"])))  # mpsd's own: not even read
    specs = NvidiaSpecs([str(etc), str(run), str(tmp_path / "missing")])
    assert specs.names() == {"0", "all"}
    assert specs.ids([(UUID0, 0), ("GPU-other", 1)]) == {0: "nvidia.com/gpu=0"}
    (run / "nvidia.json").write_text(json.dumps(nvidia_spec(["1"])))  # written later: seen at the next look
    assert specs.names() == {"0", "1", "all"}


def test_a_link_a_fifo_or_an_oversized_file_is_not_read(tmp_path):
    (tmp_path / "real.yaml").write_text(yaml.safe_dump(nvidia_spec(["0"])))
    (tmp_path / "link.yaml").symlink_to(tmp_path / "real.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "big.json").write_text(json.dumps(nvidia_spec(["7"])) + " " * MAX_SPEC_BYTES)
    os.unlink(tmp_path / "real.yaml")
    assert NvidiaSpecs([str(tmp_path)]).names() == set()


def test_nvidias_device_is_answered_beside_mpsds_for_each_request_on_its_gpu(env):
    env.cdi_dir.mkdir()
    (env.cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec(["0", "1", "all"])))
    from mpsd.dra.nvidiacdi import NvidiaSpecs as Specs

    env.claims.put(claim(results=[result(memory="20Gi", compute="30"), result(request="b", memory="4Gi"),
                                  result(device="gpu-1", request="b", memory="4Gi")]))
    plugin = env.plugin(nvidia=Specs([str(env.cdi_dir)]))
    plugin.start()
    kubelet = StandInKubelet(plugin.registration_path)
    try:
        kubelet.register()
        entry = kubelet.prepare(("ns", "c1", "uid-1")).claims["uid-1"]
        assert entry.error == ""
        assert kubelet.container_cdi_ids(entry, "gpu") == ["mpsd.io/claim=uid-1_gpu", "nvidia.com/gpu=0"]
        assert kubelet.container_cdi_ids(entry, "b") == ["mpsd.io/claim=uid-1_b", "nvidia.com/gpu=0",
                                                         "nvidia.com/gpu=1"]
    finally:
        kubelet.close()
        plugin.stop()
    assert (env.cdi_dir / "nvidia.yaml").exists()  # not ours: left alone


def test_a_container_gets_mpsds_device_and_nvidias_together(podman, env, shim_lib):
    """podman resolves both IDs the kubelet hands over and applies both specs: the claim's limits
    from mpsd's, the driver's edits (here an environment variable) from NVIDIA's."""
    from mpsd.dra.nvidiacdi import NvidiaSpecs as Specs
    from mpsd.alloc.container import SHIM_NAME
    from mpsd.alloc.state import install_file

    os.makedirs(env.paths.pipe_dir)
    install_file(str(shim_lib), env.paths.shim_host_dir, SHIM_NAME)
    env.cdi_dir.mkdir()
    (env.cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec(["0", "all"])))
    env.claims.put(claim(results=[result(memory="4Gi", compute="25")]))
    plugin = env.plugin(gpu_list=gpus(16), nvidia=Specs([str(env.cdi_dir)]))
    plugin.start()
    kubelet = StandInKubelet(plugin.registration_path)
    try:
        kubelet.register()
        ids = kubelet.container_cdi_ids(kubelet.prepare(("ns", "c1", "uid-1")).claims["uid-1"], "gpu")
        assert ids == ["mpsd.io/claim=uid-1_gpu", "nvidia.com/gpu=0"]
        r = podman.run(["sh", "-c", "echo $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT $NVIDIA_FROM_CDI $NVIDIA_CDI_DEVICE"],
                       devices=ids, cdi_spec_dir=env.cdi_dir, timeout=120)
        assert r.returncode == 0, r.output
        assert r.stdout.split() == ["0=4G", "1", "0"], r.output
    finally:
        kubelet.close()
        plugin.stop()


# -- device nodes: the host's, never mpsd's own container's (issue 28, found on the real node) ---

def driver_node_gpus():
    """Two GPUs whose minor numbers differ from their indexes, as NVML lists them."""
    from mpsd.inventory.nvml import Gpu

    return [Gpu(i, f"GPU-{i:08d}-aaaa-bbbb-cccc-{i:012d}", "Fake H100", 16 * GIB, 0, (9, 0), False, i + 2)
            for i in (0, 1)]


def driver_root(env, minors=(2, 3)):
    """A node whose driver's device nodes are under <root>/driver/dev on the host (the GPU
    operator's driver container, nvidia-ctk --dev-root), and mpsd's container sees them in its
    own /dev (here <root>/dev: NVIDIA's runtime gave mpsd them there)."""
    for d in (env.root / "driver" / "dev", env.root / "dev"):
        d.mkdir(parents=True, exist_ok=True)
        for name in (*CONTROL, *(f"nvidia{m}" for m in minors)):
            if os.geteuid() == 0:
                os.mknod(d / name, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
            else:
                (d / name).touch()
    return str(env.root / "driver")


def spec_nodes(env, rec):
    return {d["name"]: d["containerEdits"].get("deviceNodes", [])
            for d in json.loads((env.cdi_dir / rec.spec_name).read_text())["devices"]}


def test_a_claim_given_nvidias_device_names_none_of_its_nodes_again(env):
    """NVIDIA's device of the GPU (and its spec's common edits) bring the GPU's node and the
    control nodes, from the host path NVIDIA's spec gives: mpsd's spec repeats none of them."""
    root = driver_root(env)
    env.cdi_dir.mkdir()
    (env.cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec(["0", "1", "all"], dev_root=root,
                                                                         minors={"0": 2, "1": 3})))
    env.claims.put(claim(results=[result(memory="4Gi"), result(device="gpu-1", request="b", memory="4Gi")]))
    p = env.loaded(gpu_list=driver_node_gpus(), nvidia=NvidiaSpecs([str(env.cdi_dir)]))
    rec = p.prepare(REF)
    assert p.nvidia_ids(rec) == {0: "nvidia.com/gpu=0", 1: "nvidia.com/gpu=1"}
    assert spec_nodes(env, rec) == {"uid-1_gpu": [], "uid-1_b": []}


def test_nodes_mpsd_names_itself_are_at_the_host_path_nvidias_spec_gives(env):
    """GPU 1 has no NVIDIA device of its own (the spec names GPU 0 and ``all``): mpsd names its
    nodes, each at /dev/... in the container and at the hostPath NVIDIA's spec gives it, which
    the runtime (on the host) can open; mpsd's own /dev is not the host's."""
    root = driver_root(env)
    env.cdi_dir.mkdir()
    (env.cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec(["0", "all"], dev_root=root,
                                                                         minors={"0": 2, "1": 3})))
    env.claims.put(claim(results=[result(device="gpu-1", memory="4Gi")]))
    p = env.loaded(gpu_list=driver_node_gpus(), nvidia=NvidiaSpecs([str(env.cdi_dir)]))
    rec = p.prepare(REF)
    assert p.nvidia_ids(rec) == {}
    want = [{"path": f"/dev/{n}", "hostPath": f"{root}/dev/{n}"} for n in (*CONTROL, "nvidia3")]
    assert spec_nodes(env, rec) == {"uid-1_gpu": want}
    assert all(os.path.exists(n["hostPath"]) for n in want)


def test_without_nvidias_spec_nodes_are_under_the_configured_dev_root(env):
    root = driver_root(env)
    env.claims.put(claim(results=[result(memory="4Gi")]))
    rec = env.loaded(gpu_list=driver_node_gpus(), dev_root=root).prepare(REF)
    assert spec_nodes(env, rec) == {"uid-1_gpu": [{"path": f"/dev/{n}", "hostPath": f"{root}/dev/{n}"}
                                                  for n in (*CONTROL, "nvidia2")]}
    env.claims.put(claim(uid="uid-2", name="c2", results=[result(memory="4Gi")]))
    rec = env.loaded(gpu_list=driver_node_gpus()).prepare(ClaimRef("ns", "c2", "uid-2"))  # dev_root "/": as before
    assert spec_nodes(env, rec) == {"uid-2_gpu": [{"path": f"/dev/{n}"} for n in (*CONTROL, "nvidia2")]}


def test_a_claims_one_device_leaves_out_only_what_every_requests_containers_get():
    """A record written before requests had devices of their own: its one mpsd device is named
    by the containers of each request, which get NVIDIA's device of their own request's GPUs."""
    from mpsd.dra.claims import Result
    from mpsd.dra.nvidiacdi import SpecView, brought_nodes

    view = SpecView({"0": frozenset({"/dev/nvidiactl", "/dev/nvidia2"}),
                     "1": frozenset({"/dev/nvidiactl", "/dev/nvidia3"})}, {})
    ids = {0: "nvidia.com/gpu=0", 1: "nvidia.com/gpu=1"}
    results = [Result("a", NODE, "gpu-0"), Result("b", NODE, "gpu-1")]
    assert brought_nodes(results, "a", ids, view) == {"/dev/nvidiactl", "/dev/nvidia2"}
    assert brought_nodes(results, None, ids, view) == {"/dev/nvidiactl"}
    assert brought_nodes(results, None, {0: ids[0]}, view) == frozenset()


def test_a_container_given_both_devices_opens_each_node_at_its_host_path(podman, env, shim_lib):
    """podman, as containerd, opens every device node of the specs on the host: with mpsd's own
    /dev gone (it was never the host's), a claim given NVIDIA's device and one mpsd names the
    nodes of still start, each with its nodes once."""
    from mpsd.alloc.container import SHIM_NAME
    from mpsd.alloc.state import install_file

    os.makedirs(env.paths.pipe_dir)
    install_file(str(shim_lib), env.paths.shim_host_dir, SHIM_NAME)
    root = driver_root(env)
    env.cdi_dir.mkdir()
    (env.cdi_dir / "nvidia.yaml").write_text(yaml.safe_dump(nvidia_spec(["0", "all"], dev_root=root,
                                                                         minors={"0": 2, "1": 3})))
    env.claims.put(claim(results=[result(memory="4Gi")]))
    env.claims.put(claim(uid="uid-2", name="c2", results=[result(device="gpu-1", memory="4Gi")]))
    plugin = env.plugin(gpu_list=driver_node_gpus(), nvidia=NvidiaSpecs([str(env.cdi_dir)]))
    plugin.start()
    kubelet = StandInKubelet(plugin.registration_path)
    try:
        kubelet.register()
        reply = kubelet.prepare(("ns", "c1", "uid-1"), ("ns", "c2", "uid-2"))
        ids = {uid: kubelet.container_cdi_ids(reply.claims[uid], "gpu") for uid in ("uid-1", "uid-2")}
        assert ids == {"uid-1": ["mpsd.io/claim=uid-1_gpu", "nvidia.com/gpu=0"], "uid-2": ["mpsd.io/claim=uid-2_gpu"]}
        shutil.rmtree(env.root / "dev")  # mpsd's view of /dev: not on the host
        for uid, gpu in (("uid-1", "nvidia2"), ("uid-2", "nvidia3")):
            r = podman.run(["sh", "-c", f"ls /dev/nvidiactl /dev/nvidia-uvm /dev/{gpu} && echo cdi=$NVIDIA_FROM_CDI"],
                           devices=ids[uid], cdi_spec_dir=env.cdi_dir, timeout=120)
            assert r.returncode == 0, r.output
            assert r.stdout.split()[-1] == ("cdi=1" if uid == "uid-1" else "cdi="), r.output
    finally:
        kubelet.close()
        plugin.stop()
