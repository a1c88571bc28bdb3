"""docs/security.md names a test for every guarantee: each test file and test it names exists,
so the page cannot promise what nothing checks any more."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "security.md"
REF = re.compile(r"`(tests/[\w/]+\.py)(?:::(test_\w+))?`|`::(test_\w+)`")


def references() -> list[tuple[str, str | None]]:
    """(file, test or None) for every reference; a bare `::name` refers to the file named last."""
    refs: list[tuple[str, str | None]] = []
    for line in DOC.read_text().splitlines():
        last = None
        for m in REF.finditer(line):
            if m.group(1):
                last = m.group(1)
                refs.append((last, m.group(2)))
            else:
                assert last is not None, f"`::{m.group(3)}` with no file before it: {line}"
                refs.append((last, m.group(3)))
    return refs


def test_every_guarantee_row_names_a_test():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    guarantees = [r for r in rows if r.count("|") == 3 and not r.startswith("| guarantee")]
    assert len(guarantees) >= 25
    for row in guarantees:
        assert REF.search(row.rsplit("|", 2)[1]), f"no test named for: {row}"


def test_every_named_test_exists():
    refs = references()
    assert len(refs) >= 40
    for path, name in refs:
        source = (REPO / path).read_text()
        if name is not None:
            assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name}: named in docs/security.md, not defined"
