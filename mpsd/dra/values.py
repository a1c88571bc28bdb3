"""Values as resource.k8s.io/v1 writes them (pure): quantities in canonical form, versions as
semver, a consumable capacity with its request policy. Shared by the slices of whole GPUs
(mpsd/dra/slices.py) and of MIG instances (mpsd/dra/migdevices.py)."""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

Obj = dict[str, Any]

MIB = 1 << 20
MIN_MEMORY_MIB = 256  # the smallest memory a slice or claim gets (mpsd/dra/slices.py says why)
_VERSION_PARTS = re.compile(r"([0-9]+)(?:\.([0-9]+))?(?:\.([0-9]+))?")
_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def semver(text: str) -> str | None:
    """A driver or compute-capability version as semver 2.0.0 (what a version attribute
    must be): ``"580.95.05"`` -> ``"580.95.5"``, ``"9.0"`` -> ``"9.0.0"``; None if it is not
    one to three dot-separated numbers."""
    match = _VERSION_PARTS.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        return None
    return ".".join(str(int(part or 0)) for part in match.groups())


def quantity(value: int | float | Decimal, binary: bool = False) -> str:
    """A Kubernetes quantity in canonical form, as the API server stores it: ``17179869184``
    bytes -> ``16Gi`` (binary), ``25`` -> ``25``, ``33.33`` -> ``33330m``."""
    number = Decimal(str(value))
    if binary and number == number.to_integral_value() and number > 0:
        for suffix, shift in _BINARY:
            if int(number) % (1 << shift) == 0:
                return f"{int(number) >> shift}{suffix}"
    if number == number.to_integral_value():
        return str(int(number))
    return f"{int((number * 1000).to_integral_value())}m"


def capacity(value: str, default: str, low: str, high: str, step: str) -> Obj:
    valid_range = {"min": low, "max": high, "step": step}
    return {"value": value, "requestPolicy": {"default": default, "validRange": valid_range}}
