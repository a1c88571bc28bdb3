"""What a ResourceClaim gives this node: pure functions from the claim (a dict as the API server
returns it, resource.k8s.io/v1) to the limits of its containers.

For one claim and this driver and node:

- ``metadata.uid`` must be the UID the kubelet asked for (a claim deleted and re-created
  under the same name is another claim);
- ``status.allocation.nodeSelector`` must select this node (``matchFields`` on
  ``metadata.name`` or ``matchExpressions`` on ``kubernetes.io/hostname``, operator ``In``);
- the results of this driver (``status.allocation.devices.results[]``) name devices of this
  node's pool: ``gpu-<index>`` (capacity mode) or ``gpu-<index>-slice-<k>`` (slices mode);
- each request (a subrequest counts as its request) is planned on its own: the containers
  naming it get its GPUs and limits only (mpsd/dra/cdi.py writes a CDI device per request);
  the whole claim's plan is what it consumed per GPU;
- what a result consumed (``consumedCapacity``: ``memory`` in bytes, ``compute`` in percent of
  the SMs, at least 1 as the slices' validRange says: less would reach MPS as 0 %; quantities
  read as the API server reads them, mpsd/dra/quantity.py) becomes the container's pinned
  memory limit and active thread percentage. What it did not ask for is derived from the
  other, in proportion to the device: ``memory: 4Gi`` of an 80 GiB GPU gives 5 % compute
  (rounded up to a hundredth), ``compute: 25`` gives a quarter of its memory (rounded down to
  a MiB); neither gives the whole GPU. A slice ``k`` of N gives
  the device plugin's share of slice k (mpsd.alloc.slicing) and 100/N %. Several results on
  one GPU add up; over several GPUs the largest percentage is taken (MPS has one per client),
  as for the device plugin;
- the claim's opaque configuration for this driver (``status.allocation.devices.config[]``,
  class configs first, then the claim's: the later wins) is ``apiVersion: gpu.mpsd.io/v1alpha1,
  kind: ClaimConfig`` with ``clientPriority`` (0 normal, 1 below normal) and ``memoryLimit`` (a
  quantity: the hard limit on each GPU of the claim, from what it consumed, its guarantee, up to
  the GPU: burst, where the node's backend can enforce it, docs/mps-v3.md); any other field is
  refused.

Every refusal is a DraError with one line naming the claim and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Sequence

from ..errors import DraError
from ..inventory.mig import MigDevice
from ..alloc.slicing import MIB, GpuLike, GpuShare, Plan
from . import migdevices
from .devices import COMPUTE, MEMORY, parse_device_name, slice_compute, slice_memory
from .quantity import parse_quantity  # noqa: F401 (read here; tests import it from here too)

CONFIG_API_VERSION = "gpu.mpsd.io/v1alpha1"
CONFIG_KIND = "ClaimConfig"
CONFIG_FIELDS = ("apiVersion", "kind", "clientPriority", "memoryLimit")
CAPACITIES = (MEMORY, COMPUTE)
HOSTNAME_LABEL = "kubernetes.io/hostname"
MIN_COMPUTE = 1  # percent: the slices' validRange min (below it MPS would be given 0 %)


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def base_request(name: str) -> str:
    """The request a result belongs to, as a container names it: ``gpu`` for ``gpu/large`` (a
    subrequest of a ``firstAvailable`` list), ``gpu`` for ``gpu``. The kubelet matches a
    container's ``resources.claims[].request`` literally against the response's request names
    (the DRA helper's resourceclaim.BaseRequestRef does the same cut)."""
    return name.split("/", 1)[0]


@dataclass(frozen=True)
class Result:
    """One allocated device of this driver, as the response to the kubelet names it: ``request``
    is the base request (:func:`base_request`)."""

    request: str
    pool: str
    device: str
    share_id: str = ""  # the result's shareID (a device allocated to several claims), "" when none


@dataclass(frozen=True)
class RequestPlan:
    """What the containers naming one request of the claim get: its own GPUs and limits."""

    name: str  # the base request
    plan: Plan


@dataclass(frozen=True)
class ClaimPlan:
    ref: ClaimRef
    results: tuple[Result, ...]
    plan: Plan  # the whole claim's limits per GPU (its consumption: metrics, status)
    client_priority: int | None
    pods: tuple[str, ...]  # names of the pods in reservedFor
    requests: tuple[RequestPlan, ...] = ()  # one per request, in the order the results name them
    pod_uids: tuple[str, ...] = ()  # their UIDs (the sharing backend finds their cgroups)
    memory_limit: int | None = None  # ClaimConfig memoryLimit: the hard limit per GPU (burst), bytes


def short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _get(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def check_identity(claim: Any, ref: ClaimRef) -> None:
    meta = _get(claim, "metadata")
    if not isinstance(meta, Mapping):
        raise DraError(f"claim {ref}: the API server's answer has no metadata")
    if meta.get("uid") != ref.uid:
        raise DraError(
            f"claim {ref}: UID {short(meta.get('uid'))} on the API server, the kubelet asked for {ref.uid!r} "
            "(deleted and created again?): not prepared"
        )
    if (meta.get("namespace"), meta.get("name")) != (ref.namespace, ref.name):
        raise DraError(f"claim {ref}: the API server answered with {meta.get('namespace')}/{meta.get('name')}")


def selects_node(node_selector: Any, node: str) -> bool:
    """Whether a v1 NodeSelector (terms ORed, requirements ANDed) selects ``node`` by name. Only
    ``In`` on ``metadata.name`` (matchFields) or the hostname label is understood; a term with any
    other requirement cannot be decided here and does not select."""
    terms = _get(node_selector, "nodeSelectorTerms")
    if not isinstance(terms, list):
        return False
    for term in terms:
        reqs = [("f", r) for r in _get(term, "matchFields") or []]
        reqs += [("e", r) for r in _get(term, "matchExpressions") or []]
        if reqs and all(_names_node(kind, r, node) for kind, r in reqs):
            return True
    return False


def _names_node(kind: str, req: Any, node: str) -> bool:
    key = "metadata.name" if kind == "f" else HOSTNAME_LABEL
    values = _get(req, "values")
    return _get(req, "key") == key and _get(req, "operator") == "In" and isinstance(values, list) and node in values


def client_config(configs: Any, driver: str, ref: ClaimRef) -> int | None:
    """The client priority from this driver's opaque configs (the last one that sets it wins)."""
    priority = None
    for entry in configs if isinstance(configs, list) else []:
        opaque = _get(entry, "opaque")
        if _get(opaque, "driver") != driver:
            continue
        params = _get(opaque, "parameters")
        where = f"claim {ref}: opaque config for {driver}"
        if not isinstance(params, Mapping):
            raise DraError(f"{where}: expected a mapping with apiVersion {CONFIG_API_VERSION}, got {short(params)}")
        unknown = sorted(str(k) for k in params if k not in CONFIG_FIELDS)
        if unknown:
            raise DraError(f"{where}: unknown field {short(unknown[0])}; accepted: {', '.join(CONFIG_FIELDS)}")
        if params.get("apiVersion") != CONFIG_API_VERSION or params.get("kind") != CONFIG_KIND:
            raise DraError(
                f"{where}: apiVersion {short(params.get('apiVersion'))} kind {short(params.get('kind'))}; "
                f"accepted: apiVersion {CONFIG_API_VERSION}, kind {CONFIG_KIND}"
            )
        if "clientPriority" in params:
            value = params["clientPriority"]
            if value not in (0, 1) or isinstance(value, bool):
                raise DraError(f"{where}: clientPriority {short(value)}; accepted: 0 (normal) or 1 (below normal)")
            priority = int(value)
    return priority


def claim_memory_limit(configs: Any, driver: str, ref: ClaimRef, plan: Plan, gpus: Sequence[GpuLike]) -> int | None:
    """ClaimConfig ``memoryLimit`` (the last config that sets it wins): a quantity, the hard limit
    on each GPU of the claim, at least what the claim consumed there and at most the GPU's memory
    (client_config has checked the configs' form)."""
    text = None
    for entry in configs if isinstance(configs, list) else []:
        params = _get(entry, "opaque", "parameters")
        if _get(entry, "opaque", "driver") == driver and isinstance(params, Mapping) and "memoryLimit" in params:
            text = params["memoryLimit"]
    if text is None:
        return None
    where = f"claim {ref}: opaque config for {driver}: memoryLimit"
    try:
        limit = parse_quantity(text)
    except ValueError as exc:
        raise DraError(f"{where}: {exc}") from None
    totals = {g.index: g.memory_total for g in gpus}
    for share in plan.gpus:
        if limit < share.memory_limit:
            raise DraError(f"{where} {text} is below the {share.memory_limit} bytes consumed on GPU {share.index}: "
                           "expected at least the guarantee")
        if limit > totals.get(share.index, limit):
            raise DraError(f"{where} {text} is above GPU {share.index}'s {totals[share.index]} bytes")
    return int(limit) // MIB * MIB


@dataclass(frozen=True)
class _Take:
    gpu: GpuLike
    slice: int | None
    memory: int  # bytes
    compute: float  # percent


def _consumed(result: Mapping, gpu: GpuLike, where: str) -> tuple[int, float]:
    """(bytes, percent) one capacity-mode result consumed, the missing one derived."""
    consumed = result.get("consumedCapacity") or {}
    if not isinstance(consumed, Mapping):
        raise DraError(f"{where}: consumedCapacity {short(consumed)}: expected a mapping of memory and compute")
    unknown = sorted(str(k) for k in consumed if k not in CAPACITIES)
    if unknown:
        raise DraError(f"{where}: unknown capacity {short(unknown[0])}; accepted: {', '.join(CAPACITIES)}")
    try:
        memory = parse_quantity(consumed["memory"]) if "memory" in consumed else None
        compute = parse_quantity(consumed["compute"]) if "compute" in consumed else None
    except ValueError as exc:
        raise DraError(f"{where}: {exc}") from None
    total = gpu.memory_total
    if memory is not None and not MIB <= memory <= total:
        raise DraError(f"{where}: consumed memory {consumed['memory']} is outside 1Mi..{total} (the device's bytes)")
    if compute is not None and not MIN_COMPUTE <= compute <= 100:
        raise DraError(f"{where}: consumed compute {consumed['compute']} is outside [{MIN_COMPUTE}, 100] percent "
                       "of the SMs (the published validRange)")
    if memory is None:
        if compute is None:
            return total // MIB * MIB, 100.0
        memory = total * compute / 100
    elif compute is None:
        compute = Fraction(math.ceil(memory * 10000 / total), 100)  # up to a hundredth: never below the share
    return int(memory) // MIB * MIB, min(100.0, float(compute))


def _take(result: Mapping, gpus: Mapping[int, GpuLike], slices_per_gpu: int, where: str,
          instances: Sequence[MigDevice] = ()) -> _Take:
    name = result.get("device")
    gpu: GpuLike | None
    if migdevices.parse_name(name) is not None:  # a MIG instance (mpsd/dra/migdevices.py)
        instance, k = migdevices.find(instances, name)
        if instance is None:
            raise DraError(f"{where}: that MIG instance is not served on this node (the MIG layout changed)")
        gpu, slices_per_gpu = instance, instance.slices
    else:
        try:
            index, k = parse_device_name(name)
        except ValueError as exc:
            raise DraError(f"{where}: {exc}; or {migdevices.NAME_FORM}") from None
        gpu = gpus.get(index)
        if gpu is None:
            raise DraError(f"{where}: GPU {index} is not on this node (GPUs: {sorted(gpus)})")
    if result.get("adminAccess"):
        raise DraError(f"{where}: adminAccess is not supported: an MPS client always has limits")
    if k is None:
        memory, compute = _consumed(result, gpu, where)
        return _Take(gpu, None, memory, compute)
    if k >= slices_per_gpu:
        raise DraError(f"{where}: slice {k} of {slices_per_gpu} per GPU does not exist")
    return _Take(gpu, k, slice_memory(gpu.memory_total, slices_per_gpu, k), slice_compute(slices_per_gpu))


def _plan(takes: Sequence[_Take], device_ids: tuple[str, ...], ref: ClaimRef) -> Plan:
    per_gpu: dict[str, list[_Take]] = {}  # by UUID: the instances of one GPU share its index
    for t in takes:
        per_gpu.setdefault(t.gpu.uuid, []).append(t)
    shares = []
    percentages = []
    for ordinal, uuid in enumerate(sorted(per_gpu, key=lambda u: (per_gpu[u][0].gpu.index, u))):
        group = per_gpu[uuid]
        gpu = group[0].gpu
        index = gpu.index
        memory = sum(t.memory for t in group)
        if memory > gpu.memory_total:
            raise DraError(f"claim {ref}: {memory} bytes consumed on GPU {index}, above its {gpu.memory_total}")
        slices = tuple(sorted(t.slice for t in group if t.slice is not None))
        shares.append(GpuShare(ordinal=ordinal, index=index, uuid=gpu.uuid, slices=slices, memory_limit=memory))
        percentages.append(min(100.0, round(sum(t.compute for t in group), 2)))
    return Plan(device_ids, tuple(shares), max(percentages))


def plan_claim(
    claim: Any, ref: ClaimRef, *, driver: str, node: str, pool: str, gpus: Sequence[GpuLike], slices_per_gpu: int
) -> ClaimPlan:
    """The limits of ``claim`` on this node, or DraError with one line."""
    check_identity(claim, ref)
    allocation = _get(claim, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise DraError(f"claim {ref}: not allocated (no status.allocation)")
    if not selects_node(allocation.get("nodeSelector"), node):
        raise DraError(f"claim {ref}: allocated to another node (nodeSelector does not name {node!r})")
    results = _get(allocation, "devices", "results")
    ours = [r for r in results if _get(r, "driver") == driver] if isinstance(results, list) else []
    if not ours:
        raise DraError(f"claim {ref}: no device of driver {driver} allocated")
    by_index = {g.index: g for g in gpus if not isinstance(g, MigDevice)}
    instances = [g for g in gpus if isinstance(g, MigDevice)]
    takes, names = [], []
    for r in ours:
        where = f"claim {ref}: device {short(r.get('device'))} of request {short(r.get('request'))}"
        if r.get("pool") != pool:
            raise DraError(f"{where}: pool {short(r.get('pool'))} is not this node's pool {pool!r}")
        takes.append(_take(r, by_index, slices_per_gpu, where, instances))
        share_id = r.get("shareID")
        names.append(Result(base_request(str(r.get("request") or "")), pool, str(r["device"]),
                            share_id if isinstance(share_id, str) else ""))
    if len(set(names)) != len(names):
        raise DraError(f"claim {ref}: a device is allocated twice for one request")
    priority = client_config(_get(allocation, "devices", "config"), driver, ref)
    device_ids = tuple(sorted({f"{n.pool}/{n.device}" for n in names}))
    requests = []
    for request in dict.fromkeys(n.request for n in names):
        mine = [(t, n) for t, n in zip(takes, names, strict=True) if n.request == request]
        ids = tuple(sorted({f"{n.pool}/{n.device}" for _, n in mine}))
        requests.append(RequestPlan(request, _plan([t for t, _ in mine], ids, ref)))
    reserved = _get(claim, "status", "reservedFor")
    consumers = [c for c in (reserved if isinstance(reserved, list) else [])
                 if isinstance(c, Mapping) and c.get("resource") == "pods" and not c.get("apiGroup")]
    pods = tuple(str(c.get("name")) for c in consumers)
    uids = tuple(str(c["uid"]) for c in consumers if isinstance(c.get("uid"), str) and c["uid"])
    plan = _plan(takes, device_ids, ref)
    limit = claim_memory_limit(_get(allocation, "devices", "config"), driver, ref, plan, gpus)
    return ClaimPlan(ref, tuple(names), plan, priority, pods, tuple(requests), uids, limit)
