"""Which sharing backend a node uses, decided once at start (config ``mps.protocol``).

MPS v3 needs the control binary to speak it and a driver of release 615 or later ("MPS v3
Interface": opt-in from R615 / CUDA 13.4). The binary is asked ``-p 3 -h`` on a private, empty
pipe directory (a front-end follows a running daemon's protocol, so the node's own pipe dir
is never used): a v3 binary lists its ``server`` and ``namespace`` modules (NVIDIA's Dynamo
guide checks exactly this), a v2 one (535 .. 580 seen) answers "Cannot find MPS control
daemon process". The driver's release is NVML's driver version.

- ``auto``: v3 where both hold, else v2, with the reason;
- ``3``: v3, or a one-line SetupError naming what is missing;
- ``2``: v2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from ..errors import SetupError

V3_RELEASE = 615
PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class Choice:
    protocol: int  # 2 or 3
    reason: str


def driver_release(version: str | None) -> int | None:
    """``615.20.01`` -> 615; None when unknown or not of that form."""
    match = re.match(r"([0-9]{2,4})\.", version or "")
    return int(match.group(1)) if match else None


def probe_binary(binary: str, timeout: float = PROBE_TIMEOUT) -> tuple[bool, str]:
    """(speaks v3, what it said in a few words)."""
    path = shutil.which(binary)
    if path is None:
        return False, f"control binary {binary!r} not found"
    with tempfile.TemporaryDirectory(prefix="mpsd-probe-") as pipe:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=pipe)
        env.pop("CUDA_MPS_PROTOCOL_VERSION", None)
        try:
            proc = subprocess.run([path, "-p", "3", "-h"], capture_output=True, text=True, timeout=timeout, env=env,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"{binary} -p 3 -h gave no answer in {timeout:g}s"
        except OSError as exc:
            return False, f"cannot run {binary}: {exc.strerror}"
    said = proc.stdout + proc.stderr
    if re.search(r"\bnamespace\b", said) and re.search(r"\bserver\b", said):
        return True, f"{binary} -p 3 -h lists the server and namespace modules"
    first = " ".join(said.split())[:80] or f"exit status {proc.returncode}"
    return False, f"{binary} -p 3 -h does not list the v3 modules ({first!r})"


def choose(protocol: str, binary: str, driver_version: str | None, probe=probe_binary) -> Choice:
    """The backend for ``mps.protocol`` on this node; SetupError when 3 cannot be had."""
    if protocol == "2":
        return Choice(2, "mps.protocol 2")
    speaks, said = probe(binary)
    release = driver_release(driver_version)
    if not speaks:
        missing = said
    elif release is None:
        missing = f"the driver's release is unknown (NVML driver version {driver_version!r})"
    elif release < V3_RELEASE:
        missing = f"driver {driver_version} is below R{V3_RELEASE}"
    else:
        return Choice(3, f"{said}; driver {driver_version} (R{V3_RELEASE}+)")
    if protocol == "3":
        raise SetupError(f"mps.protocol 3: MPS v3 is not available here: {missing}; expected a control binary and "
                         f"driver of R{V3_RELEASE} or later, or mps.protocol auto or 2")
    return Choice(2, f"mps.protocol auto: {missing}")
