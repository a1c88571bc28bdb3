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
