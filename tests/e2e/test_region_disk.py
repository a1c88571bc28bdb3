"""A region on a full filesystem (issue 7): the file is preallocated before it is published, so
new clients of an existing region never die of SIGBUS once the disk fills, and a region that
cannot be created on a full disk is refused with one line. Real tmpfs, real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

M = 1 << 20
CLIENT = """
import sys
from tests.e2e.cudrv import Driver, emit, attempt
d = Driver(); d.init(); p = attempt(d.alloc, 1 << 20)
emit(alloc=p)
sys.stdout.flush()
sys.stdin.read()
"""


def _mount(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {proc.stderr.strip()}")


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A small filesystem mounted for the test: a tmpfs, or ext4 on a loop device (where, unlike
    tmpfs, reading a hole of a shared mapping allocates nothing: a sparse region's untouched
    pages first need space when a new client writes its slot)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if request.param == "tmpfs":
        _mount(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)])
    else:
        image = tmp_path / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(16 * M)
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("no mkfs.ext4 here (scripts/test.sh installs e2fsprogs)")
        mkfs = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True, check=False
        )
        if mkfs.returncode != 0:
            pytest.skip(f"no mkfs.ext4 here: {mkfs.stderr.strip()}")
        _mount(["mount", "-o", "loop", str(image), str(mnt)])
        os.chmod(mnt, 0o1777)
        (mnt / "lost+found").rmdir()
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (65536, 1):  # big writes, then the last partial page
            try:
                while os.write(fd, b"\xff" * chunk) > 0:
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)


def spawn(env: dict[str, str]) -> subprocess.Popen[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
    full.update(env, PYTHONPATH=str(REPO), MPSSHIM_LOG="warn")
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT], env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def test_new_clients_of_a_region_on_a_full_disk_never_die_of_sigbus(shim_env, small_fs: Path) -> None:
    region = small_fs / "region"
    env = shim_env(limit=f"0={512 * M}", region=region)
    first = spawn(env)
    clients: list[subprocess.Popen[str]] = []
    try:
        assert first.stdout is not None and '"alloc"' in first.stdout.readline()
        fill(small_fs)
        clients = [spawn(env) for _ in range(12)]
        for c in clients:
            assert c.stdout is not None
            c.stdout.readline()
    finally:
        for c in [first, *clients]:
            if c.poll() is None:
                c.communicate(input="", timeout=30)
    died = [c.returncode for c in clients if c.returncode != 0]
    assert died == [], f"{len(died)} of 12 new clients died: {died} (-{int(signal.SIGBUS)} is SIGBUS)"
    assert first.returncode == 0


def test_a_region_that_cannot_be_preallocated_is_refused_with_one_line(shim_env, run_py, small_fs: Path) -> None:
    fill(small_fs)
    region = small_fs / "new.region"
    env = shim_env(limit=f"0={512 * M}", region=region)
    r = run_py("d = Driver(); d.init(); emit(alloc=attempt(d.alloc, 1 << 20))", env)
    assert r.one == {"alloc": {"error": 2}}  # refused, never uncapped
    lines = [line for line in r.stderr.splitlines() if line.startswith("mpsshim[")]
    assert len(lines) == 1, r.stderr
    assert str(region) in lines[0] and "No space left on device" in lines[0]
    assert not region.exists() and [p.name for p in small_fs.iterdir()] == ["filler"]  # nothing half-made left


def test_a_sparse_region_someone_else_made_is_refused_on_a_full_disk(shim_env, run_py, tmp_path, small_fs) -> None:
    """A region file with holes (written by another tool, or copied sparsely): a client allocates
    its blocks before mapping it, so on a full disk it refuses with one line instead of dying of
    SIGBUS when it first writes its slot."""
    made = tmp_path / "made.region"
    env = shim_env(limit=f"0={512 * M}", region=made)
    assert run_py("d = Driver(); d.init(); emit(alloc=attempt(d.alloc, 1 << 20) > 0)", env).one == {"alloc": True}
    data = made.read_bytes()
    region = small_fs / "region"
    with open(region, "wb") as f:  # the header, then holes (zeros: free slots)
        f.truncate(len(data))
        f.write(data[:4096])
    fill(small_fs)
    env = shim_env(limit=f"0={512 * M}", region=region)
    for _ in range(3):
        r = run_py("d = Driver(); d.init(); emit(alloc=attempt(d.alloc, 1 << 20))", env)
        assert r.one == {"alloc": {"error": 2}}
        lines = [line for line in r.stderr.splitlines() if line.startswith("mpsshim[")]
        assert len(lines) == 1 and "No space left on device" in lines[0] and str(region) in lines[0], r.stderr
