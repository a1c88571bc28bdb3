"""MPS v3 and memory partitioning on a real GPU (driver R615+; NVIDIA's "MPS v3 Interface" and
"MPS v3 Memory Partitioning" pages). Below R615 each test skips saying the driver it found; the
suite's stand-ins (tests/fakes/mps_control_v3.py, fake_nvml_limits.c) then stay unchecked against
the real thing, and the first run on an R615+ driver is what checks what they infer: the verb
spelling, the CSV columns (mpsd/daemon/control3.py), and NVML's limits on a cgroup.

Everything runs on a private pipe dir; a cgroup made here is removed; nothing changes the card."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu.conftest import GPUS, MPSD, clean_env, mps_processes, tempfile_short

V3_RELEASE = 615
GIB = 1 << 30


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0].strip()
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return ""


def _release(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


DRIVER = _driver()
needs_v3 = pytest.mark.skipif(
    GPUS > 0 and _release(DRIVER) < V3_RELEASE,  # no GPU at all: conftest's skip says so
    reason=f"MPS v3 and memory partitioning need driver R{V3_RELEASE}+; this GPU's driver is {DRIVER or 'unknown'}",
)


@pytest.fixture
def control() -> str:
    path = shutil.which("nvidia-cuda-mps-control")
    if path is None:
        pytest.skip("the driver's nvidia-cuda-mps-control is not on PATH")
    return path


@needs_v3
def test_the_drivers_binary_speaks_v3(control, record):
    from mpsd.sharing.detect import probe_binary

    speaks, said = probe_binary(control)
    help_text = subprocess.run([control, "-p", "3", "-h"], capture_output=True, text=True, timeout=30,
                               env=clean_env(CUDA_MPS_PIPE_DIRECTORY=tempfile_short()))
    record(driver=DRIVER, speaks=speaks, said=said, help=help_text.stdout + help_text.stderr)
    assert speaks, said


@needs_v3
def test_mpsd_runs_a_v3_daemon_with_namespaces(control, record):
    """mpsd's TOML taken, its verbs and their CSV parsed (each list verb's raw answer recorded in
    three forms), a namespace created, set, read back, its socket there, and deleted."""
    from mpsd.daemon.control3 import Control3, Limits3, differences

    base = Path(tempfile_short())
    pipe = base / "pipe"
    args = ["--control-binary", control, "--pipe-dir", str(pipe), "--log-dir", str(base / "log"),
            "--state-dir", str(base / "state"), "--metrics-address", "", "--mps-protocol", "3"]
    log = (base / "run.log").open("w")
    proc = subprocess.Popen([*MPSD, "run", *args], stdout=log, stderr=subprocess.STDOUT, env=clean_env())
    try:
        deadline = time.monotonic() + 60
        while not (pipe / "g0").is_dir() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        c = Control3(control, str(pipe), str(base / "log"), timeout=30)
        raw = {}  # what the real binary answers, in both forms mpsd may meet (docs/mps-v3.md's table)
        for verb in ("server list", "client list --all", "namespace list --server=g0"):
            for form in ("--format=csv", "--format=csv,noheader", "--format=table"):
                try:
                    raw[f"{verb} {form}"] = c.run(*verb.split(), form)
                except Exception as exc:  # recorded: a refusal is an answer too
                    raw[f"{verb} {form}"] = f"refused: {exc}"
        record(raw=raw, toml=(base / "state" / "mps-v3.toml").read_text())
        servers = c.server_list()
        record(servers=[str(s) for s in servers])
        assert [s.name for s in servers][:1] == ["g0"] and all(s.known for s in servers)
        c.namespace_create("g0", "mgpucheck000001")  # the page: create, then set
        c.namespace_set("g0", "mgpucheck000001", Limits3("1G", "25", "0"))
        listed = {n.name: n.limits for n in c.namespace_list("g0")}
        got = {f: c.namespace_get("g0", "mgpucheck000001", f) for f in ("pinned-memory-limit", "client-priority")}
        record(namespaces={k: str(v) for k, v in listed.items()}, get=got)
        assert differences(Limits3("1G", "25", "0"), listed["mgpucheck000001"]) in ([], ["client-priority unknown"])
        assert (pipe / "g0" / "mgpucheck000001" / "control").exists()
        c.namespace_delete("g0", "mgpucheck000001")
        assert "mgpucheck000001" not in {n.name for n in c.namespace_list("g0")}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        log.close()
        left = mps_processes(pipe)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
    assert code == 0 and not left


CLIENT = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
cuda.cuDeviceGet(ctypes.byref(dev), 0)
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
free, total = ctypes.c_size_t(), ctypes.c_size_t()
cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
ptr = ctypes.c_uint64()
rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), int(sys.argv[1]))
print(total.value, rc)
"""


@needs_v3
def test_the_driver_limits_a_cgroups_gpu_memory(record):
    """NVML's limits on a cgroup of our own: read back, an allocation beyond the hard limit
    refused, the memory query inside the cgroup reporting the limit, cleared at the end."""
    from mpsd.inventory import nvml as inventory
    from mpsd.inventory.nvml import Inventory

    root = Path("/sys/fs/cgroup")
    if os.geteuid() != 0 or not (root / "cgroup.controllers").is_file():
        pytest.skip("needs root and cgroup v2 at /sys/fs/cgroup")
    cg = root / f"mpsd-gpucheck-{os.getpid()}"
    cg.mkdir()
    inv = Inventory()
    try:
        inventory.set_memory_limits(0, str(cg), GIB, 2 * GIB)
        assert inventory.memory_limits(0, str(cg))[:2] == (GIB, 2 * GIB)
        child = subprocess.Popen(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$1" "$2"',
                                  sys.executable, CLIENT, str(3 * GIB)], stdout=subprocess.PIPE, text=True,
                                 env=clean_env())
        out, _ = child.communicate(timeout=120)
        total, rc = (int(x) for x in out.split())
        record(driver=DRIVER, reported_total=total, alloc_3g_result=rc, dmem=(root / "dmem.capacity").is_file())
        assert total <= 2 * GIB and rc != 0  # CUDA_ERROR_OUT_OF_MEMORY beyond the hard limit
    finally:
        try:
            inventory.set_memory_limits(0, str(cg), 0, inventory.NO_LIMIT)
        finally:
            inv.close()
            cg.rmdir()
