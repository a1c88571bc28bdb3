"""How .ci/run fits the real cluster's tier in: its components build in the background while the
rest of the suite runs (scripts/cluster/build.sh, one build per cache behind a lock), and the tier
runs last (tests/conftest.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.conftest import pytest_collection_modifyitems

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "cluster" / "build.sh"


def _versions() -> dict[str, str]:
    out = subprocess.run(["bash", "-c", f"set -a && . {REPO / 'scripts/cluster/versions.sh'} && env"],
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "_VERSION=" in line)


def _built_cache(cache: Path) -> None:
    """A cache in which every component is already built: build.sh then fetches and builds nothing."""
    v = _versions()
    for src in (f"kubernetes-{v['K8S_VERSION']}", f"containerd-{v['CONTAINERD_VERSION']}",
                f"cni-{v['CNI_VERSION']}", f"cri-tools-{v['CRICTL_VERSION']}"):
        (cache / "src" / src).mkdir(parents=True)
        (cache / "src" / src / ".ready").touch()
    rt = subprocess.run(["sha256sum", str(REPO / "scripts/cluster/cdi-runtime/main.go")],
                        capture_output=True, text=True, check=True).stdout[:12]
    for name in (f"etcd-{v['ETCD_VERSION']}", f"kubernetes-{v['K8S_VERSION']}", f"containerd-{v['CONTAINERD_VERSION']}",
                 f"nvidia-cdi-runtime-{rt}", f"cni-{v['CNI_VERSION']}", f"crictl-{v['CRICTL_VERSION']}"):
        (cache / "bin" / name).mkdir(parents=True)
        (cache / "bin" / name / ".done").write_text("1\n")


def _build(cache: Path, wait: int) -> subprocess.Popen[str]:
    env = {**os.environ, "MPSD_CLUSTER_CACHE": str(cache), "MPSD_CLUSTER_BUILD_WAIT": str(wait)}
    return subprocess.Popen([str(BUILD)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    if subprocess.run(["bash", "-c", "command -v go"], capture_output=True).returncode != 0:
        pytest.skip("build.sh checks for go first; not on PATH here")
    _built_cache(tmp_path / "cache")
    return tmp_path / "cache"


def test_a_built_cache_builds_nothing_and_names_every_component(cache: Path) -> None:
    proc = _build(cache, wait=5)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    names = {line.split()[0] for line in out.splitlines()}
    assert names == {"etcd", "kubernetes", "containerd", "nvidia-cdi-runtime", "cni", "crictl"}
    assert "building" not in err


def _waiting_in_flock(proc: subprocess.Popen[str], timeout: float = 120) -> bool:
    """True once build.sh (proc) waits in `flock -w` for the lock, False if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(child.cmdline()[:2] == ["flock", "-w"] for child in _children(proc.pid)):
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_a_second_build_waits_for_the_first_and_then_finds_it_done(cache: Path) -> None:
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = _build(cache, wait=600)
        assert _waiting_in_flock(proc), f"build.sh did not wait for the build holding the lock: {proc.communicate()}"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "waiting for the build already running" in err
    assert "kubernetes " in out


def test_a_build_held_past_the_bound_is_one_line_naming_the_lock(cache: Path) -> None:
    with open(cache / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = _build(cache, wait=1)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert out == ""
    assert err.strip().splitlines()[-1] == f"build.sh: another build held {cache}/.build.lock for 1 s"


def test_the_cluster_tier_runs_last_and_keeps_its_order() -> None:
    def item(path: str) -> SimpleNamespace:
        return SimpleNamespace(path=REPO / path, name=path)

    items = [item("tests/alloc/test_a.py"), item("tests/cluster/test_dra.py"), item("tests/cluster/test_upgrade.py"),
             item("tests/dra/test_b.py"), item("tests/cluster_notes/test_c.py"), item("tests/zz/test_d.py")]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["tests/alloc/test_a.py", "tests/dra/test_b.py", "tests/cluster_notes/test_c.py",
                                       "tests/zz/test_d.py", "tests/cluster/test_dra.py", "tests/cluster/test_upgrade.py"]


def test_ci_enables_the_tier_and_starts_the_build_before_the_suite() -> None:
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert "export MPSD_CLUSTER=1" in lines
    build = next(i for i, line in enumerate(lines) if "scripts/cluster/build.sh" in line)
    suite = next(i for i, line in enumerate(lines) if "scripts/test.sh" in line)
    assert build < suite and lines[build].endswith("&"), "the build must run in the background, before the suite"
