"""Fixtures for the libmpsshim tests: the shim, the fake drivers and the C clients, built once
per session into a temporary directory, and `shim_run`, which runs a client under the shim.

The fake libcuda is compiled here with -Bsymbolic-functions, so the addresses its
cuGetProcAddress hands out are its own functions (as with NVIDIA's driver), not the shim's
exports of the same names: only the shim's cuGetProcAddress wrapper can turn them into
hooks, which is what the path tests must prove. `plain_fake_dir` is the fake as
tests/fakes/Makefile builds it, for one cross-check.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
FAKES = REPO / "tests" / "fakes"
HERE = Path(__file__).resolve().parent
G = 1 << 30
M = 1 << 20

# The fake NVML sees the same two devices as the fake CUDA (FAKE_CUDA_DEVICES="16G,8G").
NVML_CONFIG = (
    "gpu 0 GPU-face0000-0000-0000-0000-000000000000 17179869184 0 9 0 0 Fake GPU\n"
    "gpu 1 GPU-face0000-0000-0000-0000-000000000001 8589934592 0 9 0 0 Fake GPU\n"
)


def _run(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}{proc.stderr}")


@pytest.fixture(scope="session")
def shim_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shim") / "libmpsshim.so"
    _run(["make", "-s", "-C", str(CSRC), f"OUT={out}", "lib"])
    return out


def _build_fakes(out: Path, symbolic: bool) -> Path:
    """Build the fakes with their own Makefiles; `symbolic` adds -Bsymbolic-functions to the
    fake libcuda's link (and checks it took: no relocation left for its own cuMemAlloc_v2)."""
    ldflags = ["LDFLAGS=-shared -Wl,-Bsymbolic-functions"] if symbolic else []
    _run(["make", "-s", "-C", str(FAKES), f"OUT_DIR={out}", *ldflags, "cuda"])
    _run(["make", "-s", "-f", str(FAKES / "nvml.mk"), f"OUT={out}", "fake-nvml"])
    relocs = subprocess.run(
        ["readelf", "-rW", str(out / "libcuda.so.1")], capture_output=True, text=True, check=True
    ).stdout
    bound_locally = " cuMemAlloc_v2 " not in relocs
    if bound_locally != symbolic:
        raise RuntimeError(f"fake libcuda in {out}: expected symbolic={symbolic}, relocations say otherwise")
    return out


@pytest.fixture(scope="session")
def fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_fakes(tmp_path_factory.mktemp("fake"), symbolic=True)


@pytest.fixture(scope="session")
def plain_fake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_fakes(tmp_path_factory.mktemp("fake_plain"), symbolic=False)


@pytest.fixture(scope="session")
def clients(tmp_path_factory: pytest.TempPathFactory, fake_dir: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("clients")
    flags = ["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}"]
    _run([*flags, str(HERE / "cuclient.c"), "-o", str(out / "cuclient"), "-ldl", "-lpthread"])
    _run(
        [
            *flags,
            "-DLINKED",
            str(HERE / "cuclient.c"),
            "-o",
            str(out / "cuclient_link"),
            f"-L{fake_dir}",
            "-lcuda",
            "-l:libnvidia-ml.so.1",
            "-ldl",
            "-lpthread",
        ]
    )
    return {"dlsym": out / "cuclient", "gpa": out / "cuclient", "gpa2": out / "cuclient", "link": out / "cuclient_link"}


@dataclass
class Result:
    """One client run: its output lines as dicts ({"cmd": ..., "rc": ..., key: value}),
    its stderr, its exit status."""

    lines: list[dict[str, object]]
    stderr: str
    returncode: int
    stderr_lines: list[str] = field(default_factory=list)

    def of(self, cmd: str) -> list[dict[str, object]]:
        return [line for line in self.lines if line["cmd"] == cmd]

    def rcs(self, cmd: str) -> list[object]:
        return [line["rc"] for line in self.of(cmd)]


def parse_line(text: str) -> dict[str, object]:
    cmd, *pairs = text.split()
    out: dict[str, object] = {"cmd": cmd}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def shim_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("mpsshim[")]


@dataclass
class ShimEnv:
    """Builds the environment and command line of a client run."""

    shim: Path
    fake: Path
    clients: dict[str, Path]
    tmp: Path

    def env(self, limit: str | None, extra: dict[str, str] | None = None, preload: bool = True) -> dict[str, str]:
        nvml_conf = self.tmp / "nvml.conf"
        if not nvml_conf.exists():
            nvml_conf.write_text(NVML_CONFIG)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LD_LIBRARY_PATH": str(self.fake),
            "FAKE_CUDA_DEVICES": "16G,8G",
            "FAKE_NVML_CONFIG": str(nvml_conf),
            "MPSSHIM_REGION": str(self.tmp / "test.region"),
        }
        if preload:
            env["LD_PRELOAD"] = str(self.shim)
        if limit is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = limit
        env.update(extra or {})
        return env

    def argv(self, mode: str, cmds: Sequence[object], version: int = 12000, flags: int = 0) -> list[str]:
        return [str(self.clients[mode]), mode, str(version), str(flags), *map(str, cmds)]

    def run(
        self,
        mode: str,
        cmds: Sequence[object],
        limit: str | None = None,
        version: int = 12000,
        flags: int = 0,
        extra: dict[str, str] | None = None,
        preload: bool = True,
    ) -> Result:
        proc = subprocess.run(
            self.argv(mode, cmds, version, flags),
            env=self.env(limit, extra, preload),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        lines = [parse_line(t) for t in proc.stdout.splitlines() if t.strip()]
        return Result(lines, proc.stderr, proc.returncode, shim_lines(proc.stderr))


@pytest.fixture
def shim(shim_lib: Path, fake_dir: Path, clients: dict[str, Path], tmp_path: Path) -> ShimEnv:
    return ShimEnv(shim_lib, fake_dir, clients, tmp_path)
