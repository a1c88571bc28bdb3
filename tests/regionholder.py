"""Processes that hold a region file, for tests of whoever reads one.

``hold`` starts tests/e2e/region_holder.c (built once per session by the ``holder_exe``
fixture of tests/conftest.py), which charges a region and keeps it until killed.
``reader_survives_truncation`` runs a reader beside a process that keeps shrinking and growing
the file under it, as a hostile pod or client can: a reader that maps the file dies of SIGBUS.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FLIPPER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
size = os.fstat(fd).st_size
print("flipping", flush=True)
while True:
    os.ftruncate(fd, 4096)
    os.ftruncate(fd, size)
"""


def build_holder(out_dir: Path) -> Path:
    """region_holder.c built against the region core (however csrc/ splits it) into OUT_DIR."""
    exe = out_dir / "region_holder"
    sources = [REPO / "tests/e2e/region_holder.c", *sorted((REPO / "csrc").glob("region*.c"))]
    flags = ["-std=gnu11", "-O2", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-I", str(REPO / "csrc")]
    subprocess.run(["cc", *flags, *map(str, sources), "-o", str(exe), "-lpthread"], check=True)
    return exe


def hold(exe: os.PathLike | str, region: os.PathLike | str | bytes, *charges: str) -> subprocess.Popen[str]:
    """A process that opened REGION (a path, bytes too: names need not be UTF-8) and charged
    each ``DEV:CAP:BYTES``; it holds them until killed."""
    proc = subprocess.Popen(
        [os.fspath(exe), os.fspath(region), *charges], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def read_loop(setup: str, read: str) -> str:
    """A READER for ``reader_survives_truncation``: SETUP (Python, with sys and time imported
    and ``region, lib = sys.argv[1:3]``), then READ in a loop for 8 s, where an exception
    counts as a read (a refusal is fine, a signal is not)."""
    return (
        f"import sys, time\n{setup}\nregion, lib = sys.argv[1], sys.argv[2]\n"
        "deadline, reads = time.monotonic() + 8, 0\nwhile time.monotonic() < deadline:\n"
        f"    try:\n        {read}\n    except Exception:\n        pass\n    reads += 1\nprint(reads)\n"
    )


def reader_survives_truncation(holder: subprocess.Popen[str], region: Path, reader: str, *args: str) -> None:
    """Run the Python program READER (ARGS after it; it prints how many reads it made) while
    REGION is truncated and grown again without pause; it must exit 0 after more than 100
    reads. HOLDER (the region's holder) is killed afterwards, like the flipper."""
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(region)], stdout=subprocess.PIPE, text=True)
    try:
        assert flipper.stdout.readline().strip() == "flipping"
        result = subprocess.run(
            [sys.executable, "-c", reader, *args], capture_output=True, text=True, timeout=120, cwd=str(REPO)
        )
        assert result.returncode == 0, f"reader died: rc={result.returncode} {result.stderr[-500:]}"
        assert int(result.stdout) > 100, result.stdout
    finally:
        for p in (flipper, holder):
            p.kill()
            p.wait()
