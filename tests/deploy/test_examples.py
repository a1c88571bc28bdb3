"""examples/: the client pods ask for what the device plugin advertises, and the clients run
and see a slice's memory under the shim (on the fake libcuda.so.1 from tests/fakes)."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import REPO, config_text, rendered

PODS = REPO / "examples/pods"
GIB = 2**30


def pod(name: str) -> dict[str, Any]:
    return yaml.safe_load((PODS / name).read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in PODS.glob("*.yaml")))
def test_example_pod_passes_the_schema_and_requests_the_advertised_resource(name: str) -> None:
    obj = pod(name)
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    resource = yaml.safe_load(config_text(rendered("deploy")))["devicePlugin"]["resourceName"]
    (app,) = obj["spec"]["containers"]
    assert int(app["resources"]["limits"][resource]) >= 1


@pytest.mark.parametrize("name, install", [("hostipc-client.yaml", "deploy"),
                                           ("tmpfs-client.yaml", "deploy/overlays/tmpfs")])
def test_pod_ipc_matches_its_install(name: str, install: str) -> None:
    mode = yaml.safe_load(config_text(rendered(install)))["devicePlugin"]["ipcMode"]
    assert pod(name)["spec"].get("hostIPC", False) is (mode == "hostIPC")


def test_the_two_pods_differ_only_in_name_and_hostipc() -> None:
    a, b = copy.deepcopy(pod("hostipc-client.yaml")), copy.deepcopy(pod("tmpfs-client.yaml"))
    for p in (a, b):
        p["metadata"].pop("name")
        p["spec"].pop("hostIPC", None)
    assert a == b


def test_client_pods_share_one_uid() -> None:
    # MPS runs one server per UID; clients of a second UID wait for the first one's to end.
    uids = {pod(p.name)["spec"]["containers"][0]["securityContext"]["runAsUser"] for p in PODS.glob("*.yaml")}
    assert len(uids) == 1


def ctypes_client(run_client: Any, env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    proc = run_client([sys.executable, REPO / "examples/ctypes_client.py", "--json", *args], env=env)
    assert proc.returncode in (0, 3), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_ctypes_client_without_a_slice_sees_the_whole_device(run_client: Any, shim_env: Any) -> None:
    rc, out = ctypes_client(run_client, shim_env(devices="16G,8G", preload=False), "--allocate", "6G")
    assert [d["total_mem"] for d in out["devices"]] == [16 * GIB, 8 * GIB]
    assert out["allocation"]["result"] == 0 and rc == 0


def test_ctypes_client_under_the_shim_sees_its_slice(run_client: Any, shim_env: Any) -> None:
    rc, out = ctypes_client(run_client, shim_env(limit="0=4G,1=2G", devices="16G,8G"), "--allocate", "6G")
    assert [d["total_mem"] for d in out["devices"]] == [4 * GIB, 2 * GIB]
    assert [d["mem_info_total"] for d in out["devices"]] == [4 * GIB, 2 * GIB]
    assert out["allocation"] == {"bytes": 6 * GIB, "result": 2, "error": "CUDA_ERROR_OUT_OF_MEMORY"}
    assert rc == 3
    rc, out = ctypes_client(run_client, shim_env(limit="0=4G", devices="16G"), "--allocate", "3G")
    assert out["allocation"]["result"] == 0 and rc == 0


def test_ctypes_client_rejects_a_malformed_size(run_client: Any, shim_env: Any) -> None:
    proc = run_client([sys.executable, REPO / "examples/ctypes_client.py", "--allocate", "6Q"], env=shim_env())
    assert proc.returncode == 2
    assert "size '6Q'" in proc.stderr and proc.stderr.strip().count("\n") <= 2


FAKE_TORCH = '''
class OutOfMemoryError(RuntimeError):
    pass

class _Props:
    name = "Fake GPU"
    total_memory = 4 << 30
    multi_processor_count = 13

class cuda:
    OutOfMemoryError = OutOfMemoryError
    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    mem_get_info = staticmethod(lambda i: (3 << 30, 4 << 30))
    get_device_properties = staticmethod(lambda i: _Props())
    empty_cache = staticmethod(lambda: None)

uint8 = "uint8"

def empty(n, dtype, device):
    if n > (3 << 30):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate %d bytes\\nmore" % n)
    return object()
'''


def test_torch_client_reports_and_catches_oom(tmp_path: Path, run_client: Any) -> None:
    # A stand-in torch module: checks the script's own logic and output, not PyTorch.
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    env = {"PYTHONPATH": str(tmp_path), "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G"}
    proc = run_client([sys.executable, REPO / "examples/torch_client.py", "--json", "--allocate", "6G"], env=env)
    assert proc.returncode == 3, proc.stderr
    out = json.loads(proc.stdout)
    assert out["devices"][0]["mem_get_info_total"] == 4 * GIB
    assert out["environment"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4G"
    assert out["allocation"] == {"bytes": 6 * GIB, "ok": False,
                                 "error": f"CUDA out of memory. Tried to allocate {6 * GIB} bytes"}
    proc = run_client([sys.executable, REPO / "examples/torch_client.py", "--allocate", "1G"], env=env)
    assert proc.returncode == 0 and "allocate 1.00 GiB on cuda:0: ok" in proc.stdout


def test_torch_client_with_real_torch_and_no_gpu_says_so(run_client: Any) -> None:
    pytest.importorskip("torch", reason="PyTorch is not installed here")
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu covers this client on hardware")
    proc = run_client([sys.executable, REPO / "examples/torch_client.py"])
    assert proc.returncode == 1 and "is_available() is False" in proc.stderr
