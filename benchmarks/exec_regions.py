"""One round of `mpsd run`'s reader of `mpsd exec` regions (mpsd.metrics.regions.ExecRegions) over
regions of the wrong size: what a local user's oversized files cost each metrics round.

    .venv/bin/python benchmarks/exec_regions.py [--files 40] [--size 64M] [--library PATH]

``--files`` directories, each with a sparse ``region`` of ``--size`` bytes (no disk used), in a
temporary directory under $TMPDIR; prints the seconds the round took and the bytes this process
read (/proc/self/io rchar). ``--library``: the libmpsshim.so to read through (default: the
shim package's).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time

from mpsd.metrics.regions import ExecRegions
from mpsd.units import parse_size


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--size", default="64M")
    parser.add_argument("--library", default="")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # one refusal line per file: not what is measured
    import shim

    library = args.library or str(shim.library_path())
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="exec-regions-")
    try:
        for k in range(args.files):
            os.mkdir(os.path.join(root, f"r{k}"))
            with open(os.path.join(root, f"r{k}", "region"), "wb") as f:
                f.truncate(size)
        read, start = bytes_read(), time.monotonic()
        rows = ExecRegions(root, lambda: library)()
        elapsed, read = time.monotonic() - start, bytes_read() - read
    finally:
        shutil.rmtree(root)
    print(f"files={args.files} size={size} rows={len(rows)} seconds={elapsed:.2f} bytes_read={read}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
