"""The API server's own rules for a ResourceSlice (resource.k8s.io/v1) that the JSON schema
cannot say, as the API reference states them (the field descriptions kubernetes-validate
carries): the stand-in API server refuses a slice that breaks one, as the real one would; and
what the registry does to a slice before it stores it (gated fields dropped, taint times set)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from lightkube.utils.quantity import parse_quantity

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
_SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?")
_NODE_SELECTION = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
_VALUE_KINDS = ("bool", "int", "string", "version", "bools", "ints", "strings", "versions")


def resource_slice_errors(obj: dict[str, Any]) -> list[str]:
    spec = obj.get("spec") or {}
    errors = []
    chosen = [k for k in _NODE_SELECTION if spec.get(k) not in (None, False, "")]
    if len(chosen) != 1:
        errors.append(f"spec: exactly one of {', '.join(_NODE_SELECTION)} must be set, found {chosen}")
    pool = spec.get("pool") or {}
    if pool.get("resourceSliceCount", 0) <= 0 or pool.get("generation", -1) < 0:
        errors.append(f"spec.pool: resourceSliceCount must be > 0 and generation >= 0: {pool}")
    devices = spec.get("devices") or []
    limit = 64 if any(d.get("taints") or d.get("consumesCounters") for d in devices) else 128
    if len(devices) > limit:
        errors.append(f"spec.devices: {len(devices)} devices, at most {limit}")
    names = [d.get("name", "") for d in devices]
    if len(set(names)) != len(names):
        errors.append(f"spec.devices: duplicate names in {names}")
    for i, device in enumerate(devices):
        errors += [f"spec.devices[{i}]: {e}" for e in _device_errors(device)]
    return errors


def _device_errors(device: dict[str, Any]) -> list[str]:
    errors = []
    if not _DNS_LABEL.fullmatch(device.get("name", "")):
        errors.append(f"name {device.get('name')!r} is not a DNS label")
    attributes, capacity = device.get("attributes") or {}, device.get("capacity") or {}
    if len(attributes) + len(capacity) > 32:
        errors.append("more than 32 attributes and capacities")
    for name in [*attributes, *capacity]:
        if not _IDENTIFIER.fullmatch(name.rpartition("/")[2]):
            errors.append(f"name {name!r}: the part after the domain must be a C identifier of at most 32 characters")
    for name, value in attributes.items():
        errors += [f"attributes[{name}]: {e}" for e in _attribute_errors(value)]
    for name, cap in capacity.items():
        if cap.get("requestPolicy") and not device.get("allowMultipleAllocations"):
            errors.append(f"capacity[{name}].requestPolicy needs allowMultipleAllocations")
        errors += [f"capacity[{name}]: {e}" for e in _capacity_errors(cap)]
    return errors


def _attribute_errors(value: dict[str, Any]) -> list[str]:
    kinds = [k for k in _VALUE_KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        return [f"exactly one value must be set, found {kinds}"]
    if isinstance(value.get("string"), str) and len(value["string"]) > 64:
        return [f"string longer than 64 characters: {value['string']!r}"]
    if "version" in value and not _SEMVER.fullmatch(value["version"]):
        return [f"version {value['version']!r} is not semver 2.0.0"]
    return []


def _capacity_errors(cap: dict[str, Any]) -> list[str]:
    value = _quantity(cap.get("value"))
    if value is None or value < 0:
        return [f"value {cap.get('value')!r} is not a quantity >= 0"]
    policy = cap.get("requestPolicy")
    if not policy:
        return []
    default = _quantity(policy.get("default"))
    valid_range, valid_values = policy.get("validRange"), policy.get("validValues")
    if valid_range and valid_values:
        return ["requestPolicy: at most one of validRange and validValues"]
    if (valid_range or valid_values) and default is None:
        return ["requestPolicy.default is required with validRange or validValues"]
    if valid_values:
        values = [_quantity(v) for v in valid_values]
        if None in values or values != sorted(set(values)) or len(values) > 10 or default not in values:
            return [f"requestPolicy.validValues {valid_values}: at most 10 sorted quantities, the default among them"]
        return []
    if valid_range:
        return _range_errors(value, default, valid_range)
    return [] if default is None or default <= value else [f"requestPolicy.default {default} above value {value}"]


def _range_errors(value: Decimal, default: Decimal, valid_range: dict[str, Any]) -> list[str]:
    low, high, step = (_quantity(valid_range.get(k)) for k in ("min", "max", "step"))
    errors = []
    if low is None or low < 0 or low > value:
        errors.append(f"validRange.min {valid_range.get('min')!r} must be 0..value")
        return errors
    if high is not None and not low <= high <= value:
        errors.append(f"validRange.max {high} must be min..value")
    if not low <= default <= (high if high is not None else value):
        errors.append(f"requestPolicy.default {default} outside the valid range")
    if step is not None:
        if step <= 0 or low + step > value:
            errors.append(f"validRange.step {step} must be > 0 with min + step <= value")
        elif (default - low) % step or (high is not None and (high - low) % step):
            errors.append(f"requestPolicy.default {default} and validRange.max {high} must be min + n*step")
    return errors


def _quantity(text: Any) -> Decimal | None:
    try:
        return parse_quantity(text) if isinstance(text, str) else None
    except ValueError:
        return None


def drop_disabled_fields(new: dict[str, Any], old: dict[str, Any] | None, gates_off: set[str]) -> None:
    """What the registry strategy's dropDisabledFields does to a written ResourceSlice for the gates
    that are off (pkg/registry/resource/resourceslice/strategy.go): a gate's fields go from every
    device, unless the stored slice ``old`` (on update) uses them already."""
    devices = (new.get("spec") or {}).get("devices") or []
    old_devices = ((old or {}).get("spec") or {}).get("devices") or []
    if "DRADeviceTaints" in gates_off and not any(d.get("taints") for d in old_devices):
        for device in devices:
            device.pop("taints", None)
    in_use = any("allowMultipleAllocations" in d or any("requestPolicy" in c for c in (d.get("capacity") or {}).values())
                 for d in old_devices)
    if "DRAConsumableCapacity" in gates_off and not in_use:
        for device in devices:
            device.pop("allowMultipleAllocations", None)
            for capacity in (device.get("capacity") or {}).values():
                capacity.pop("requestPolicy", None)


def default_taint_times(obj: dict[str, Any]) -> None:
    """A taint written without ``timeAdded`` gets the time of the write (the field's description in
    the 1.37 schema: "Added automatically during create or update if not set")."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for device in (obj.get("spec") or {}).get("devices") or []:
        for taint in device.get("taints") or []:
            taint.setdefault("timeAdded", now)


def resource_claim_errors(obj: dict[str, Any]) -> list[str]:
    """A ResourceClaim's allocation results against its requests, as the API server's validation
    of status.allocation states it (pkg/apis/resource/validation: a result's ``request`` names a
    request of the spec; one with ``firstAvailable`` only as ``<request>/<subrequest>``, naming
    one of its subrequests; an ``exactly`` request only bare)."""
    requests = ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []
    exactly = {r.get("name") for r in requests if r.get("exactly")}
    subrequests = {f"{r.get('name')}/{s.get('name')}" for r in requests for s in r.get("firstAvailable") or []}
    results = (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    errors = []
    for i, result in enumerate(results):
        name = result.get("request")
        if name not in exactly and name not in subrequests:
            errors.append(f"status.allocation.devices.results[{i}].request {name!r}: names no request of the spec "
                          f"(requests: {sorted(exactly)}, subrequests: {sorted(subrequests)})")
    return errors
