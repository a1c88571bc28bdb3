"""The C code under a static analyser and the compiler's warnings, as the suite's gate: cppcheck
(Debian's package; scripts/test.sh installs it) finds nothing in csrc/ with every check on, nor
a warning in the tests' own C; and the library's build turns any warning into a failure
(-Wall -Wextra -Werror in csrc/Makefile). Each gate is shown to fail on a planted defect."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
TEST_C = [REPO / "tests" / d for d in ("fakes", "shim", "core", "e2e", "supervisor")]
# The one configuration the library is built for (x86-64 Linux, glibc, GCC's extensions); the
# aarch64 stub is the same code behind another #if.
DEFINES = ["-D_GNU_SOURCE", "-D__linux__", "-D__x86_64__", "-D__GNUC__"]
# unusedFunction: the exported hooks are called by the programs the library is preloaded into;
# missingIncludeSystem: the system headers are the compiler's, not given to cppcheck.
LIBRARY_CHECKS = ["--enable=all", "--suppress=unusedFunction", "--suppress=missingIncludeSystem"]
# The tests' C: real defects only (their raise(SIGBUS) calls return, which cppcheck doubts).
TEST_CHECKS = ["--enable=warning,performance,portability"]
PLANTED = (
    "#include <string.h>\nint ms_planted(int i);\nint ms_planted(int i) { char b[4]; memset(b, 0, 8); return b[i]; }\n"
)


def cppcheck(checks: list[str], *paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("cppcheck")
    if exe is None:
        pytest.fail("cppcheck not on PATH: install Debian's cppcheck package (scripts/test.sh does)")
    argv = [exe, "--quiet", "--std=c11", "--platform=unix64", *DEFINES, f"-I{CSRC}", *checks, "--inline-suppr",
            "--error-exitcode=1", "--template={file}:{line}: {severity} ({id}): {message}", *map(str, paths)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)


def findings(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def test_cppcheck_finds_nothing_in_the_library() -> None:
    proc = cppcheck(LIBRARY_CHECKS, CSRC)
    assert (proc.returncode, findings(proc)) == (0, [])


def test_cppcheck_finds_no_defect_in_the_tests_c() -> None:
    proc = cppcheck(TEST_CHECKS, *TEST_C)
    assert (proc.returncode, findings(proc)) == (0, [])


def test_the_analyser_gate_fails_on_a_planted_defect(tmp_path: Path) -> None:
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree, ignore=shutil.ignore_patterns("build"))
    (tree / "planted.c").write_text(PLANTED)
    proc = cppcheck(LIBRARY_CHECKS, tree)
    assert proc.returncode == 1
    assert any("planted.c:3" in line and "out of bounds" in line for line in findings(proc)), findings(proc)


def test_the_library_build_fails_on_any_warning(tmp_path: Path) -> None:
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree, ignore=shutil.ignore_patterns("build"))
    out = tmp_path / "libmpsshim.so"
    clean = subprocess.run(["make", "-s", "-C", str(tree), f"OUT={out}", "lib"], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr  # the library as it is: no warning
    (tree / "planted.c").write_text("int ms_planted(void);\nint ms_planted(void) { int unused; return 0; }\n")
    proc = subprocess.run(["make", "-s", "-C", str(tree), f"OUT={out}", "lib"], capture_output=True, text=True)
    assert proc.returncode != 0 and "-Werror=unused-variable" in proc.stderr, proc.stderr
