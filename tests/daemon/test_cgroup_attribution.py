"""Who mpsd names from a process's cgroup (issue 33, row 9), as the attack runs: a container
that makes a child cgroup of its own named with another container's 64-hex ID (what cgroup v2
delegation lets it do), and a UID-1000 process on a bare host in a delegated tree it can write,
laid out like the kubelet's. mpsd names the container from its own cgroup at a fixed depth,
and names no pod from a path a user can write. Real podman containers and real cgroups."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from mpsd.daemon import peer
from tests.lifecycle.test_supervisor import wait_until

CGROUP_ROOT = Path("/sys/fs/cgroup")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making cgroups and moving processes needs root")


def hierarchies(pid: int) -> list[tuple[Path, str]]:
    """(mounted hierarchy, the process's path in it) for the hierarchies without controllers in
    /proc/PID/cgroup: the unified v2 one and v1's name=systemd (what a delegated tree is; a v1
    controller such as cpuset would need setting up first)."""
    found = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers not in ("", "name=systemd"):
            continue
        name = controllers.removeprefix("name=") or "unified"
        mount = CGROUP_ROOT / name
        if not controllers and not (mount / "cgroup.procs").exists():
            mount = CGROUP_ROOT  # a pure v2 machine
        if (mount / "cgroup.procs").exists():
            found.append((mount, path))
    return found


class Moved:
    """Moves ``pid`` into ``relative`` (made below ``under(path)`` in every hierarchy it is in);
    undo() moves it back and removes what was made."""

    def __init__(self, pid: int, relative: str, under=lambda path: path, owner: int | None = None) -> None:
        self.pid, self.made = pid, []
        for mount, path in hierarchies(pid):
            base = mount / under(path).lstrip("/")
            target = base / relative
            target.mkdir(parents=True, exist_ok=True)
            if owner is not None:  # delegated: the tree belongs to the user
                for d in [target, *target.relative_to(base).parents]:
                    os.chown(base / d, owner, owner)
            (target / "cgroup.procs").write_text(str(pid))
            self.made.append((mount, path, base, target))

    def undo(self) -> None:
        for mount, path, base, target in self.made:
            try:
                (mount / path.lstrip("/") / "cgroup.procs").write_text(str(self.pid))
            except OSError:
                pass  # gone already
            for d in [target, *[base / p for p in target.relative_to(base).parents if str(p) != "."]]:
                try:
                    d.rmdir()
                except OSError:
                    pass


def test_a_child_cgroup_named_with_another_containers_id_is_not_taken_for_that_container(podman):
    other = uuid.uuid4().hex * 2  # 64 hex digits: another container's ID, as a pod would copy it
    marker = f"sleep {int(time.time()) % 1000 + 1000}"
    run = threading.Thread(target=podman.run, args=(["sh", "-c", marker],), kwargs={"timeout": 120}, daemon=True)
    run.start()
    pid = int(wait_until_found(marker))
    own = peer.describe(pid)
    assert "container " in own, own
    moved = Moved(pid, other)
    try:
        assert any(other in line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
        named = peer.describe(pid)
        assert named == own and f"container {other[:12]}" not in named, named
    finally:
        moved.undo()
        os.kill(pid, 9)
        run.join(60)


def test_a_users_delegated_tree_laid_out_like_the_kubelets_names_no_pod(tmp_path):
    # A bare host: root delegated a cgroup tree to UID 1000 (as systemd does with user@.service);
    # the user lays it out as the kubelet would and runs its process there.
    pod, container = str(uuid.uuid4()), uuid.uuid4().hex * 2
    proc = subprocess.Popen(["sleep", "120"], user=1000, group=1000, extra_groups=[])
    tree = f"mpsd-test-{uuid.uuid4().hex[:8]}"
    moved = Moved(proc.pid, f"{tree}/kubepods/besteffort/pod{pod}/{container}", under=lambda path: "/", owner=1000)
    try:
        text = Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert f"pod{pod}" in text, text
        named = peer.describe(proc.pid)
        assert "pod " not in named and "container " not in named, named
    finally:
        proc.kill()
        proc.wait()
        moved.undo()


def wait_until_found(command: str) -> str:
    found: list[str] = []

    def look() -> bool:
        out = subprocess.run(["pgrep", "-fx", command], capture_output=True, text=True).stdout.split()
        found[:] = out
        return len(out) == 1

    wait_until(look, timeout=90, what=f"the container's {command!r}")
    return found[0]
