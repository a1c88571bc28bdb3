"""`python -m shim`: `path` prints where libmpsshim.so is; `usage REGION [--json]` shows a
region's accounting. Wiring only: the work is in _library and _usage."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from mpsd.errors import one_line, printable

from ._errors import ShimError
from ._library import library_path
from ._usage import DeviceUsage, usage


def human(nbytes: int) -> str:
    """1536 -> '1.5 KiB'; exact below 1 KiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(devices: Sequence[DeviceUsage]) -> str:
    """One line per device, then one indented line per process holding memory on it."""
    if not devices:
        return "no device has a cap or usage in this region\n"
    rows = [("DEVICE", "CAP", "USED", "FREE", "PROCESSES")]
    for d in devices:
        free = human(max(d.cap - d.used, 0)) if d.cap else "-"
        alive = sum(p.alive for p in d.processes)
        rows.append(
            (
                str(d.device),
                human(d.cap) if d.cap else "none",
                human(d.used),
                free,
                f"{len(d.processes)} ({alive} alive)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if i:
            for p in devices[i - 1].processes:
                lines.append(f"    pid {p.pid:<8} {'alive' if p.alive else 'dead '}  {human(p.used)}")
    return "".join(printable(line) + "\n" for line in lines)


def to_json(region: str, devices: Sequence[DeviceUsage]) -> str:
    return json.dumps({"region": region, "devices": [dataclasses.asdict(d) for d in devices]}, indent=2) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shim", description="The mpsd memory-cap shim (libmpsshim.so).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("path", help="print the path of libmpsshim.so (for LD_PRELOAD)")
    use = sub.add_parser("usage", help="show the accounting of a region file (a container's MPSSHIM_REGION)")
    use.add_argument("region", help="path of the region file")
    use.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "path":
            sys.stdout.write(f"{library_path()}\n")
        else:
            devices = usage(args.region)
            sys.stdout.write(to_json(args.region, devices) if args.json else format_table(devices))
    except ShimError as exc:
        sys.stderr.write(f"error: {one_line(exc)}\n")
        return 1
    return 0
