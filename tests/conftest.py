"""Session fixtures shared by the test suite.

- `fake_cuda_dir`: a directory holding every fake driver of tests/fakes (libcuda.so.1 and
  libnvidia-ml.so.1), built once per session; put it on LD_LIBRARY_PATH.
- `holder_exe`: tests/e2e/region_holder.c built against the region core (see tests/regionholder.py).
- `shim_lib`: libmpsshim.so freshly built from csrc/ into a session directory, so tests run the
  current sources (not a stale copy in shim/).
- `run_client(argv, env, timeout)`: run a client process with exactly the given extra
  environment, returning the CompletedProcess (text mode).
- `podman`: real containers (podman + runc, a busybox image), see tests/container.py.
- `shim_env(...)`: the environment a client under the shim needs (preload, fake driver,
  a private region file, limits).
- `mps_control`: the real nvidia-cuda-mps-control (tests/mpsbin.py) of `mps_version`. A test
  marked `every_mps_version` runs once per version MPSD_TEST_MPS_VERSIONS selects (CI: all);
  every other test gets the first selected version (default 535.261).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.container import Podman, podman_unavailable
from tests.fakes import build_fakes
from tests.mpsbin import DEFAULT_CACHE, FetchError, ensure_mps_control, selected_versions
from tests.regionholder import build_holder

REPO = Path(__file__).resolve().parent.parent
ClientRunner = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="session")
def fake_cuda_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fakes(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture(scope="session")
def holder_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_holder(tmp_path_factory.mktemp("holder"))


@pytest.fixture(scope="session")
def shim_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shimlib") / "libmpsshim.so"
    proc = subprocess.run(
        ["make", "-s", "-C", str(REPO / "csrc"), f"OUT={out}", "lib"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"building libmpsshim.so failed:\n{proc.stdout}{proc.stderr}")
    return out


def _run_client(
    argv: Sequence[str | os.PathLike[str]],
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    for key in ("LD_PRELOAD", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "MPSSHIM_REGION", "MPSSHIM_DISABLE"):
        full.pop(key, None)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env or {})
    proc = subprocess.run([str(a) for a in argv], env=full, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def run_client() -> ClientRunner:
    return _run_client


@pytest.fixture
def shim_env(fake_cuda_dir: Path, shim_lib: Path, tmp_path: Path) -> Callable[..., dict[str, str]]:
    """shim_env(limit=None, devices="16G", preload=True, region=<tmp>/region, **extra) -> env."""

    def make(
        limit: str | None = None,
        devices: str = "16G",
        preload: bool = True,
        region: Path | None = None,
        **extra: str,
    ) -> dict[str, str]:
        env = {
            "LD_LIBRARY_PATH": str(fake_cuda_dir),
            "FAKE_CUDA_DEVICES": devices,
            "MPSSHIM_REGION": str(region if region is not None else tmp_path / "region"),
        }
        if preload:
            env["LD_PRELOAD"] = str(shim_lib)
        if limit is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = limit
        env.update(extra)
        return env

    return make


PYTHON = sys.executable


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    """A private podman state for real containers (tests/container.py); skips only where podman
    cannot run, with the reason (a failure instead under MPSD_REQUIRE_CONTAINERS=1)."""
    box = Podman(Path(tempfile.mkdtemp(prefix="mpsd-podman-")))
    try:
        reason = podman_unavailable(box.state_dir)
        if reason:
            if os.environ.get("MPSD_REQUIRE_CONTAINERS") == "1":
                pytest.fail(f"MPSD_REQUIRE_CONTAINERS=1 but {reason}", pytrace=False)
            pytest.skip(reason)
        yield box
    finally:
        box.cleanup()


def _mps_versions() -> list[str]:
    try:
        return selected_versions()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    _mps_versions()  # a bad MPSD_TEST_MPS_VERSIONS stops the run before any test


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked every_mps_version take each selected real daemon version in turn."""
    if "mps_version" in metafunc.fixturenames and metafunc.definition.get_closest_marker("every_mps_version"):
        versions = _mps_versions()
        metafunc.parametrize("mps_version", versions, indirect=True, ids=[f"mps{v}" for v in versions])


@pytest.fixture(scope="session")
def mps_version(request: pytest.FixtureRequest) -> str:
    """The id (tests/mpsbin.py VERSIONS) of the real MPS daemon this test runs against."""
    return getattr(request, "param", _mps_versions()[0])


@pytest.fixture(scope="session")
def mps_control(mps_version: str) -> Path:
    """The real nvidia-cuda-mps-control of ``mps_version``. A failed fetch FAILS the test
    (CI has the network)."""
    try:
        return ensure_mps_control(Path(os.environ.get("MPSD_TEST_MPS_CACHE", DEFAULT_CACHE)), mps_version)
    except FetchError as exc:
        pytest.fail(f"cannot fetch the real nvidia-cuda-mps-control {mps_version}: {exc}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real cluster's tier (tests/cluster) runs last: .ci/run builds its components in the
    background while everything else runs (scripts/cluster/build.sh), so the tier starts when
    the build is most likely done; the order within each part is kept."""
    last = [item for item in items if _in_cluster_tier(item)]
    if last:
        items[:] = [item for item in items if not _in_cluster_tier(item)] + last


def _in_cluster_tier(item: pytest.Item) -> bool:
    return (REPO / "tests" / "cluster") in Path(str(item.path)).parents


def pytest_report_header(config: pytest.Config) -> str:
    return f"real MPS daemon versions: {', '.join(_mps_versions())} ({'MPSD_TEST_MPS_VERSIONS'} selects; all: CI)"

# The real control daemon's fixtures (tests of mpsd/daemon, mpsd/lifecycle, mpsd/config and the CLI)
from tests.mpsfixtures import make_config, mps_dirs, procs, run_supervisor  # noqa: E402,F401
