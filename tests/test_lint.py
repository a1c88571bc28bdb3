"""The linter and the type checker pass on the whole tree, as configured in pyproject.toml
([tool.ruff], [tool.mypy]): a finding fails the suite (and so .ci/run), with its lines in the
failure. Both come with the test extras."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)


def test_ruff_finds_nothing() -> None:
    done = run("ruff", "check", "--output-format", "concise", "--no-cache", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    done = run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layers_contract_is_kept() -> None:
    """pyproject.toml's [tool.importlinter]: no import from a package to one above it
    (docs/architecture.md); a new arrow up fails here, naming the chain."""
    done = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout, done.stdout


def import_cycles(package: str) -> list[list[str]]:
    """Strongly connected groups of more than one module in ``package``'s import graph (grimp,
    which import-linter uses: every import statement, those under TYPE_CHECKING and inside
    functions too)."""
    import grimp

    graph = grimp.build_graph(package)
    modules = sorted(graph.modules)
    edges = {m: sorted(set(graph.find_modules_directly_imported_by(m)) & graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert import_cycles("mpsd") == []


def test_an_import_circle_is_found(tmp_path: Path, monkeypatch) -> None:
    """The cycle finder above is not vacuous: two modules importing each other are one group."""
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circled") == [["circled.a", "circled.b"]]


GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def test_no_hand_written_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "mpsd").rglob("*.py"))
            if not p.name.endswith(GENERATED) and (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_the_top_of_the_package_stays_small_and_every_package_says_what_it_owns() -> None:
    top = sorted(p.name for p in (ROOT / "mpsd").glob("*.py"))
    assert len(top) <= 12, top
    for init in sorted((ROOT / "mpsd").glob("*/__init__.py")):
        text = init.read_text()
        assert text.startswith('"""') and len(text.split('"""')[1].split()) >= 20, f"{init}: no docstring"
