"""NVIDIA's own CDI specs, where the node has them: mpsd answers their device IDs beside its own.

mpsd's spec of a claim carries the MPS environment, the shim, the regions and the device nodes,
but not the driver's libraries (libcuda, libnvidia-ml) and binaries: a client gets those only
from the runtime. NVIDIA's container toolkit writes a spec that has them, of kind
``nvidia.com/gpu``, when the GPU operator runs with CDI enabled or an operator runs
``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` (or the toolkit's nvidia-cdi-refresh
service writes ``/var/run/cdi/nvidia.yaml``). Its devices are named by the GPU's index (``0``,
the default ``--device-name-strategy=index``), its UUID (``GPU-...``, ``uuid``) or ``gpu<index>``
(``type-index``). Where such a device exists for a GPU of a request, the kubelet is handed
``nvidia.com/gpu=<name>`` beside ``mpsd.io/claim=<uid>_<request>``, and the runtime applies
both. Where none exists, the node's runtime must inject the driver from NVIDIA_VISIBLE_DEVICES
(the nvidia runtime as default, or ``runtimeClassName: nvidia`` in the client pods; docs/dra.md):
mpsd says so once per GPU.

Device nodes: NVIDIA's devices bring the GPU's node (``/dev/nvidia<minor>``) and the spec's
common edits the control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``...), each as ``path`` (in
the container) and, where the driver's devices are not in the host's /dev (the GPU operator's
driver container: ``/run/nvidia/driver/dev``; ``nvidia-ctk cdi generate --dev-root``),
``hostPath`` (on the host, which is where the runtime opens it). ``SpecView`` keeps both: which
container paths each device brings, and the host path of every node the specs name; mpsd's own
spec of a claim names only the nodes NVIDIA's devices handed beside it do not bring, by those host
paths (mpsd/dra/prepared.py).

Spec files are read from the CDI directories (``/etc/cdi`` and ``/var/run/cdi``, the runtimes'
defaults, passed in), each opened without following a link, regular files only, at most
MAX_SPEC_BYTES, parsed again only when their size or modification time changed.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import yaml

from .devices import parse_device_name

log = logging.getLogger(__name__)

KIND = "nvidia.com/gpu"
DEFAULT_DIRS = ("/etc/cdi", "/var/run/cdi")
MAX_SPEC_BYTES = 4 << 20
_SUFFIXES = (".yaml", ".yml", ".json")
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_OURS = "mpsd.io-"  # mpsd's own claim specs in cdiDir (mpsd/dra/cdi.py FILE_PREFIX): never NVIDIA's


def device_for(names: set[str], uuid: str, index: int) -> str | None:
    """The NVIDIA CDI device of a GPU among ``names``: by UUID, else by index, else gpu<index>."""
    for name in (uuid, str(index), f"gpu{index}"):
        if name in names:
            return name
    return None


def spec_devices(data: object) -> set[str]:
    """The device names of a parsed spec of kind nvidia.com/gpu; empty for any other."""
    return set(spec_view(data).devices)


@dataclass(frozen=True)
class SpecView:
    """What NVIDIA's specs say about device nodes: device name -> the container paths of the
    nodes it brings (its own and its spec's common ones), and container path -> host path of
    every node they name."""

    devices: Mapping[str, frozenset[str]] = field(default_factory=dict)
    hosts: Mapping[str, str] = field(default_factory=dict)

    def brought(self, ids: Iterable[str]) -> frozenset[str]:
        """The container paths of the nodes the NVIDIA devices ``ids`` (``nvidia.com/gpu=<name>``) bring."""
        prefix = f"{KIND}="
        names = (i[len(prefix):] for i in ids if i.startswith(prefix))
        return frozenset().union(*(self.devices.get(n, frozenset()) for n in names))


def spec_view(data: object) -> SpecView:
    """The devices and device nodes of a parsed spec of kind nvidia.com/gpu; empty for any other.
    A node entry without an absolute ``path`` is left out; ``hostPath`` defaults to ``path``
    (the CDI spec: the host path is the container path where it is not given)."""
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("devices"), list):
        return SpecView()
    hosts: dict[str, str] = {}
    common = _nodes(data.get("containerEdits"), hosts)
    devices = {d["name"]: frozenset(common | _nodes(d.get("containerEdits"), hosts))
               for d in data["devices"] if isinstance(d, dict) and isinstance(d.get("name"), str)}
    return SpecView(devices, hosts)


def _nodes(edits: object, hosts: dict[str, str]) -> set[str]:
    nodes = edits.get("deviceNodes") if isinstance(edits, dict) else None
    paths = set()
    for node in nodes if isinstance(nodes, list) else ():
        path = node.get("path") if isinstance(node, dict) else None
        if not isinstance(path, str) or not os.path.isabs(path):
            continue
        host = node.get("hostPath")
        hosts.setdefault(path, host if isinstance(host, str) and os.path.isabs(host) else path)
        paths.add(path)
    return paths


def brought_nodes(results: Sequence, request: str | None, ids: Mapping[int, str], view: SpecView) -> frozenset[str]:
    """The container paths of the device nodes that every container given a claim's mpsd device
    of ``request`` gets from NVIDIA's devices: the kubelet plugin answers NVIDIA's device of each
    GPU of a request (``ids``, by GPU index) beside the request's own (kubeletplugin._devices); a
    claim's one device (``request`` None, a record written before requests had their own) is
    named by the containers of every request of ``results``, so only what all of them get counts."""
    requests = sorted({r.request for r in results}) if request is None else [request]
    indexes = {q: [gpu_index(r.device) for r in results if r.request == q] for q in requests}
    brought = [view.brought(ids[i] for i in indexes[q] if i is not None and i in ids) for q in requests]
    return frozenset.intersection(*brought) if brought else frozenset()


def gpu_index(device: str) -> int | None:
    """The GPU index of a device mpsd publishes (``gpu-<index>[-slice-<k>]``); None for others (MIG)."""
    try:
        return parse_device_name(device)[0]
    except ValueError:
        return None


class NvidiaSpecs:
    def __init__(self, dirs: Sequence[str] = DEFAULT_DIRS) -> None:
        self.dirs = tuple(dirs)
        self._files: dict[str, tuple[tuple[int, int], SpecView]] = {}  # path -> ((size, mtime), its view)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def names(self) -> set[str]:
        """Every nvidia.com/gpu device name in the directories now."""
        return set(self.view().devices)

    def view(self) -> SpecView:
        """The devices and device nodes of every nvidia.com/gpu spec in the directories now (a
        device or node named in two files: the first file's, in the directories' order)."""
        with self._lock:
            seen = {path: self._read(path) for path in self._paths()}
            self._files = seen
        devices: dict[str, frozenset[str]] = {}
        hosts: dict[str, str] = {}
        for _, v in seen.values():
            for name, nodes in v.devices.items():
                devices.setdefault(name, nodes)
            for path, host in v.hosts.items():
                hosts.setdefault(path, host)
        return SpecView(devices, hosts)

    def ids(self, gpus: Iterable[tuple[str, int]], view: SpecView | None = None) -> dict[int, str]:
        """GPU index -> ``nvidia.com/gpu=<name>`` for each GPU (uuid, index) NVIDIA's specs
        (``view``, else read now) name; a GPU they do not name is logged once."""
        names = set((view or self.view()).devices)
        out = {}
        for uuid, index in gpus:
            name = device_for(names, uuid, index)
            if name is not None:
                out[index] = f"{KIND}={name}"
            elif uuid not in self._warned:
                self._warned.add(uuid)
                log.warning("no NVIDIA CDI spec names GPU %d (%s) in %s: its client containers get the driver's "
                            "libraries only from a runtime that injects them from NVIDIA_VISIBLE_DEVICES (the "
                            "nvidia runtime, or runtimeClassName: nvidia; docs/dra.md)", index, uuid,
                            ",".join(self.dirs))
        return out

    def _paths(self) -> list[str]:
        paths = []
        for directory in self.dirs:
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            paths += [os.path.join(directory, n) for n in names if n.endswith(_SUFFIXES) and not n.startswith(_OURS)]
        return paths

    def _read(self, path: str) -> tuple[tuple[int, int], SpecView]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return (0, 0), SpecView()
        try:
            st = os.fstat(fd)
            key = (st.st_size, st.st_mtime_ns)
            cached = self._files.get(path)
            if cached is not None and cached[0] == key:
                return cached
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SPEC_BYTES:
                return key, SpecView()
            data = b""
            while len(data) <= MAX_SPEC_BYTES and (chunk := os.read(fd, 1 << 20)):
                data += chunk
        finally:
            os.close(fd)
        try:
            parsed = json.loads(data) if path.endswith(".json") else yaml.load(data, Loader=_Loader)
        except (ValueError, yaml.YAMLError) as exc:
            log.warning("CDI spec not readable, skipped path=%s error=%s", path, str(exc).splitlines()[0][:200])
            return key, SpecView()
        return key, spec_view(parsed)
