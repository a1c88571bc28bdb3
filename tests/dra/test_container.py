"""A real container gets its claim's slice: podman + runc (tests/container.py) run a container with
the CDI device ID that NodePrepareResources returned, and podman applies the spec mpsd wrote.
Inside, the environment, the shim and the region directory are there, and a CUDA client over
the fake driver (tests/fakes) is refused past its claim's memory, while a second claim's
container on the same GPU has its own cap."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from mpsd.alloc.container import SHIM_NAME
from mpsd.alloc.state import install_file
from tests.container import HOST_LIBS, Mount

from tests.dra.conftest import GIB, StandInKubelet, claim, gpus, result

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@pytest.fixture(scope="module")
def cuclient(tmp_path_factory) -> Path:
    """tests/shim/cuclient.c in dlsym mode (libcuda.so.1 found through LD_LIBRARY_PATH)."""
    out = tmp_path_factory.mktemp("cuclient") / "cuclient"
    subprocess.run(["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'csrc'}",
                    str(REPO / "tests/shim/cuclient.c"), "-o", str(out), "-ldl", "-lpthread"], check=True, timeout=120)
    return out


@pytest.fixture
def prepared(env, shim_lib):
    """Two claims on GPU 0 (16 GiB, as the fake driver's FAKE_CUDA_DEVICES=16G), 4Gi and 2Gi,
    prepared through a registered plugin over gRPC; yields {claim name: CDI device ID}."""
    os.makedirs(env.paths.pipe_dir)
    install_file(str(shim_lib), env.paths.shim_host_dir, SHIM_NAME)  # as run_dra installs it
    env.claims.put(claim(uid="uid-a", name="a", results=[result(memory="4Gi", compute="25")]))
    env.claims.put(claim(uid="uid-b", name="b", results=[result(memory="2Gi")]))
    plugin = env.plugin(gpu_list=gpus(16))
    plugin.start()
    kubelet = StandInKubelet(plugin.registration_path)
    kubelet.register()
    reply = kubelet.prepare(("ns", "a", "uid-a"), ("ns", "b", "uid-b"))
    ids = {}
    for name, uid in (("a", "uid-a"), ("b", "uid-b")):
        entry = reply.claims[uid]
        assert entry.error == ""
        (ids[name],) = entry.devices[0].cdi_device_ids
    yield ids, plugin
    kubelet.unprepare(("ns", "a", "uid-a"), ("ns", "b", "uid-b"))
    kubelet.close()
    plugin.stop()


def run_claim(podman, env, device, argv, fake_cuda_dir, cuclient):
    return podman.run(
        argv,
        devices=[device],
        cdi_spec_dir=env.cdi_dir,
        mounts=[*HOST_LIBS, Mount(fake_cuda_dir, "/opt/fake"), Mount(cuclient.parent, "/opt/client")],
        env={"LD_LIBRARY_PATH": "/opt/fake", "FAKE_CUDA_DEVICES": "16G"},
        timeout=120,
    )


def rcs(stdout: str) -> list[tuple[str, int]]:
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"^(\w+) rc=(-?\d+)", stdout, re.M)]


def test_a_container_gets_its_claims_slice_through_cdi(podman, env, prepared, fake_cuda_dir, cuclient):
    ids, plugin = prepared
    assert ids == {"a": "mpsd.io/claim=uid-a_gpu", "b": "mpsd.io/claim=uid-b_gpu"}
    rec_a = plugin.preparer.store.get("claim-uid-a")

    # the environment, the shim, the region directory and the read-only pipe directory
    script = ("env | sort; ls -l /run/mpsd-shim/libmpsshim.so.3; touch /run/mpsd/probe && echo region-writable; "
              f"touch {env.paths.pipe_dir}/x 2>/dev/null && echo pipe-writable || echo pipe-read-only")
    r = run_claim(podman, env, ids["a"], ["sh", "-c", script], fake_cuda_dir, cuclient)
    assert r.returncode == 0, r.output
    seen = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line and not line.startswith("-"))
    assert seen["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4G"
    assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert seen["CUDA_MPS_PIPE_DIRECTORY"] == env.paths.pipe_dir
    assert seen["LD_PRELOAD"] == "/run/mpsd-shim/libmpsshim.so.3" and seen["MPSSHIM_REGION"] == "/run/mpsd/region-gpu"
    assert "libmpsshim.so" in r.stdout and "region-writable" in r.stdout and "pipe-read-only" in r.stdout
    assert os.path.exists(os.path.join(rec_a.region_dir, "probe"))  # the claim's own directory on the host

    # claim a: 4 GiB for all its processes; 3 GiB fits, 2 GiB more does not
    client = ["/opt/client/cuclient", "dlsym", "12000", "0", "init", "ctx", "0"]
    r = run_claim(podman, env, ids["a"], [*client, "alloc", str(3 * GIB), "alloc", str(2 * GIB),
                                          "alloc", str(512 * MIB)], fake_cuda_dir, cuclient)
    assert r.returncode == 0, r.output
    assert rcs(r.stdout)[-3:] == [("alloc", 0), ("alloc", 2), ("alloc", 0)], r.output  # 2: CUDA_ERROR_OUT_OF_MEMORY
    assert os.path.exists(os.path.join(rec_a.region_dir, "region-gpu"))  # the shim's region, in the claim's directory

    # claim b on the same GPU: its own 2 GiB cap
    r = run_claim(podman, env, ids["b"], [*client, "alloc", str(3 * GIB), "alloc", str(1536 * MIB),
                                          "alloc", str(1 * GIB)], fake_cuda_dir, cuclient)
    assert r.returncode == 0, r.output
    assert rcs(r.stdout)[-3:] == [("alloc", 2), ("alloc", 0), ("alloc", 2)], r.output
    rec_b = plugin.preparer.store.get("claim-uid-b")
    assert rec_b.region_dir != rec_a.region_dir and os.path.exists(os.path.join(rec_b.region_dir, "region-gpu"))


@pytest.fixture
def two_requests(env, shim_lib):
    """One claim with two requests on GPU 0 (16 GiB): ``a`` 4Gi/25 %, ``b`` 2Gi/10 %, prepared
    through a registered plugin over gRPC; yields (the claim's entry, the stand-in kubelet)."""
    os.makedirs(env.paths.pipe_dir)
    install_file(str(shim_lib), env.paths.shim_host_dir, SHIM_NAME)
    env.claims.put(claim(uid="uid-c", name="c", results=[result(request="a", memory="4Gi", compute="25"),
                                                         result(request="b", memory="2Gi", compute="10")]))
    plugin = env.plugin(gpu_list=gpus(16))
    plugin.start()
    kubelet = StandInKubelet(plugin.registration_path)
    kubelet.register()
    entry = kubelet.prepare(("ns", "c", "uid-c")).claims["uid-c"]
    assert entry.error == ""
    yield entry, kubelet
    kubelet.unprepare(("ns", "c", "uid-c"))
    kubelet.close()
    plugin.stop()


def test_each_request_of_a_claim_has_its_own_cap_in_a_container(podman, env, two_requests, fake_cuda_dir, cuclient):
    """The container naming request a is held to a's 4 GiB, the one naming b to b's 2 GiB, each
    with its own region, though both requests are on the same GPU: naming b no longer gives a's
    limits. A container naming the whole claim gets both CDI devices and podman applies them."""
    entry, kubelet = two_requests
    client = ["/opt/client/cuclient", "dlsym", "12000", "0", "init", "ctx", "0"]
    show = ["sh", "-c", "echo LIMIT=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT PCT=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "
                        "REGION=$MPSSHIM_REGION"]

    (a,) = kubelet.container_cdi_ids(entry, "a")
    r = run_claim(podman, env, a, [*client, "alloc", str(3 * GIB), "alloc", str(2 * GIB), "alloc", str(512 * MIB)],
                  fake_cuda_dir, cuclient)
    assert r.returncode == 0, r.output
    assert rcs(r.stdout)[-3:] == [("alloc", 0), ("alloc", 2), ("alloc", 0)], r.output
    assert "LIMIT=0=4G PCT=25 REGION=/run/mpsd/region-a" in run_claim(podman, env, a, show, fake_cuda_dir,
                                                                      cuclient).stdout

    (b,) = kubelet.container_cdi_ids(entry, "b")
    r = run_claim(podman, env, b, [*client, "alloc", str(3 * GIB), "alloc", str(1536 * MIB), "alloc", str(1 * GIB)],
                  fake_cuda_dir, cuclient)
    assert r.returncode == 0, r.output
    assert rcs(r.stdout)[-3:] == [("alloc", 2), ("alloc", 0), ("alloc", 2)], r.output
    assert "LIMIT=0=2G PCT=10 REGION=/run/mpsd/region-b" in run_claim(podman, env, b, show, fake_cuda_dir,
                                                                      cuclient).stdout

    whole = kubelet.container_cdi_ids(entry)
    assert sorted(whole) == sorted([a, b])
    r = podman.run([*show[:2], show[2] + "; env | grep ^MPSD_DEVICE_ | sort"], devices=whole,
                   cdi_spec_dir=env.cdi_dir, timeout=120)
    assert r.returncode == 0, r.output
    # MPS has one limit list and one percentage per process, the shim one region: the runtime's
    # merge of the two devices gives one request's three, never a mix (docs/dra.md, Limitations)
    assert r.stdout.splitlines()[0] in ("LIMIT=0=4G PCT=25 REGION=/run/mpsd/region-a",
                                        "LIMIT=0=2G PCT=10 REGION=/run/mpsd/region-b"), r.output
    markers = sorted(line.split("=", 1)[1] for line in r.stdout.splitlines()[1:])
    assert markers == ["uid-c_a", "uid-c_b"], r.output  # each device's own variable survives the merge

    # ... so the shim in such a container refuses CUDA rather than cap one request and not the other
    r = podman.run([*client, "alloc", str(1 * GIB)], devices=whole, cdi_spec_dir=env.cdi_dir,
                   mounts=[*HOST_LIBS, Mount(fake_cuda_dir, "/opt/fake"), Mount(cuclient.parent, "/opt/client")],
                   env={"LD_LIBRARY_PATH": "/opt/fake", "FAKE_CUDA_DEVICES": "16G"}, timeout=120)
    assert ("init", 1) in rcs(r.stdout), r.output  # CUDA_ERROR_INVALID_VALUE
    assert "this container has 2 mpsd devices (uid-c_" in r.output and "one request of one mpsd claim" in r.output
