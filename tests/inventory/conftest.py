from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.nvml_build import build_fake_nvml


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the fake libnvidia-ml.so.1, built once per session."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake-nvml"))


@pytest.fixture
def nvml_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write the fake's config file and point FAKE_NVML_CONFIG at it; returns the path."""
    path = tmp_path / "nvml.conf"

    def write(text: str) -> Path:
        path.write_text(text)
        monkeypatch.setenv("FAKE_NVML_CONFIG", str(path))
        return path

    return write
