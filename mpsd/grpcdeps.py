"""The gRPC and protobuf runtimes mpsd's generated code (``*_pb2*.py``, scripts/gen-proto.sh)
needs, checked before that code is imported, so that a machine with an older grpcio gets one
line naming both versions instead of the generated module's traceback.

Seen on a real GPU machine (docs/hardware.md): its image had grpcio 1.84.0, the generated code
refuses anything below 1.85.1, and ``mpsd status`` died of the RuntimeError the generated module
raises at import.
"""

from __future__ import annotations

from importlib import metadata
from typing import Callable

from .errors import DependencyError

# What scripts/gen-proto.sh generated with: GRPC_GENERATED_VERSION in each *_pb2_grpc.py and the
# version ValidateProtobufRuntimeVersion checks in each *_pb2.py (tests/test_grpcdeps.py keeps
# these equal to the files and to pyproject.toml's requirements).
GRPCIO_MIN = "1.85.1"
PROTOBUF_MIN = "7.35.1"


def version_tuple(text: str) -> tuple[int, ...]:
    """``"1.85.1"`` -> (1, 85, 1); a pre-release or local tail (``1.86.0rc1``, ``7.35.1+x``)
    counts by its leading numbers only."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def missing(installed: Callable[[str], str] = metadata.version) -> list[str]:
    """One phrase per runtime that is absent or older than the generated code needs."""
    found = []
    for dist, minimum in (("grpcio", GRPCIO_MIN), ("protobuf", PROTOBUF_MIN)):
        try:
            have = installed(dist)
        except metadata.PackageNotFoundError:
            found.append(f"{dist} is not installed (needs >={minimum})")
            continue
        if version_tuple(have) < version_tuple(minimum):
            found.append(f"{dist} {have} is installed, mpsd's generated gRPC code needs {dist}>={minimum}")
    return found


def require(installed: Callable[[str], str] = metadata.version) -> None:
    """Raise DependencyError (one line) unless both runtimes are new enough."""
    problems = missing(installed)
    if problems:
        wanted = " ".join(f"'{d}>={m}'" for d, m in (("grpcio", GRPCIO_MIN), ("protobuf", PROTOBUF_MIN)))
        raise DependencyError(f"{'; '.join(problems)}: pip install {wanted}")
