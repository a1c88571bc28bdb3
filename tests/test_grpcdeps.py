"""mpsd/grpcdeps.py: a grpcio or protobuf older than the generated code needs is one line, not a
traceback (seen on the lent GPU machine: grpcio 1.84.0 made `mpsd status` die, docs/hardware.md)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from mpsd import grpcdeps
from mpsd.errors import DependencyError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1.85.1", (1, 85, 1)),
        ("1.84.0", (1, 84, 0)),
        ("7.35.1", (7, 35, 1)),
        ("1.86.0rc1", (1, 86, 0)),
        ("7.35.1+local", (7, 35, 1)),
        ("2", (2,)),
        ("1.x", (1,)),
    ],
)
def test_version_tuple(text, expected):
    assert grpcdeps.version_tuple(text) == expected


def versions(**found: str):
    def installed(dist: str) -> str:
        if dist not in found:
            raise metadata.PackageNotFoundError(dist)
        return found[dist]

    return installed


def test_new_enough_runtimes_pass():
    assert grpcdeps.missing(versions(grpcio="1.85.1", protobuf="7.35.1")) == []
    assert grpcdeps.missing(versions(grpcio="1.90.0", protobuf="8.0.0")) == []
    grpcdeps.require(versions(grpcio="1.85.3", protobuf="7.36.2"))


def test_an_old_grpcio_is_named_with_what_is_needed():
    problems = grpcdeps.missing(versions(grpcio="1.84.0", protobuf="7.36.2"))
    assert problems == ["grpcio 1.84.0 is installed, mpsd's generated gRPC code needs grpcio>=1.85.1"]


def test_old_and_absent_runtimes_are_one_line():
    with pytest.raises(DependencyError) as caught:
        grpcdeps.require(versions(protobuf="6.33.0"))
    message = str(caught.value)
    assert "\n" not in message
    assert "grpcio is not installed (needs >=1.85.1)" in message
    assert "protobuf 6.33.0 is installed" in message and "protobuf>=7.35.1" in message
    assert "pip install 'grpcio>=1.85.1' 'protobuf>=7.35.1'" in message


def test_minimums_match_the_generated_code_and_pyproject():
    generated = sorted((REPO / "mpsd").rglob("*_pb2*.py"))
    assert len(generated) >= 10
    grpc_versions = set()
    protobuf_versions = set()
    for path in generated:
        text = path.read_text()
        grpc_versions.update(re.findall(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", text))
        m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", text)
        if m:
            protobuf_versions.add(".".join(m.groups()))
    assert grpc_versions == {grpcdeps.GRPCIO_MIN}
    assert protobuf_versions == {grpcdeps.PROTOBUF_MIN}
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"grpcio>={grpcdeps.GRPCIO_MIN}" in requires
    assert f"protobuf>={grpcdeps.PROTOBUF_MIN}" in requires


def old_grpcio_path(tmp_path: Path) -> Path:
    """A directory that, first on sys.path, makes importlib.metadata see grpcio 1.84.0 (the
    generated code's own check reads grpc.__version__, which is left alone: ours runs first)."""
    info = tmp_path / "grpcio-1.84.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: grpcio\nVersion: 1.84.0\n")
    return tmp_path


@pytest.mark.parametrize("package", ["mpsd.plugin", "mpsd.dra", "mpsd.dra.service"])
def test_importing_a_grpc_package_with_an_old_grpcio_is_one_line(tmp_path, package):
    code = f"""
import sys
from mpsd.errors import DependencyError
try:
    import {package}
except DependencyError as exc:
    print("ONE-LINE", exc)
    sys.exit(3)
"""
    env = {"PYTHONPATH": f"{old_grpcio_path(tmp_path)}:{REPO}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 3, out.stderr
    assert out.stdout.strip() == (
        "ONE-LINE grpcio 1.84.0 is installed, mpsd's generated gRPC code needs grpcio>=1.85.1: "
        "pip install 'grpcio>=1.85.1' 'protobuf>=7.35.1'"
    )


def test_status_with_an_old_grpcio_needs_no_grpc(tmp_path):
    """What the GPU machine showed: `mpsd status` died of the generated code's RuntimeError, a
    traceback. It no longer loads any generated code unless DRA is enabled (then the line below)."""
    (tmp_path / "site").mkdir()
    env = {"PYTHONPATH": f"{old_grpcio_path(tmp_path / 'site')}:{REPO}", "PATH": "/usr/bin:/bin"}
    args = ["status", "--pipe-dir", str(tmp_path / "pipe"), "--state-dir", str(tmp_path / "state")]
    out = subprocess.run([sys.executable, "-m", "mpsd", *args], capture_output=True, text=True, env=env, timeout=60)
    assert "Traceback" not in out.stderr and "grpc" not in out.stderr, out.stderr
    assert "daemon: down" in out.stdout, out.stdout


@pytest.mark.parametrize("command", [["run"], ["run", "--dra", "true"]])
def test_the_cli_with_an_old_grpcio_is_one_line(tmp_path, command):
    """`mpsd run` serves gRPC (its kubelet faces): with a grpcio too old for the generated code it
    says so in one line, which runtime and what is needed, before it starts anything."""
    (tmp_path / "site").mkdir()
    env = {"PYTHONPATH": f"{old_grpcio_path(tmp_path / 'site')}:{REPO}", "PATH": "/usr/bin:/bin"}
    args = [*command, "--pipe-dir", str(tmp_path / "pipe"), "--state-dir", str(tmp_path / "state")]
    out = subprocess.run([sys.executable, "-m", "mpsd", *args], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip() == (
        "mpsd: grpcio 1.84.0 is installed, mpsd's generated gRPC code needs grpcio>=1.85.1: "
        "pip install 'grpcio>=1.85.1' 'protobuf>=7.35.1'"
    ), out.stderr
