"""A size-limited tmpfs at regionDir: what pods can write there is bounded, apart from the
node's disk (and from the plugin's state file, which lives in stateDir outside regionDir).

Every allocation's directory is mode 0777 and mounted into its pod: without a bound, one pod
could fill the file system that the node and the plugin's state depend on. A tmpfs mounted
with ``size=`` (and ``nr_inodes=``, empty files cost kernel memory too) is a hard limit the
kernel enforces; its pages are charged to the memory cgroup of the pod that writes them.

    python -m mpsd.plugin.regionfs PATH SIZE [--inodes N] [--mode 1777 --label shmDir]

mounts it (nosuid, nodev, noexec, mode 0755) unless PATH is a tmpfs mount point already (a
restart of mpsd: mounting again would hide the directories pods use). The DaemonSet runs it
in an init container (deploy/base/daemonset.yaml); the mount must reach the host's mount
namespace, where the container runtime bind-mounts each allocation's directory into its pod.
The check and the mount happen under an exclusive ``flock`` on PATH's parent directory
(waited for at most ``LOCK_WAIT`` seconds): shmDir is mounted by two pods that may start at
once (mpsd and the daemon holder, deploy/overlays/tmpfs), and both must find one mount.

With ``ipcMode: tmpfs`` the same command bounds ``shmDir``, every GPU pod's ``/dev/shm``
(deploy/overlays/tmpfs): ``--mode 1777`` as any ``/dev/shm`` (any UID creates segments, only
their owner removes them), ``--label shmDir`` for its lines.

The plugin calls ``describe(path)`` at start and logs what bounds regionDir.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import os
import re
import sys
import time
from dataclasses import dataclass

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
DEFAULT_INODES = 16384
LOCK_WAIT = 60.0  # seconds ensure_tmpfs waits for another mounter of the same parent
_SIZE = re.compile(r"([0-9]{1,15})(Ki|Mi|Gi|K|M|G)?")
_UNITS = {None: 1, "K": 1 << 10, "Ki": 1 << 10, "M": 1 << 20, "Mi": 1 << 20, "G": 1 << 30, "Gi": 1 << 30}


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    options: dict[str, str]  # the file system's own options (size=..., nr_inodes=...)


def parse_size(text: str) -> int:
    """``"256Mi"`` -> 268435456; bytes, or K/Ki, M/Mi, G/Gi (all powers of 1024). ValueError
    with one line naming the text otherwise (kept local: a tmpfs size, nothing else)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + f"... ({len(text)} characters)"
        raise ValueError(f"bad size {shown}: expected a positive number of bytes, or with Ki, Mi or Gi, e.g. 256Mi")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The lines of /proc/self/mountinfo (proc(5)), in order: later mounts stack on earlier ones."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        options = {}
        for opt in (tail[2] if len(tail) > 2 else "").split(","):
            key, _, value = opt.partition("=")
            options[key] = value
        mounts.append(Mount(_unescape(fields[4]), tail[0], options))
    return mounts


def mount_at(path: str, mountinfo: str) -> Mount | None:
    """The file system mounted at exactly ``path`` (the top one if several), or None."""
    real = os.path.realpath(path)
    found = [m for m in parse_mountinfo(mountinfo) if m.mount_point == real]
    return found[-1] if found else None


def _read_mountinfo() -> str:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return f.read()


def describe(path: str) -> str | None:
    """``"tmpfs size=...k nr_inodes=..."`` when ``path`` is a tmpfs mount point, else None."""
    try:
        mount = mount_at(path, _read_mountinfo())
    except OSError:
        return None
    if mount is None or mount.fstype != "tmpfs":
        return None
    return f"tmpfs size={mount.options.get('size', '?')} nr_inodes={mount.options.get('nr_inodes', '?')}"


def ensure_tmpfs(path: str, size: int, inodes: int = DEFAULT_INODES, mode: int = 0o755,
                 label: str = "regionDir", lock_wait: float = LOCK_WAIT) -> str:
    """Mount a tmpfs of ``size`` bytes at ``path`` unless one is there already. A line saying
    which; OSError when it cannot (no CAP_SYS_ADMIN, say, or another mounter holds the lock on
    the parent directory for longer than ``lock_wait``)."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    parent = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _lock(parent, path, lock_wait)
        existing = describe(path)
        if existing is not None:
            return f"{label} {path} is a {existing} already, left as it is"
        return _mount(path, size, inodes, mode, label)
    finally:
        os.close(parent)  # releases the lock


def _lock(fd: int, path: str, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(errno.EAGAIN, f"cannot mount a tmpfs at {path}: another mounter held the lock "
                                            f"on its parent directory for {wait:g}s") from None
            time.sleep(0.05)


def _mount(path: str, size: int, inodes: int, mode: int, label: str) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size},nr_inodes={inodes},mode={mode:04o}".encode()
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", ctypes.c_ulong(flags), options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount a tmpfs at {path}: {os.strerror(err)}")
    shown = "" if mode == 0o755 else f" mode={mode:o}"
    return f"{label} {path} mounted: tmpfs size={size} nr_inodes={inodes}{shown}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpsd.plugin.regionfs", description=__doc__.splitlines()[0])
    ap.add_argument("path", help="regionDir, as in the configuration")
    ap.add_argument("size", help="bytes, or with Ki, Mi, Gi (e.g. 256Mi)")
    ap.add_argument("--inodes", type=int, default=DEFAULT_INODES, help="files and directories at most")
    ap.add_argument("--mode", default="0755", help="octal mode of the mount's root (1777 for shmDir)")
    ap.add_argument("--label", default="regionDir", choices=("regionDir", "shmDir"), help="what PATH is, for the log")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[0-7]{3,4}", args.mode):
        sys.stderr.write(f"error: bad --mode {args.mode[:40]!r}: expected an octal mode such as 0755 or 1777\n")
        return 2
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    if not os.path.isabs(args.path) or not 1 <= args.inodes <= 1 << 24:
        sys.stderr.write(f"error: bad arguments {args.path!r} --inodes {args.inodes}: expected an absolute path "
                         f"and 1..{1 << 24} inodes\n")
        return 2
    try:
        sys.stdout.write(ensure_tmpfs(args.path, size, args.inodes, int(args.mode, 8), args.label) + "\n")
    except OSError as exc:
        sys.stderr.write(f"error: {exc.strerror if exc.strerror else exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
