"""Build the fake driver libraries in tests/fakes/ (one make target per fake).

`build_fake_cuda(out_dir)` builds only the fake libcuda.so.1; `build_fakes(out_dir)` builds
every fake the Makefile lists. Both return the directory, ready for LD_LIBRARY_PATH.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent


class FakeBuildError(RuntimeError):
    """make failed; the message carries the compiler's output."""


def _make(target: str, out_dir: Path) -> Path:
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["make", "-s", "-C", str(FAKES_DIR), f"OUT_DIR={out_dir}", target],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise FakeBuildError(f"make {target} in {FAKES_DIR} failed (rc={proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return out_dir


def build_fake_cuda(out_dir: Path) -> Path:
    """Build libcuda.so.1 (and the libcuda.so link) into out_dir."""
    return _make("cuda", out_dir)


def build_fake_nvml(out_dir: Path) -> Path:
    """Build the fake libnvidia-ml.so.1 (config format: top of fake_nvml.c) into out_dir."""
    return _make("nvml", out_dir)


def build_fakes(out_dir: Path) -> Path:
    """Build every fake driver into out_dir."""
    return _make("all", out_dir)


def install_fake_mps_v3(out_dir: Path) -> Path:
    """An executable ``nvidia-cuda-mps-control`` in out_dir that runs the MPS v3 stand-in
    (tests/fakes/mps_control_v3.py) with this interpreter."""
    import sys

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "nvidia-cuda-mps-control"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKES_DIR / "mps_control_v3.py"}" "$@"\n')
    path.chmod(0o755)
    return path


def install_static_partition_standin(out_dir: Path, real_control: Path) -> Path:
    """An executable ``nvidia-cuda-mps-control`` in out_dir: ``-f -S`` runs the static SM partition
    stand-in daemon (tests/fakes/mps_control_static.py), anything else the real binary ``real_control``."""
    import sys

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "nvidia-cuda-mps-control"
    path.write_text(f'#!/bin/sh\n# stand-in with sm_partition and --static-partitioning\nMPSD_TEST_REAL_CONTROL="{real_control}" exec "{sys.executable}" '
                    f'"{FAKES_DIR / "mps_control_static.py"}" "$@"\n')
    path.chmod(0o755)
    return path
