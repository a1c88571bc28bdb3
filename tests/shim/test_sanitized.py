"""The shim built with AddressSanitizer and UndefinedBehaviorSanitizer runs the main
scenarios on every path without a report (the sanitizer runtime is preloaded first)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.shim.conftest import CSRC, G, M, ShimEnv

SAN_FLAGS = "-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all"


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    asan = Path(
        subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout.strip()
    )
    if not asan.is_absolute() or not asan.exists():
        pytest.skip("the C compiler has no AddressSanitizer runtime")
    out = tmp_path_factory.mktemp("san") / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(CSRC), f"OUT={out}", f"CFLAGS={SAN_FLAGS}", "lib"], check=True)
    return asan, out


SCRIPT = [
    "init",
    "ctx",
    0,
    "alloc",
    768 * M,
    "alloc",
    512 * M,
    "info",
    "total",
    0,
    "free",
    "pitch",
    1000,
    4096,
    "managed",
    M,
    "async",
    M,
    "pool",
    M,
    "create",
    0,
    M,
    "free",
    "free",
    "free",
    "free",
    "free",
    "usage",
    0,
    "nvmem",
    0,
    "nvmem2",
    0,
    "hammer",
    4,
    500,
    256 * M,
    G,
    "used",
    0,
]


@pytest.mark.parametrize("mode", ["link", "dlsym", "gpa", "gpa2"])
@pytest.mark.parametrize("limit", ["0=1G", "GPU-face0000-0000-0000-0000-000000000000=1G", "0=junk"])
def test_main_scenarios_run_clean_under_sanitizers(
    shim: ShimEnv, sanitized: tuple[Path, Path], mode: str, limit: str
) -> None:
    asan, lib = sanitized
    env = shim.env(
        limit,
        {
            "LD_PRELOAD": f"{asan} {lib}",
            "ASAN_OPTIONS": "detect_leaks=0:exitcode=86",
            "UBSAN_OPTIONS": "print_stacktrace=1:exitcode=87",
            "MPSSHIM_LOG": "3",
        },
    )
    proc = subprocess.run(shim.argv(mode, SCRIPT), env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr
    if limit != "0=junk":
        assert "alloc rc=2" in proc.stdout and "used rc=0 bytes=0" in proc.stdout


def test_a_region_truncated_under_a_sanitized_client_ends_in_a_refusal(
    shim: ShimEnv, sanitized: tuple[Path, Path]
) -> None:
    # AddressSanitizer installs a SIGBUS handler of its own at start: the guard (installed
    # later) takes the region's fault and chains every other one to it
    asan, lib = sanitized
    env = shim.env("0=1G", {"LD_PRELOAD": f"{asan} {lib}", "ASAN_OPTIONS": "detect_leaks=0:exitcode=86"})
    cmds = ["init", "ctx", 0, "alloc", M, "pause", "alloc", M, "free", "ownbus", 0]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(shim.argv("gpa2", cmds), env=env, text=True, **pipes) as proc:
        assert proc.stdout is not None
        while (line := proc.stdout.readline().strip()) != "pause rc=0":
            assert line, proc.wait(timeout=30)
        os.truncate(shim.tmp / "test.region", 4096)
        out, err = proc.communicate("go\n", timeout=120)
    assert out.splitlines()[:2] == ["alloc rc=2", "free rc=0"], err[-2000:]
    assert "corrupted" in err
    # the application's own fault after that is ASan's to report, as without the shim
    assert "ownbus rc=" not in out
    assert "AddressSanitizer: BUS" in err and proc.returncode == 86, (proc.returncode, err[-2000:])
