"""regionDir on a size-limited tmpfs: what pods write is bounded, the plugin's state (outside
regionDir) and Allocate for other pods keep working when one pod fills it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpsd.plugin import regionfs

from tests.plugin.conftest import allocate, gpus, stub

MOUNTINFO = (
    "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
    "40 22 0:35 / /var/lib/mpsd/regions rw,nosuid,nodev,noexec shared:20 - tmpfs tmpfs "
    "rw,size=262144k,nr_inodes=16384,mode=755\n"
    "41 22 0:36 / /mnt/with\\040space rw - tmpfs tmpfs rw,size=1024k\n"
    "42 40 0:37 / /var/lib/mpsd/regions rw - ext4 /dev/sdb rw\n"
)


def test_mountinfo_is_parsed_and_the_top_mount_wins():
    mounts = regionfs.parse_mountinfo(MOUNTINFO)
    assert [(m.mount_point, m.fstype) for m in mounts][:3] == [
        ("/", "ext4"), ("/var/lib/mpsd/regions", "tmpfs"), ("/mnt/with space", "tmpfs")]
    assert mounts[1].options["size"] == "262144k" and mounts[1].options["nr_inodes"] == "16384"
    assert regionfs.mount_at("/var/lib/mpsd/regions", MOUNTINFO).fstype == "ext4"  # stacked on top
    assert regionfs.mount_at("/var/lib/mpsd", MOUNTINFO) is None


@pytest.mark.parametrize("text, size", [("1024", 1024), ("64Ki", 65536), ("256Mi", 256 << 20), ("1G", 1 << 30)])
def test_parse_size(text, size):
    assert regionfs.parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "", "-1", "1.5Gi", "1Ti", "9" * 5000, "256MB"])
def test_parse_size_rejects_with_one_line(text):
    with pytest.raises(ValueError, match="bad size") as info:
        regionfs.parse_size(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


def test_cli_bad_size_is_exit_2_and_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpsd.plugin.regionfs", str(tmp_path / "r"), "lots"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "bad size 'lots'" in proc.stderr


@pytest.fixture
def region_tmpfs(env):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = env.paths.region_dir
    proc = subprocess.run([sys.executable, "-m", "mpsd.plugin.regionfs", path, "1Mi", "--inodes", "64"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.stdout == f"regionDir {path} mounted: tmpfs size=1048576 nr_inodes=64\n"
    yield path
    subprocess.run(["umount", path], check=True)


def test_mounting_twice_leaves_the_first_mount(region_tmpfs):
    marker = os.path.join(region_tmpfs, "alloc-0000000000000000-000000000000")
    os.mkdir(marker)
    proc = subprocess.run([sys.executable, "-m", "mpsd.plugin.regionfs", region_tmpfs, "1Mi"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "already" in proc.stdout
    with open("/proc/self/mountinfo") as f:
        assert sum(1 for m in regionfs.parse_mountinfo(f.read()) if m.mount_point == region_tmpfs) == 1
    assert os.path.isdir(marker)  # nothing hidden under a second mount


def test_a_pod_filling_its_directory_is_bounded_and_other_pods_still_allocate(env, kubelet, region_tmpfs, caplog):
    g = gpus(80)
    plugin = env.plugin(g)
    with caplog.at_level("INFO", logger="mpsd.plugin"):
        plugin.start()
    try:
        assert f"regionDir {region_tmpfs} is a tmpfs size=1024k" in caplog.text
        _, s = stub(plugin)
        mine = {m.container_path: m.host_path for m in allocate(s, [f"{g[0].uuid}::0"]).container_responses[0].mounts}
        written = 0
        fd = os.open(os.path.join(mine["/run/mpsd"], "fill"), os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            while written < 64 << 20:
                n = os.write(fd, b"x" * 65536)
                written += n
                if n < 65536:
                    break
        except OSError as exc:
            assert exc.strerror == "No space left on device"
        finally:
            os.close(fd)
        assert written <= 1 << 20  # the hostile pod is bounded by the tmpfs, not by the node's disk
        other = allocate(s, [f"{g[0].uuid}::1"]).container_responses[0]  # a directory takes no blocks
        assert os.path.isdir({m.container_path: m.host_path for m in other.mounts}["/run/mpsd"])
        created = 0
        try:
            while created < 10_000:  # and empty files: bounded by nr_inodes
                os.close(os.open(os.path.join(mine["/run/mpsd"], f"f{created}"), os.O_WRONLY | os.O_CREAT, 0o666))
                created += 1
        except OSError:
            pass
        assert created < 64
        # with every inode taken, the next Allocate is refused with one line (docs/kubernetes.md:
        # the bound is per node) until the filling pod's allocation is collected
        import grpc

        with pytest.raises(grpc.RpcError) as info:
            allocate(s, [f"{g[0].uuid}::2"])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "cannot create region directory" in info.value.details() and "\n" not in info.value.details()
        (filler,) = [a for a in plugin.store.all() if a.region_dir == mine["/run/mpsd"]]
        plugin.tracker.collect([filler])
        allocate(s, [f"{g[0].uuid}::2"])
        plugin.store.compact()  # the state lives elsewhere: still written
        assert os.path.getsize(env.state_path) > 0 and not env.state_path.is_relative_to(region_tmpfs)
    finally:
        plugin.stop()


def test_shm_dir_gets_a_sticky_world_writable_tmpfs_named_as_such(tmp_path):
    # ipcMode tmpfs: shmDir is every GPU pod's /dev/shm; bounded like regionDir, and mode 1777
    # like any /dev/shm (clients of any UID create segments; only owners remove theirs)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = str(tmp_path / "shm")
    proc = subprocess.run([sys.executable, "-m", "mpsd.plugin.regionfs", path, "1Mi", "--inodes", "64",
                           "--mode", "1777", "--label", "shmDir"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "cannot mount" in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        assert proc.stdout == f"shmDir {path} mounted: tmpfs size=1048576 nr_inodes=64 mode=1777\n", proc.stderr
        assert os.stat(path).st_mode & 0o7777 == 0o1777
        assert regionfs.describe(path).startswith("tmpfs size=1024k nr_inodes=64")
    finally:
        subprocess.run(["umount", path], check=False)


@pytest.mark.parametrize("mode", ["777x", "17777", "-1", ""])
def test_cli_bad_mode_is_exit_2_and_one_line(tmp_path, mode):
    proc = subprocess.run([sys.executable, "-m", "mpsd.plugin.regionfs", str(tmp_path / "r"), "1Mi", "--mode", mode],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "mode" in proc.stderr, proc.stderr


def _mounts_at(path):
    with open("/proc/self/mountinfo") as f:
        return [m for m in regionfs.parse_mountinfo(f.read()) if m.mount_point == path]


def test_two_mounters_of_one_path_make_one_mount(tmp_path):
    # ipcMode tmpfs: mpsd's and the daemon holder's init containers both mount shmDir and may
    # start at once. The check and the mount are done under a lock on the parent directory:
    # here the test holds it, mounts as "the other pod" would, and lets go; the CLI, started
    # while the lock was held, must then find that mount and add none on top of it.
    import fcntl
    import time

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = str(tmp_path / "shm")
    os.mkdir(path)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(parent, fcntl.LOCK_EX)
    proc = subprocess.Popen([sys.executable, "-m", "mpsd.plugin.regionfs", path, "1Mi", "--inodes", "64",
                             "--mode", "1777", "--label", "shmDir"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(1.0)  # room for an unlocked CLI to mount now; a locked one waits whatever the time
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", path],
                                 capture_output=True, text=True, timeout=60)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
        os.close(parent)  # releases the lock
        parent = -1
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.startswith(f"shmDir {path} is a tmpfs size=1024k ") and out.endswith(" already, left as it is\n")
        assert len(_mounts_at(path)) == 1
    finally:
        if parent >= 0:
            os.close(parent)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        while _mounts_at(path):
            subprocess.run(["umount", path], check=True)


def test_a_mounter_waits_for_the_lock_a_bounded_time(tmp_path):
    import fcntl

    path = str(tmp_path / "shm")
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(parent, fcntl.LOCK_EX)
    try:
        with pytest.raises(OSError, match="another mounter held the lock on its parent directory for 0.2s"):
            regionfs.ensure_tmpfs(path, 1 << 20, lock_wait=0.2)
    finally:
        os.close(parent)
    assert _mounts_at(path) == []
