"""An mpsd upgrade under running containers, for real: the layout-2 shim (csrc as on main
before reserves, archived in tests/shim/legacy/csrc-layout2.tar.gz, built here) installed as the
old mpsd installed it, a container process holding memory in its region, then this mpsd's
install of this shim into the same shimHostDir, then a new process of the same container. It
must initialise and share the cap exactly with the old one, and mpsd must read the region
(docs/shim.md, "Upgrades"; mpsd/alloc/shimfile.py)."""

from __future__ import annotations

import os
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import shim as shimpkg
from mpsd.alloc.container import container_env
from mpsd.alloc.shimfile import CONTAINER_SHIM_DIR, LEGACY_SHIM_NAME, SHIM_LAYOUT, SHIM_NAME, install_shim
from mpsd.alloc.slicing import GpuShare, Plan
from mpsd.alloc.state import install_file
from mpsd.alloc.usage import shim_usage

from .conftest import G, ShimEnv, parse_line

LEGACY = Path(__file__).resolve().parent / "legacy" / "csrc-layout2.tar.gz"


@pytest.fixture(scope="module")
def old_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libmpsshim.so built from the archived layout-2 sources."""
    out = tmp_path_factory.mktemp("oldshim")
    with tarfile.open(LEGACY) as tar:
        tar.extractall(out, filter="data")
    lib = out / "libmpsshim.so"
    proc = subprocess.run(["nice", "-n", "19", "make", "-s", "-C", str(out / "csrc-layout2" / "csrc"), f"OUT={lib}",
                           "lib"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return lib


@contextmanager
def holding(shim: ShimEnv, env: dict[str, str], cmds: list[object]) -> Iterator[subprocess.Popen[str]]:
    """A container process that runs ``cmds`` then pauses (holding what it allocated) until the
    block ends, then frees its allocations; its output lines up to the pause are checked by the
    caller."""
    frees = ["free"] * sum(1 for c in cmds if c == "alloc")
    proc = subprocess.Popen(shim.argv("gpa2", [*cmds, "pause", *frees]), env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        lines = []
        while not lines or lines[-1]["cmd"] != "pause":
            text = proc.stdout.readline()
            assert text, f"process ended early: {lines} {proc.stderr.read() if proc.stderr else ''}"
            lines.append(parse_line(text))
        proc.lines = lines  # type: ignore[attr-defined]
        yield proc
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def container(shim: ShimEnv, host_dir: Path, preload: str, region: Path) -> dict[str, str]:
    """A container's environment: LD_PRELOAD names the file in the shim directory mount (here
    the host directory itself), as the allocation's env named it."""
    assert preload.startswith(CONTAINER_SHIM_DIR + "/")
    return shim.env("0=3G", {"LD_PRELOAD": str(host_dir / os.path.basename(preload)), "MPSSHIM_REGION": str(region)})


def test_the_library_names_the_layout_mpsd_installs_it_as(shim_lib: Path) -> None:
    assert shimpkg.layout(shim_lib) == SHIM_LAYOUT and SHIM_NAME == f"libmpsshim.so.{SHIM_LAYOUT}"


def test_a_container_started_before_an_upgrade_keeps_one_exact_cap(shim: ShimEnv, shim_lib: Path,
                                                                   old_shim: Path) -> None:
    host_dir, region = shim.tmp / "lib", shim.tmp / "alloc" / "region"
    region.parent.mkdir()
    install_file(str(old_shim), str(host_dir), LEGACY_SHIM_NAME)  # as mpsd installed it before layouts
    old_env = container(shim, host_dir, f"{CONTAINER_SHIM_DIR}/{LEGACY_SHIM_NAME}", region)
    with holding(shim, old_env, ["init", "ctx", 0, "alloc", G]) as old:
        assert [line["rc"] for line in old.lines] == [0, 0, 0, 0]  # type: ignore[attr-defined]
        assert region.read_bytes()[8:12] == (2).to_bytes(4, "little")  # the old shim's layout

        install_shim(str(shim_lib), str(host_dir))  # the upgrade: this mpsd's install
        assert (host_dir / LEGACY_SHIM_NAME).read_bytes() == old_shim.read_bytes()

        # a new process of the old container: same LD_PRELOAD, same region, the old one running
        with holding(shim, old_env, ["init", "ctx", 0, "alloc", G, "alloc", G]) as new:
            assert [line["rc"] for line in new.lines] == [0, 0, 0, 0, 0]  # type: ignore[attr-defined]
            late = shim.run("gpa2", ["init", "ctx", 0, "alloc", 1 << 20, "usage", 0], extra=old_env)
            assert late.rcs("init") == [0] and late.rcs("alloc") == [2]  # 3 GiB held of 3: exact
            assert late.of("usage")[0]["used"] == 3 * G
            # mpsd's reader (this shim's library) reads the layout-2 region
            assert shim_usage(str(region), library=str(shim_lib)) == {0: 3 * G}
            held = {p.pid: p.used for d in shimpkg.usage(region, library=shim_lib) for p in d.processes}
            assert held == {old.pid: G, new.pid: 2 * G}
        assert shim_usage(str(region), library=str(shim_lib)) == {0: G}
    assert shim_usage(str(region), library=str(shim_lib)) == {0: 0}  # both gone, everything given back

    # a container allocated after the upgrade preloads the new file and gets a layout-3 region
    plan = Plan(("gpu-0",), (GpuShare(0, 0, "GPU-x", (0,), 3 * G),), 100.0)
    new_preload = container_env(plan, "/pipe")["LD_PRELOAD"]
    assert new_preload == f"{CONTAINER_SHIM_DIR}/{SHIM_NAME}"
    region3 = shim.tmp / "alloc3" / "region"
    region3.parent.mkdir()
    new_env = container(shim, host_dir, new_preload, region3)
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", 2 * G, "alloc", 2 * G, "usage", 0], extra=new_env)
    assert r.rcs("alloc") == [0, 2] and r.of("usage")[0]["used"] == 2 * G
    assert region3.read_bytes()[8:12] == (SHIM_LAYOUT).to_bytes(4, "little")


def test_reinstalling_replaces_the_file_by_rename_never_in_place(shim: ShimEnv, shim_lib: Path) -> None:
    host_dir, region = shim.tmp / "lib", shim.tmp / "region"
    dest = Path(install_shim(str(shim_lib), str(host_dir)))
    env = container(shim, host_dir, f"{CONTAINER_SHIM_DIR}/{SHIM_NAME}", region)
    with holding(shim, env, ["init", "ctx", 0, "alloc", G]) as proc:
        before = os.stat(dest)
        kept = os.open(dest, os.O_RDONLY)  # the inode the running process has mapped
        try:
            install_shim(str(shim_lib), str(host_dir))  # an upgrade to another build of this layout
            assert os.stat(dest).st_ino != before.st_ino
            assert os.fstat(kept).st_size == before.st_size
            assert os.pread(kept, before.st_size, 0) == shim_lib.read_bytes()
        finally:
            os.close(kept)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert f" {before.st_ino} " in maps and str(dest) in maps
    assert sorted(os.listdir(host_dir)) == [SHIM_NAME]  # no temporary left behind
