"""Builds the fake libnvidia-ml.so.1 (tests/fakes/fake_nvml.c) for tests.

``build_fake_nvml(out_dir)`` runs ``make -f tests/fakes/nvml.mk OUT=out_dir`` and returns the
path of the library. The fake reads FAKE_NVML_CONFIG at nvmlInit; the format is documented at
the top of fake_nvml.c. ``nvml_config_text`` writes that format from plain values.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent
SONAME = "libnvidia-ml.so.1"


def build_fake_nvml(out_dir: Path) -> Path:
    """Build the fake into ``out_dir`` (created if needed) and return the library's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["make", "--no-print-directory", "-f", str(FAKES_DIR / "nvml.mk"), f"OUT={out_dir}", "fake-nvml"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the fake NVML failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return out_dir / SONAME


def nvml_config_text(
    gpus: Iterable[tuple[str, int, int, tuple[int, int], bool, str]],
    mps_clients: Iterable[tuple[int, int, int]] = (),
    compute_procs: Iterable[tuple[int, int, int]] = (),
    driver: str | None = None,
    fail: Iterable[tuple[str, int]] = (),
    privileged: bool = False,
) -> str:
    """Config text for the fake: gpus as (uuid, total, used, (cc_major, cc_minor), mig, name)
    indexed in order; clients/processes as (gpu_index, pid, used_bytes); fail as
    (function_name, nvml_error_code); ``privileged``: the caller may read a GPU in MIG mode whole
    (without it, as in an unprivileged container, NVML refuses that)."""
    lines = ["privileged"] if privileged else []
    for index, (uuid, total, used, (major, minor), mig, name) in enumerate(gpus):
        lines.append(f"gpu {index} {uuid} {total} {used} {major} {minor} {int(mig)} {name}")
    lines += [f"proc {gpu} {pid} {used}" for gpu, pid, used in mps_clients]
    lines += [f"compute {gpu} {pid} {used}" for gpu, pid, used in compute_procs]
    if driver is not None:
        lines.append(f"driver {driver}")
    lines += [f"fail {name} {code}" for name, code in fail]
    return "\n".join(lines) + "\n"


def mig_line(gpu: int, slot: int, uuid: str, gi: int, ci: int, gi_slices: int, ci_slices: int, sms: int,
             total: int, used: int, profile: str, **options: int) -> str:
    """One ``mig`` directive: a MIG device (compute instance) ``slot`` on GPU ``gpu`` (format at the
    top of fake_nvml.c; semantics in fake_nvml_mig.c); ``options``: gip, cip, start, ce, dec, enc,
    jpg, ofa (the GPU instance profile ID, placement start and engines)."""
    extra = "".join(f" {k}={v}" for k, v in options.items())
    return f"mig {gpu} {slot} {uuid} {gi} {ci} {gi_slices} {ci_slices} {sms} {total} {used} {profile}{extra}\n"
