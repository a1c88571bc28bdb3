"""``ipcMode: tmpfs``: every GPU pod's /dev/shm is the node's shmDir, shared read-write.

Real containers (podman + runc) get the mounts of the plugin's Allocate response over a real
size-limited tmpfs (``python -m mpsd.plugin.regionfs ... --mode 1777 --label shmDir``, as the
overlay's init container runs it), and show what docs/security.md says one pod can do to
another's shared memory: fill it (up to the bound), read and overwrite it when it runs as the
same UID or as root, but not read a 0600 segment of another UID nor remove one (sticky bit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpsd.alloc.container import HostPaths, container_mounts
from mpsd.daemon import dirs
from mpsd.alloc.slicing import plan_allocation
from tests.container import HOST_LIBS, Mount
from tests.mpsbin import FetchError, ensure_mps_control

from tests.plugin.conftest import gpus

SIZE = 1 << 20


@pytest.fixture
def shm_dir(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "shm"
    proc = subprocess.run([sys.executable, "-m", "mpsd.plugin.regionfs", str(path), str(SIZE), "--inodes", "256",
                           "--mode", "1777", "--label", "shmDir"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "cannot mount" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    yield path
    subprocess.run(["umount", str(path)], check=False)


def pod_mounts(shm: Path, tmp: Path, name: str) -> list[Mount]:
    """What Allocate hands a container in tmpfs mode (its own region dir, the shared /dev/shm)."""
    region = tmp / "regions" / name
    region.mkdir(parents=True)
    (tmp / "lib").mkdir(exist_ok=True)
    pipe = tmp / "pipe"
    pipe.mkdir(exist_ok=True)
    paths = HostPaths(pipe_dir=str(pipe), region_dir=str(region.parent), shim_host_dir=str(tmp / "lib"),
                      ipc_mode="tmpfs", shm_dir=str(shm))
    plan = plan_allocation([f"{gpus(80)[0].uuid}::0"], gpus(80), 10)
    dirs.keep_log_target(str(pipe))  # as the backend's grant does: the target of the mount over `log`
    mounts = [Mount(m.host, m.container, m.read_only) for m in container_mounts(plan, paths, str(region))]
    assert Mount(str(shm), "/dev/shm", read_only=False) in mounts
    return mounts


def test_another_uids_pod_cannot_read_or_remove_a_private_segment_but_can_fill_dev_shm(podman, shm_dir, tmp_path):
    a = podman.run(["sh", "-c", "umask 077; echo secret > /dev/shm/a.seg && ls -ln /dev/shm/a.seg"],
                   mounts=pod_mounts(shm_dir, tmp_path, "a"), user="1000:1000")
    assert a.returncode == 0 and a.stdout.startswith("-rw-------"), a.output
    b = podman.run(
        ["sh", "-c", "cat /dev/shm/a.seg && echo READ; rm -f /dev/shm/a.seg && echo REMOVED; "
                     "dd if=/dev/zero of=/dev/shm/fill bs=65536 count=1024 2>&1; true"],
        mounts=pod_mounts(shm_dir, tmp_path, "b"), user="1001:1001")
    assert b.returncode == 0, b.output
    assert "READ" not in b.stdout and "REMOVED" not in b.stdout, b.output
    assert "No space left on device" in b.stdout, b.output
    assert (shm_dir / "fill").stat().st_size <= SIZE  # bounded by the tmpfs, not the node's memory
    # the filler has taken every page: another pod's new segment fails, until the filler's go
    full = podman.run(["sh", "-c", "echo more > /dev/shm/a2.seg"], mounts=pod_mounts(shm_dir, tmp_path, "a2"),
                      user="1000:1000")
    assert full.returncode != 0 and "No space left on device" in full.stderr, full.output
    (shm_dir / "fill").unlink()
    again = podman.run(["sh", "-c", "echo more > /dev/shm/a2.seg"], mounts=pod_mounts(shm_dir, tmp_path, "a3"),
                       user="1000:1000")
    assert again.returncode == 0, again.output


@pytest.mark.parametrize("user", ["1000:1000", None], ids=["same-uid", "root"])
def test_a_pod_of_the_same_uid_or_root_reads_and_overwrites_anothers_segment(podman, shm_dir, tmp_path, user):
    a = podman.run(["sh", "-c", "umask 077; echo secret > /dev/shm/a.seg"],
                   mounts=pod_mounts(shm_dir, tmp_path, "a"), user="1000:1000")
    assert a.returncode == 0, a.output
    c = podman.run(["sh", "-c", "cat /dev/shm/a.seg && echo overwritten > /dev/shm/a.seg"],
                   mounts=pod_mounts(shm_dir, tmp_path, "c"), user=user)
    assert c.returncode == 0 and c.stdout == "secret\n", c.output
    assert (shm_dir / "a.seg").read_text() == "overwritten\n"


def test_the_control_daemon_and_a_server_without_a_gpu_create_nothing_in_dev_shm(podman, shm_dir, tmp_path):
    # What MPS itself puts in /dev/shm is made by its servers and clients on a GPU
    # (tests/gpu/test_pipe_dir_readonly_gpu.py records it); the daemon alone creates nothing.
    try:
        control = ensure_mps_control(Path(os.environ.get("MPSD_TEST_MPS_CACHE", "") or
                                          Path(__file__).resolve().parents[2] / ".cache" / "mps"))
    except FetchError as exc:
        pytest.fail(f"cannot fetch the real nvidia-cuda-mps-control: {exc}", pytrace=False)
    server = control.parents[1] / "sbin" / "nvidia-cuda-mps-server"
    script = (
        "nvidia-cuda-mps-control -d || exit 9; echo 'start_server -uid 1000' | nvidia-cuda-mps-control; "
        "i=0; until grep -q 'exited with status' /var/log/nvidia-mps/control.log; do "
        "i=$((i+1)); [ $i -gt 600 ] && exit 8; sleep 0.1; done; "
        "echo quit | nvidia-cuda-mps-control; sleep 1; ls -A /dev/shm"
    )
    started = time.monotonic()
    result = podman.run(
        ["sh", "-c", script],
        mounts=[*pod_mounts(shm_dir, tmp_path, "d"), *HOST_LIBS, Mount(control, "/usr/bin/nvidia-cuda-mps-control"),
                Mount(server, "/usr/bin/nvidia-cuda-mps-server")],
        extra=["--tmpfs", "/tmp/nvidia-mps", "--tmpfs", "/var/log/nvidia-mps"],
        timeout=180,
    )
    assert result.returncode == 0, result.output
    assert result.stdout.strip() == "" and os.listdir(shm_dir) == [], (result.output, time.monotonic() - started)


def test_the_plugin_says_at_start_what_bounds_shm_dir(env, kubelet, shm_dir, caplog):
    import dataclasses

    unbounded = env.root / "plain-shm"
    unbounded.mkdir()
    for path, expected in ((shm_dir, f"shmDir {shm_dir} is a tmpfs size=1024k nr_inodes=256"),
                           (unbounded, f"shmDir {unbounded} is not a tmpfs of its own")):
        env.paths = dataclasses.replace(env.paths, ipc_mode="tmpfs", shm_dir=str(path))
        plugin = env.plugin(gpus(80))
        caplog.clear()
        with caplog.at_level("INFO", logger="mpsd.plugin"):
            plugin.start()
        plugin.stop()
        assert expected in caplog.text, caplog.text
