"""NVIDIA's own CDI specs (nvidia-ctk cdi generate, the GPU operator): found in the CDI
directories, their device IDs answered beside mpsd's, and a podman container given both."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from mpsd.dra.nvidiacdi import MAX_SPEC_BYTES, NvidiaSpecs, device_for

from tests.dra.conftest import StandInKubelet, claim, gpus, result

UUID0 = gpus(80)[0].uuid


def nvidia_spec(names, env=("NVIDIA_FROM_CDI=1",)):
    """What ``nvidia-ctk cdi generate`` writes, cut down: kind nvidia.com/gpu, a device per GPU
    (and ``all``), the driver's files as common edits (here only an environment variable)."""
    return {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": n, "containerEdits": {"env": [f"NVIDIA_CDI_DEVICE={n}"]}} for n in names],
            "containerEdits": {"env": list(env)}}


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
