"""PyTorch under libmpsshim on a real GPU: the cap is what torch sees and what it may take."""

from __future__ import annotations

import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.gpu.conftest import clean_env

GIB = 1 << 30

MEMINFO = "import torch; free, total = torch.cuda.mem_get_info(); print(free, total)"

ALLOC = textwrap.dedent(
    """
    import sys, torch
    nbytes = int(sys.argv[1])
    try:
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        print("OOM", str(exc).splitlines()[0][:200])
        sys.exit(3)
    print("OK", x.numel())
    if len(sys.argv) > 2:  # hold the memory until stdin closes
        sys.stdout.flush()
        sys.stdin.read()
    """
)


def _env(shim_lib: Path, region: Path, limit: str, **extra: str) -> dict[str, str]:
    return clean_env(
        LD_PRELOAD=str(shim_lib), MPSSHIM_REGION=str(region), CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=limit, **extra
    )


def _run(python: str, code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


def test_mem_get_info_reports_the_cap(torch_python, shim_lib, tmp_path):
    out = _run(torch_python, MEMINFO, _env(shim_lib, tmp_path / "region", "0=2G"))
    assert out.returncode == 0, out.stderr
    free, total = map(int, out.stdout.split())
    assert total == 2 * GIB
    assert 0 < free <= 2 * GIB


def test_allocation_past_the_cap_raises_torch_oom(torch_python, shim_lib, tmp_path):
    env = _env(shim_lib, tmp_path / "region", "0=2G")
    assert _run(torch_python, ALLOC, env, str(GIB)).returncode == 0
    over = _run(torch_python, ALLOC, env, str(3 * GIB))
    assert over.returncode == 3, over.stdout + over.stderr
    assert "OOM" in over.stdout
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in over.stderr or "cap" in over.stderr


def test_expandable_segments_are_capped_too(torch_python, shim_lib, tmp_path):
    env = _env(shim_lib, tmp_path / "region", "0=2G", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    over = _run(torch_python, ALLOC, env, str(3 * GIB))
    assert over.returncode == 3, over.stdout + over.stderr


def test_two_processes_sharing_a_region_share_one_cap(torch_python, shim_lib, tmp_path):
    env = _env(shim_lib, tmp_path / "region", "0=3G")
    holder = subprocess.Popen(
        [torch_python, "-c", ALLOC, str(2 * GIB), "hold"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().startswith("OK"), holder.stderr.read()
        second = _run(torch_python, ALLOC, env, str(2 * GIB))
        assert second.returncode == 3, second.stdout + second.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)
    again = _run(torch_python, ALLOC, env, str(2 * GIB))
    assert again.returncode == 0, again.stdout + again.stderr


TOTAL = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"


def test_device_properties_total_memory_is_the_cap(torch_python, shim_lib, tmp_path):
    """What vLLM-style gpu_memory_utilization sizing reads."""
    out = _run(torch_python, TOTAL, _env(shim_lib, tmp_path / "region", "0=2G"))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) == 2 * GIB


def test_nvidia_smi_under_the_shim_reports_the_cap(shim_lib, tmp_path, record):
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not on PATH")
    query = [smi, "--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader,nounits", "-i", "0"]
    bare = subprocess.run(query, env=clean_env(), capture_output=True, text=True, timeout=60)
    capped = subprocess.run(
        query, env=_env(shim_lib, tmp_path / "region", "0=2G"), capture_output=True, text=True, timeout=60
    )
    record(bare=bare.stdout.strip(), capped=capped.stdout.strip(), capped_stderr=capped.stderr.strip()[-500:])
    assert bare.returncode == 0 and capped.returncode == 0, bare.stderr + capped.stderr
    total, used, free = (int(v) for v in capped.stdout.split(","))
    assert total == 2048, capped.stdout  # MiB
    assert used + free <= 2048


GRAPH = textwrap.dedent(
    """
    import torch
    x = torch.ones(64 << 20, device="cuda")  # 256 MiB
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = x * 2 + 1  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
    for i in range(10):
        x.fill_(i)
        g.replay()
    torch.cuda.synchronize()
    assert float(y[0]) == 19.0 and float(y[-1]) == 19.0, float(y[0])
    free, total = torch.cuda.mem_get_info()
    print("OK", total, free)
    try:  # a graph whose private pool would pass the cap
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            z = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        print("CAPTURED-PAST-CAP")
    except Exception as exc:  # OOM, possibly wrapped by the end of the failed capture
        print("REFUSED-IN-CAPTURE", type(exc).__name__, str(exc).splitlines()[0][:200])
    """
)


def test_cuda_graphs_capture_and_replay_under_the_cap(torch_python, shim_lib, tmp_path, record):
    out = _run(torch_python, GRAPH, _env(shim_lib, tmp_path / "region", "0=2G"))
    record(stdout=out.stdout.strip(), stderr=out.stderr.strip()[-800:])
    assert out.returncode == 0, out.stdout + out.stderr
    first = out.stdout.splitlines()[0].split()
    assert first[0] == "OK" and int(first[1]) == 2 * GIB
    refused = [line for line in out.stdout.splitlines() if line.startswith("REFUSED-IN-CAPTURE")]
    assert refused and ("OutOfMemoryError" in refused[0] or "out of memory" in refused[0]), out.stdout


def test_torch_async_allocator_is_capped(torch_python, shim_lib, tmp_path):
    """PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync: cuMemAllocAsync from the device's pool."""
    env = _env(shim_lib, tmp_path / "region", "0=2G", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    assert _run(torch_python, ALLOC, env, str(GIB)).returncode == 0
    over = _run(torch_python, ALLOC, env, str(3 * GIB))
    assert over.returncode == 3, over.stdout + over.stderr


RACE = textwrap.dedent(
    """
    import sys, time, torch
    torch.cuda.init(); torch.empty(1, device="cuda")  # context first, outside the race
    start = float(sys.argv[1])
    time.sleep(max(0.0, start - time.time()))
    try:
        x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        print("OK", flush=True)
    except torch.OutOfMemoryError:
        print("OOM", flush=True)
    sys.stdin.read()  # hold until every racer has answered
    """
)


def test_racing_processes_share_one_cap(torch_python, shim_lib, tmp_path, record):
    """Six processes of one region ask for 1 GiB each at the same instant: three fit. The cap is
    3 GiB plus room for each process's first 2 MiB block (torch.empty(1)), which the shim counts."""
    env = _env(shim_lib, tmp_path / "region", "0=3136M")
    start = f"{time.time() + 20:.3f}"
    procs = [
        subprocess.Popen(
            [torch_python, "-c", RACE, start],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    try:
        answers = [p.stdout.readline().strip() for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
        errors = [p.stderr.read()[-300:] for p in procs]
        for p in procs:
            p.wait(timeout=120)
    record(answers=answers)
    assert sorted(answers) == ["OK"] * 3 + ["OOM"] * 3, (answers, errors)


def test_memory_of_a_sigkilled_holder_is_given_back(torch_python, shim_lib, tmp_path):
    env = _env(shim_lib, tmp_path / "region", "0=3G")
    holder = subprocess.Popen(
        [torch_python, "-c", ALLOC, str(2 * GIB), "hold"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().startswith("OK"), holder.stderr.read()
        assert _run(torch_python, ALLOC, env, str(2 * GIB)).returncode == 3  # the holder has it
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    again = _run(torch_python, ALLOC, env, str(2 * GIB))
    assert again.returncode == 0, again.stdout + again.stderr
