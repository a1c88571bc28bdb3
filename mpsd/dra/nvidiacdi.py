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
from typing import Iterable, Sequence

import yaml

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
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("devices"), list):
        return set()
    return {d["name"] for d in data["devices"] if isinstance(d, dict) and isinstance(d.get("name"), str)}


class NvidiaSpecs:
    def __init__(self, dirs: Sequence[str] = DEFAULT_DIRS) -> None:
        self.dirs = tuple(dirs)
        self._files: dict[str, tuple[tuple[int, int], set[str]]] = {}  # path -> ((size, mtime), devices)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def names(self) -> set[str]:
        """Every nvidia.com/gpu device name in the directories now."""
        with self._lock:
            seen: dict[str, tuple[tuple[int, int], set[str]]] = {}
            for path in self._paths():
                seen[path] = self._read(path)
            self._files = seen
            return set().union(*(devices for _, devices in seen.values()))

    def ids(self, gpus: Iterable[tuple[str, int]]) -> dict[int, str]:
        """GPU index -> ``nvidia.com/gpu=<name>`` for each GPU (uuid, index) NVIDIA's specs name;
        a GPU they do not name is logged once."""
        names = self.names()
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

    def _read(self, path: str) -> tuple[tuple[int, int], set[str]]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return (0, 0), set()
        try:
            st = os.fstat(fd)
            key = (st.st_size, st.st_mtime_ns)
            cached = self._files.get(path)
            if cached is not None and cached[0] == key:
                return cached
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SPEC_BYTES:
                return key, set()
            data = b""
            while len(data) <= MAX_SPEC_BYTES and (chunk := os.read(fd, 1 << 20)):
                data += chunk
        finally:
            os.close(fd)
        try:
            parsed = json.loads(data) if path.endswith(".json") else yaml.load(data, Loader=_Loader)
        except (ValueError, yaml.YAMLError) as exc:
            log.warning("CDI spec not readable, skipped path=%s error=%s", path, str(exc).splitlines()[0][:200])
            return key, set()
        return key, spec_devices(parsed)
