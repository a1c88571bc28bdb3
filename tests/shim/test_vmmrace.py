"""Threads racing on one cuMemCreate handle (release against unmap, retains and releases against
unmap, release against map, a racing double release): the charge follows the driver's own
lifetime of the memory, so the region never counts less than the driver holds (no early
uncharge) and returns to exactly 0 (no leak). The fake driver frees a handle's memory by the real
rule (no reference left: cuMemCreate's, one per cuMemRetainAllocationHandle, less one per
cuMemRelease; and no mapping), yields the CPU inside each VMM call (FAKE_CUDA_VMM_YIELD) so that
the threads meet often, and lets the program compare the region with it just before each call
acts. Also run with the shim built with ASan+UBSan and with TSan."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.shim.conftest import CSRC, HERE, ShimEnv

SAN_FLAGS = "-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all"
ROUNDS = 1000


@pytest.fixture(scope="module")
def vmmrace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = tmp_path_factory.mktemp("vmmrace") / "vmmrace"
    cmd = ["cc", "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", str(HERE / "vmmrace.c")]
    # -rdynamic: the fake driver calls the program's fakecuda_vmm_probe inside each VMM call
    subprocess.run([*cmd, "-rdynamic", "-o", str(exe), "-ldl", "-lpthread"], check=True)
    return exe


def runtime(name: str) -> Path:
    out = subprocess.run(["cc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout
    path = Path(out.strip())
    if not path.is_absolute() or not path.exists():
        pytest.skip(f"the C compiler has no {name}")
    return path


@pytest.fixture(scope="module")
def sanitized_shims(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """LD_PRELOAD for the shim built with ASan+UBSan, and with TSan (runtime first)."""
    asan, tsan = runtime("libasan.so"), runtime("libtsan.so")
    out = tmp_path_factory.mktemp("vmmsan")
    san = out / "libmpsshim.so"
    subprocess.run(["make", "-s", "-C", str(CSRC), f"OUT={san}", f"CFLAGS={SAN_FLAGS}", "lib"], check=True)
    subprocess.run(["make", "-s", "-C", str(CSRC), f"OUT={san}", "tsan"], check=True)
    return {"asan": f"{asan} {san}", "tsan": f"{tsan} {out / 'libmpsshim_tsan.so'}"}


def race(shim: ShimEnv, exe: Path, mode: str, threads: int, rounds: int, extra: dict[str, str] | None = None):
    env = shim.env("0=1G", {"MPSSHIM_LOG": "0", "FAKE_CUDA_VMM_YIELD": "3", **(extra or {})})
    proc = subprocess.run(
        [str(exe), mode, str(threads), str(rounds), "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    got = {k: int(v) for k, v in (f.split("=") for f in proc.stdout.split()[1:])}
    assert got["samples"] > 0
    # rounds where the region and the driver disagreed after the race (mid) and after cleaning
    # up (end), samples with the region below the driver (an early uncharge), what is left
    assert {k: got[k] for k in ("mid", "end", "premature", "driver_used", "region_used")} == {
        "mid": 0,
        "end": 0,
        "premature": 0,
        "driver_used": 0,
        "region_used": 0,
    }
    return got


def test_release_racing_unmap(shim: ShimEnv, vmmrace: Path) -> None:
    got = race(shim, vmmrace, "release-unmap", 2, ROUNDS)
    assert (got["ok"], got["failed"]) == (2 * ROUNDS, 0)


@pytest.mark.parametrize("threads", [3, 5])
def test_retains_and_releases_racing_unmap(shim: ShimEnv, vmmrace: Path, threads: int) -> None:
    got = race(shim, vmmrace, "retain-release", threads, ROUNDS)
    assert got["ok"] >= ROUNDS and got["failed"] == 0  # every unmap, and the release of every retain


def test_release_racing_map(shim: ShimEnv, vmmrace: Path) -> None:
    got = race(shim, vmmrace, "release-map", 2, ROUNDS)
    assert got["ok"] >= ROUNDS  # every release; the map when it came first


@pytest.mark.parametrize("threads", [2, 4])
def test_racing_double_release(shim: ShimEnv, vmmrace: Path, threads: int) -> None:
    got = race(shim, vmmrace, "release-release", threads, ROUNDS)
    assert (got["ok"], got["failed"]) == (ROUNDS, ROUNDS * (threads - 1))


@pytest.mark.parametrize("build", ["asan", "tsan"])
@pytest.mark.parametrize("mode", ["release-unmap", "retain-release", "release-map", "release-release"])
def test_races_run_clean_under_sanitizers(
    shim: ShimEnv, vmmrace: Path, sanitized_shims: dict[str, str], build: str, mode: str
) -> None:
    extra = {
        "LD_PRELOAD": sanitized_shims[build],
        "ASAN_OPTIONS": "detect_leaks=0:exitcode=86",
        "UBSAN_OPTIONS": "print_stacktrace=1:exitcode=87",
        "TSAN_OPTIONS": "halt_on_error=1:exitcode=66",
    }
    race(shim, vmmrace, mode, 3, 200, extra)
