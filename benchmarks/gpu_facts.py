"""What a GPU machine has: GPU, driver, CUDA, frameworks, MPS binaries (scripts/gpu-check.sh).

    python benchmarks/gpu_facts.py [--control-binary PATH]      # prints one JSON object

Reads NVML through pynvml (the fake libnvidia-ml.so.1 of tests/fakes when LD_LIBRARY_PATH
points at it: the dry-run), nvidia-smi when it is on PATH, and imports PyTorch in a child
process. Changes nothing on the machine. Every probe that fails records its one-line reason
instead of raising, so the check goes on and the results say what was missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CACHED_CONTROL = REPO / ".cache" / "mps" / "root" / "usr" / "bin" / "nvidia-cuda-mps-control"
VERSION_RE = re.compile(rb"(?<![0-9.])([1-9][0-9]{2}\.[0-9]{2,3}(?:\.[0-9]{2})?)(?![0-9.])")
FRAMEWORKS = ("torch", "jax", "jaxlib", "cupy-cuda13x", "cupy-cuda12x", "numba", "numba-cuda", "cffi", "pytest")

TORCH_PROBE = """
import json, torch
out = {"version": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
if out["available"]:
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, total_memory=p.total_memory, sms=p.multi_processor_count)
print(json.dumps(out))
"""


def binary_versions(path: str | os.PathLike[str]) -> list[str]:
    """Driver-style version strings (``535.261.03``) found in a binary's bytes, sorted."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    return sorted({m.decode() for m in VERSION_RE.findall(data)})


def version_match(driver: str | None, found: list[str]) -> bool | None:
    """True when the binary carries the driver's version, False when it carries another, None unknown."""
    if not driver or not found:
        return None
    return driver in found


def find_control(explicit: str | None) -> str | None:
    if explicit:
        return explicit if os.path.isfile(explicit) else shutil.which(explicit)
    return shutil.which("nvidia-cuda-mps-control")


def find_server(control: str | None) -> str | None:
    on_path = shutil.which("nvidia-cuda-mps-server")
    if on_path or not control:
        return on_path
    sibling = Path(control).resolve().parent.parent / "sbin" / "nvidia-cuda-mps-server"
    return str(sibling) if sibling.is_file() else None


def _run(cmd: list[str], timeout: float = 30) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{cmd[0]}: {exc}"
    return proc.returncode, (proc.stdout if proc.returncode == 0 else proc.stderr or proc.stdout).strip()


def nvidia_smi() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"path": None, "error": "nvidia-smi is not on PATH"}
    rc, listing = _run([smi, "-L"])
    fields = "name,driver_version,memory.total,compute_mode,mig.mode.current,pci.bus_id"
    rc2, query = _run([smi, f"--query-gpu={fields}", "--format=csv,noheader"])
    out: dict[str, Any] = {"path": smi, "list": listing.splitlines() if rc == 0 else [], "query": []}
    if rc2 == 0:
        out["query"] = [
            dict(zip(fields.split(","), (v.strip() for v in line.split(",")), strict=False))
            for line in query.splitlines()
        ]
    if rc != 0 or rc2 != 0:
        out["error"] = (listing if rc != 0 else query).splitlines()[-1:] or ["no output"]
    return out


def nvml() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError as exc:
        return {"error": f"pynvml not importable: {exc}"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"error": f"nvmlInit: {exc}"}
    out: dict[str, Any] = {"devices": []}
    try:
        out["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
            out["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except (pynvml.NVMLError, AttributeError) as exc:
            out["cuda_driver"] = None
            out["cuda_driver_error"] = str(exc)
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            dev = {
                "index": i,
                "name": _text(pynvml.nvmlDeviceGetName(h)),
                "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                "total": int(mem.total),
                "used": int(mem.used),
            }
            try:
                dev["compute_capability"] = ".".join(map(str, pynvml.nvmlDeviceGetCudaComputeCapability(h)))
            except pynvml.NVMLError:
                pass
            out["devices"].append(dev)
    except pynvml.NVMLError as exc:
        out["error"] = str(exc)
    finally:
        pynvml.nvmlShutdown()
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def torch_info(python: str = sys.executable) -> dict[str, Any]:
    rc, text = _run([python, "-c", TORCH_PROBE], timeout=180)
    if rc != 0:
        return {"error": (text.splitlines() or ["no output"])[-1]}
    return json.loads(text.splitlines()[-1])


def packages() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in FRAMEWORKS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def mps_binaries(control_arg: str | None, driver: str | None) -> dict[str, Any]:
    control = find_control(control_arg)
    server = find_server(control)
    found = binary_versions(control) if control else []
    return {
        "control": control,
        "server": server,
        "control_on_path": shutil.which("nvidia-cuda-mps-control") is not None,
        "server_on_path": shutil.which("nvidia-cuda-mps-server") is not None,
        "control_versions": found,
        "matches_driver": version_match(driver, found),
    }


def collect(control_arg: str | None = None) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "host": {
            "kernel": platform.release(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "executable": sys.executable,
        },
        "nvidia_smi": nvidia_smi(),
        "nvml": nvml(),
        "torch": torch_info(),
        "packages": packages(),
    }
    facts["mps"] = mps_binaries(control_arg, facts["nvml"].get("driver"))
    return facts


def describe(facts: dict[str, Any]) -> list[str]:
    """The few lines gpu-check prints about the machine."""
    nv, t, mps = facts["nvml"], facts["torch"], facts["mps"]
    gpus = ", ".join(f"{d['name']} ({d['total'] >> 20} MiB)" for d in nv.get("devices", [])) or nv.get("error", "none")
    torch_line = t.get("error") or f"{t['version']} (CUDA {t.get('cuda')}, GPU usable: {t.get('available')})"
    match = {True: "matches the driver", False: "does NOT match the driver", None: "version unknown"}
    control = mps["control"] or "not found"
    return [
        f"GPU: {gpus}",
        f"driver: {nv.get('driver', 'unknown')}  CUDA (driver): {nv.get('cuda_driver') or 'unknown'}",
        f"PyTorch: {torch_line}",
        f"MPS control: {control} (on PATH: {mps['control_on_path']}; "
        f"{', '.join(mps['control_versions']) or 'no version string'}: {match[mps['matches_driver']]})",
        f"MPS server: {mps['server'] or 'not found'} (on PATH: {mps['server_on_path']})",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control-binary", default=None)
    args = ap.parse_args(argv)
    print(json.dumps(collect(args.control_binary), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
