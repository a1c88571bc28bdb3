"""deploy/Containerfile, checked statically (no container engine here): stages, the files it
copies exist in the build context, it runs as root with mpsd as the entrypoint, and its
glibc-floor check really rejects a library that needs glibc 2.34."""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import REPO

CONTAINERFILE = REPO / "deploy/Containerfile"
IGNORE = REPO / "deploy/Containerfile.dockerignore"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        full = (pending + line.strip()).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


STEPS = instructions(CONTAINERFILE.read_text())


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for step in STEPS:
        if step[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(step)
    return result


def build_args() -> dict[str, str]:
    return dict(a.split("=", 1) for w, a in STEPS if w == "ARG" and "=" in a)


def test_instruction_parser_joins_continuations() -> None:
    text = "# c\nFROM a AS b\nRUN x \\\n && y\n\nUSER 0\n"
    assert instructions(text) == [("FROM", "a AS b"), ("RUN", "x && y"), ("USER", "0")]


def test_two_stages_from_pinned_images() -> None:
    args = build_args()
    froms = [a for w, a in STEPS if w == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    for image in (f.split()[0] for f in froms):
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert ":" in image.rsplit("/", 1)[-1] or "manylinux" in image, f"unpinned base image {image}"
        assert not image.endswith(":latest")
    # The build stage's glibc is the floor the shim promises (manylinux_2_28 → 2.28).
    assert "manylinux_2_28" in args["BUILD_IMAGE"]


def test_copied_sources_exist_and_are_in_the_build_context() -> None:
    ignore = [line.strip() for line in IGNORE.read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    copies = [a for w, a in STEPS if w == "COPY" and not a.startswith("--from=")]
    assert copies
    for args in copies:
        *sources, _dest = args.split()
        for src in sources:
            path = REPO / src
            assert path.exists(), f"COPY {src}: not in the repository"
            assert included(src.rstrip("/"), ignore), f"COPY {src}: excluded by {IGNORE.name}"
    for unwanted in (".venv", ".cache", "shim/libmpsshim.so", "mpsd/__pycache__/x.pyc"):
        assert not included(unwanted, ignore), unwanted


def included(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also matches below a dir."""
    keep = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pat == "**" or any(fnmatch.fnmatch(p, pat.replace("**/", "*/").replace("**", "*"))
                              or fnmatch.fnmatch(p.rsplit("/", 1)[-1], pat.removeprefix("**/"))
                              and pat.startswith("**/") for p in prefixes):
            keep = negate
    return keep


def test_the_wheel_is_built_and_installed() -> None:
    build, runtime = stages()
    assert any(w == "RUN" and "pip wheel" in a and a.rstrip().endswith(" .") for w, a in build)
    assert ("COPY", "--from=build /wheels /tmp/wheels") in runtime
    assert any(w == "RUN" and "pip install" in a and "--no-index" in a and " mpsd" in a for w, a in runtime)


def test_runs_as_root_with_mpsd_as_entrypoint() -> None:
    runtime = stages()[-1]
    users = [a for w, a in runtime if w == "USER"]
    assert users[-1] in {"0", "root", "0:0"}
    (entrypoint,) = [json.loads(a) for w, a in runtime if w == "ENTRYPOINT"]
    assert entrypoint == ["mpsd"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "mpsd" in scripts
    (cmd,) = [json.loads(a) for w, a in runtime if w == "CMD"]
    assert cmd == ["run", "--config", "/etc/mpsd/config.yaml"]


def test_exposed_port_is_the_metrics_port() -> None:
    cfg = yaml.safe_load((REPO / "deploy/base/config.yaml").read_text())
    (exposed,) = [a for w, a in stages()[-1] if w == "EXPOSE"]
    assert exposed == cfg["metricsAddress"].rpartition(":")[2]


def glibc_check_script() -> str:
    (run,) = [a for w, a in stages()[0] if w == "RUN" and "objdump" in a]
    return run.split("&&", 1)[1].strip()


@pytest.mark.skipif(not (shutil.which("cc") and shutil.which("objdump")), reason="needs cc and objdump")
def test_glibc_floor_check_rejects_glibc_2_34_symbols(tmp_path: Path) -> None:
    script = glibc_check_script().replace("/tmp/check/libmpsshim.so", "@LIB@")

    def check(source: str) -> int:
        (tmp_path / "t.c").write_text(source)
        lib = tmp_path / "t.so"
        subprocess.run(["cc", "-shared", "-fPIC", str(tmp_path / "t.c"), "-o", str(lib), "-ldl"], check=True)
        return subprocess.run(["sh", "-c", script.replace("@LIB@", str(lib))], capture_output=True,
                              timeout=60, check=False).returncode

    plain = "int f(int x){return x+1;}\n"
    assert check(plain) == 0
    ldd = subprocess.run(["ldd", "--version"], capture_output=True, text=True, check=False).stdout
    glibc = tuple(int(x) for x in re.search(r"(\d+)\.(\d+)\s*$", ldd.splitlines()[0]).groups())
    if glibc < (2, 34):
        pytest.skip(f"this machine's glibc {glibc} predates dlsym@GLIBC_2.34")
    dlsym = '#include <dlfcn.h>\nvoid *f(void){return dlsym(RTLD_NEXT, "x");}\n'
    assert check(dlsym) == 1
