"""PyTorch under libmpsshim on a real GPU: the cap is what torch sees and what it may take."""
from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

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
