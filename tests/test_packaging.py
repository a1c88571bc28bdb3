"""pyproject.toml as setuptools reads it at build time: no deprecation warning, SPDX license."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_the_build_requires_a_setuptools_that_reads_an_spdx_license() -> None:
    floor = re.search(r'^requires = \[.*"setuptools>=(\d+)"', PYPROJECT.read_text(), re.MULTILINE)
    assert floor and int(floor.group(1)) >= 77  # the first setuptools with PEP 639 license strings


def test_setuptools_applies_the_project_table_without_warnings() -> None:
    setuptools = pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SetuptoolsDeprecationWarning included
        dist = apply_configuration(setuptools.Distribution(), PYPROJECT)
    assert dist.metadata.license_expression == "Apache-2.0"


def test_the_wheel_carries_every_package_and_proto(tmp_path: Path) -> None:
    """A plain `pip install .` (what scripts/demo.sh and the container build do) must carry
    every package of the tree: mpsd.sharing was once left out of a hand-kept list, and `mpsd`
    installed that way died at import."""
    import subprocess
    import sys
    import zipfile

    import shutil

    repo = PYPROJECT.parent
    source = tmp_path / "src"  # the tree without build/ (a stale build/lib would be packed whole)
    shutil.copytree(repo, source, ignore=shutil.ignore_patterns(
        "build", "dist", "*.egg-info", ".venv", ".cache", ".git", "__pycache__", ".gpu-venv", ".whl*", "results"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("mpsd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for init in sorted((repo / "mpsd").rglob("__init__.py")):
        assert str(init.relative_to(repo)) in names, f"{init.relative_to(repo)} is not in the wheel"
    for proto in sorted((repo / "mpsd").rglob("*.proto")):
        assert str(proto.relative_to(repo)) in names, f"{proto.relative_to(repo)} is not in the wheel"
    assert "shim/libmpsshim.so" in names
