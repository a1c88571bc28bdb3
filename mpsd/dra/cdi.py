"""CDI specs for prepared claims: one file per claim in cdiDir (``/var/run/cdi`` by default), kind
``mpsd.io/claim``, one device per request of the claim, named ``<uid>_<request>``. The container
runtime (containerd, CRI-O, podman) reads the file when a container names the device
``mpsd.io/claim=<uid>_<request>`` and applies its containerEdits: the request's GPUs, its
limits, its own region file in the claim's directory, and the device nodes that NVIDIA's own
devices handed beside it do not bring, at their host paths (``device_nodes``). Claims prepared
before requests had devices of their own have one device named ``<uid>`` (kept as written: a
running container's restart names it again).

``claim_spec`` is pure: a prepared claim and the host paths give the spec. ``CdiDir`` writes and
removes the files: cdiDir must be a real directory (not a symlink) that mpsd can write; every
file is opened relative to a descriptor of that directory with O_NOFOLLOW, written to a
temporary name, fsync'd and renamed over the final name (a runtime reading it sees the old
file or the new one, never half of one). The directory is not fsync'd: the prepared claim's
record (mpsd/dra/prepared.py) is the durable truth, and a start writes a spec again that a
crash lost.

cdiVersion 0.5.0: the newest version the CDI library in Debian 12's podman (4.3.1) reads;
containerd and CRI-O read it as well. The spec uses only what 0.5.0 has (env, mounts,
deviceNodes, and their hostPath, which 0.5.0 introduced: the CDI spec's version table).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import stat
from typing import Collection, Iterable, Mapping

from ..errors import DraError
from ..alloc.container import CONTAINER_REGION_DIR, HostPaths
from ..alloc.slicing import Plan
from ..sharing import Grant, SliceRequest
from ..sharing.v2 import V2Backend

log = logging.getLogger(__name__)

CDI_VERSION = "0.5.0"
DEVICE_MARKER_PREFIX = "MPSD_DEVICE_"  # csrc/state.c MPSD_DEVICE_PREFIX
CDI_KIND = "mpsd.io/claim"
FILE_PREFIX = "mpsd.io-claim_"
MAX_SPEC_BYTES = 1 << 20
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,126}[A-Za-z0-9])?")
_REQUEST = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
REGION = "region"


def check_uid(uid: str) -> str:
    """A claim UID usable as a CDI device name and in file names (a Kubernetes UID always is)."""
    if not isinstance(uid, str) or _NAME.fullmatch(uid) is None:
        shown = repr(uid)[:80]
        raise DraError(f"bad claim UID {shown}: expected letters, digits, '-', '_' or '.' (at most 128)")
    return uid


def device_name(uid: str, request: str | None = None) -> str:
    """The CDI device name of a request of a claim, ``<uid>_<request>`` (request names are DNS
    labels and UIDs have no ``_``: the name is unambiguous); ``<uid>`` without a request."""
    name = check_uid(uid) if request is None else f"{check_uid(uid)}_{request}"
    if request is not None and (_REQUEST.fullmatch(request) is None or _NAME.fullmatch(name) is None):
        raise DraError(f"bad request name {request[:80]!r} of claim {uid}: expected a DNS label")
    return name


def device_id(uid: str, request: str | None = None) -> str:
    """The CDI device ID the kubelet hands to the runtime: ``mpsd.io/claim=<uid>_<request>``."""
    return f"{CDI_KIND}={device_name(uid, request)}"


def region_file(request: str | None = None) -> str:
    """The region file of a request's processes in the claim's directory (mounted at /run/mpsd):
    ``region-<request>``, one cap per request; ``region`` for a claim's single device."""
    return REGION if request is None else f"{REGION}-{request}"


def spec_file_name(uid: str) -> str:
    return f"{FILE_PREFIX}{check_uid(uid)}.json"


def node_names(minor_numbers: Iterable[int]) -> list[str]:
    """The NVIDIA device nodes a client of these GPUs needs, relative to /dev: the control nodes
    and ``nvidia<minor>`` per GPU, named by the driver's minor number (NVML's
    nvmlDeviceGetMinorNumber; not the NVML index, which differs from it when GPUs are hidden or
    were hot-plugged)."""
    return [*CONTROL_NODES, *(f"nvidia{m}" for m in sorted(minor_numbers))]


def device_nodes(
    names: Iterable[str],
    dev_dir: str = "/dev",
    *,
    brought: Collection[str] = (),
    hosts: Mapping[str, str] | None = None,
    dev_root: str = "/",
) -> list[dict]:
    """CDI deviceNodes for the nodes ``names`` (relative to /dev): each at ``/dev/<name>`` in the
    container, left out where NVIDIA's devices handed beside mpsd's bring it already
    (``brought``: their container paths) or where this host has no such node (mpsd sees none in
    ``dev_dir`` and NVIDIA's specs name none). The runtime opens a node on the host, not in
    mpsd's container: its ``hostPath`` is the one NVIDIA's specs give that path (``hosts``),
    else ``<dev_root>/dev/<name>`` (nvidia-ctk's --dev-root; ``/`` where the driver's nodes are
    in the host's /dev), written only where it differs from ``path``."""
    hosts = hosts or {}
    out = []
    for name in names:
        path = f"/dev/{name}"
        if path in brought or (path not in hosts and not os.path.exists(os.path.join(dev_dir, name))):
            continue
        host = hosts.get(path) or os.path.join(dev_root, "dev", name)
        out.append({"path": path} if host == path else {"path": path, "hostPath": host})
    return out


def claim_spec(
    uid: str,
    plan: Plan,
    paths: HostPaths,
    region_dir: str,
    *,
    client_priority: int | None = None,
    nodes: Iterable[str | dict] = (),
    grant: Grant | None = None,
) -> dict:
    """The CDI spec of a claim with one device (``<uid>``) for all its containers."""
    return spec([device(device_name(uid), plan, paths, region_dir, client_priority=client_priority, nodes=nodes,
                        grant=grant)])


def spec(devices: list[dict]) -> dict:
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices}


def device(
    name: str,
    plan: Plan,
    paths: HostPaths,
    region_dir: str,
    *,
    client_priority: int | None = None,
    nodes: Iterable[str | dict] = (),
    region: str = REGION,
    grant: Grant | None = None,
) -> dict:
    """One CDI device: what the node's sharing backend gives the slice (``grant``: its
    environment and mounts, mpsd/sharing; MPS v2's when None: the claim's region directory, the
    pipe directory read-only, the shim read-only, the MPS limits of ``plan`` and its GPUs), the
    device nodes, and, where the shim is given, the region file ``region`` of this device's
    containers in the claim's directory (one cap for all of their processes)."""
    if grant is None:
        grant = V2Backend(paths).edits(SliceRequest(name, plan, region_dir, client_priority=client_priority))
    env = dict(grant.env)
    if "MPSSHIM_REGION" in env:
        env["MPSSHIM_REGION"] = f"{CONTAINER_REGION_DIR}/{region}"
    env[device_marker(name)] = name  # the shim refuses a container with two (csrc/state.c)
    mounts = [_mount(m.host, m.container, read_only=m.read_only) for m in grant.mounts]  # as CDI mounts
    edits = {
        "env": [f"{k}={v}" for k, v in sorted(env.items())],
        "mounts": mounts,
    }
    node_list = [{"path": n} if isinstance(n, str) else dict(n) for n in nodes]  # as device_nodes gives them
    if node_list:
        edits["deviceNodes"] = node_list
    return {"name": name, "containerEdits": edits}


def device_marker(name: str) -> str:
    """The variable only this device sets, ``MPSD_DEVICE_<16 hex digits of its name's SHA-256>``:
    the runtime merges the environments of a container's CDI devices, so a container given several
    mpsd devices has one of these each, while their limits, percentage and region overwrite one
    another. The shim counts them and refuses more than one (docs/dra.md, Limitations)."""
    return f"{DEVICE_MARKER_PREFIX}{hashlib.sha256(name.encode()).hexdigest()[:16].upper()}"


def _mount(host: str, container: str, *, read_only: bool) -> dict:
    options = ["ro" if read_only else "rw", "nosuid", "nodev", "bind"]
    return {"hostPath": host, "containerPath": container, "options": options}


class CdiDir:
    """Spec files in one directory, written and removed through a descriptor of it."""

    def __init__(self, path: str) -> None:
        if not os.path.isabs(path):
            raise DraError(f"bad cdiDir {path!r}: expected an absolute path")
        self.path = path

    def _open(self) -> int:
        """A descriptor of cdiDir after checking it: created (0755) when missing; a symlink, a
        file or a directory mpsd cannot write is refused with one line."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            os.mkdir(self.path, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            raise DraError(f"cannot create cdiDir {self.path}: {exc.strerror or exc}") from exc
        try:
            st = os.lstat(self.path)
        except OSError as exc:
            raise DraError(f"cdiDir {self.path}: {exc.strerror or exc}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise DraError(
                f"cdiDir {self.path} is a symlink: expected a real directory (the runtime reads specs there)"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise DraError(f"cdiDir {self.path} is not a directory: expected a directory for CDI specs")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise DraError(f"cdiDir {self.path}: {exc.strerror or exc}") from exc
        if not os.access(self.path, os.W_OK | os.X_OK):
            os.close(fd)
            raise DraError(f"cdiDir {self.path} is not writable: expected a directory mpsd can write")
        return fd

    def check(self) -> None:
        os.close(self._open())

    def write(self, name: str, spec: dict) -> str:
        """Replace ``name`` in cdiDir with ``spec`` (JSON) atomically; the file's path."""
        content = json.dumps(spec, indent=1, sort_keys=True).encode() + b"\n"
        dir_fd = self._open()
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
            try:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, 0o644)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            _unlink(tmp, dir_fd)
            raise DraError(f"cannot write CDI spec {os.path.join(self.path, name)}: {exc.strerror or exc}") from exc
        finally:
            os.close(dir_fd)
        return os.path.join(self.path, name)

    def read(self, name: str) -> dict | None:
        """The spec in ``name``, None when it is missing, not a regular file or not ours to read."""
        try:
            dir_fd = self._open()
        except DraError:
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            os.close(dir_fd)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SPEC_BYTES:
                return None
            data = os.read(fd, MAX_SPEC_BYTES + 1)
            return json.loads(data)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
            os.close(dir_fd)

    def remove(self, name: str) -> None:
        """Remove ``name`` (already gone is fine); DraError when it cannot be removed."""
        dir_fd = self._open()
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise DraError(f"cannot remove CDI spec {os.path.join(self.path, name)}: {exc.strerror or exc}") from exc
        finally:
            os.close(dir_fd)

    def ours(self) -> list[str]:
        """Names of the claim specs in cdiDir (for finding those no record names)."""
        try:
            return sorted(n for n in os.listdir(self.path) if n.startswith(FILE_PREFIX) and n.endswith(".json"))
        except OSError:
            return []


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
