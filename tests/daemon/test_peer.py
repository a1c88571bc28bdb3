"""mpsd.daemon.peer and mpsd.daemon.drift: the pure parts by tables, the kernel's answers with real sockets
and processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mpsd.daemon import drift, peer

POD = "0c3e5f4a-1b2c-4d5e-8f90-a1b2c3d4e5f6"
CID = "3f" * 32
OTHER = "ab" * 32  # another container's ID
OTHER_POD = "9d8e7f6a-5b4c-4d3e-8f2a-1b0c9d8e7f6a"


@pytest.mark.parametrize(
    "maps, expected",
    [
        ("7f00-7f10 r-xp 00000000 fe:00 12 /usr/lib/x86_64-linux-gnu/libcuda.so.535.261.03\n", True),
        ("7f00-7f10 r-xp 00000000 fe:00 12 /opt/fake/libcuda.so.1\n", True),
        ("7f00-7f10 r-xp 00000000 fe:00 12 /usr/lib/libcuda.so\n", True),
        ("7f00-7f10 r-xp 00000000 fe:00 12 /usr/lib/libcudart.so.12\n", False),
        ("7f00-7f10 r-xp 00000000 fe:00 12 /tmp/libcuda.so.1.evil/libm.so.6\n", False),
        ("", False),
    ],
)
def test_maps_cuda_driver(maps, expected):
    assert peer.maps_cuda_driver(maps) is expected


@pytest.mark.parametrize(
    "cgroup, expected",
    [
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/"
            f"cri-containerd-{CID}.scope\n",
            f"pod {POD} container {CID[:12]}",
        ),
        (f"0::/kubepods/besteffort/pod{POD}/{CID}\n", f"pod {POD} container {CID[:12]}"),
        (f"12:memory:/kubepods/pod{POD}/{CID}\n0::/\n", f"pod {POD} container {CID[:12]}"),
        (f"0::/machine.slice/libpod-{CID}.scope/container\n", f"container {CID[:12]}"),
        (f"0::/libpod_parent/libpod-{CID}\n", f"container {CID[:12]}"),
        (f"0::/machine.slice/libpod-{CID}.scope\n", f"container {CID[:12]}"),
        ("0::/user.slice/user-1000.slice/session-2.scope\n", ""),
        # read at fixed depths: a child cgroup a container makes (cgroup v2 delegation) is not read
        (f"0::/libpod_parent/libpod-{CID}/{OTHER}\n", f"container {CID[:12]}"),
        (f"0::/kubepods/besteffort/pod{POD}/{CID}/{OTHER}/pod{OTHER_POD}/{OTHER}\n", f"pod {POD} container {CID[:12]}"),
        (f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope/x/{OTHER}\n",
         f"pod {POD} container {CID[:12]}"),
        # a path under another root (a user's delegated tree, a rootless runtime) names no one
        (f"0::/user.slice/user-1000.slice/user@1000.service/kubepods/pod{POD}/{CID}\n", ""),
        (f"0::/mpsd-test/kubepods/besteffort/pod{POD}/{CID}\n", ""),
        (f"0::/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope\n", ""),
        (f"0::/{CID}\n", ""),
        # above a cgroup namespace (mpsd in a pod of its own), a kind node's kubelet root
        (f"0::/../../kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
         f"pod {POD} container {CID[:12]}"),
        (f"0::/../../user.slice/user-1000.slice/user@1000.service/kubepods/pod{POD}/{CID}\n", ""),
        (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
         f"kubelet-kubepods-besteffort-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n", f"pod {POD} container {CID[:12]}"),
        ("0::/\n", ""),
        ("", ""),
    ],
)
def test_cgroup_owner(cgroup, expected):
    assert peer.cgroup_owner(cgroup) == expected


def test_listener_pid_is_the_process_that_listens_not_the_one_that_named_the_socket(tmp_path):
    path = str(tmp_path / "control")
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.bind(sys.argv[1]); s.listen(4)\n"
        "print('up', flush=True); sys.stdin.read()\n"
    )
    argv = [sys.executable, "-c", code, path]
    other = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "up\n"
        assert peer.listener_pid(path) == other.pid
        found = peer.impostor(str(tmp_path), os.getpid(), ("control",))
        assert f"pid {other.pid}" in found and "not by the daemon" in found
        assert peer.impostor(str(tmp_path), other.pid, ("control",)) == ""
    finally:
        other.stdin.close()
        other.wait(10)
    assert peer.listener_pid(path) is None  # a socket file nobody listens on
    assert peer.listener_pid(str(tmp_path / "missing")) is None
    (tmp_path / "plain").write_text("")
    assert peer.listener_pid(str(tmp_path / "plain")) is None


def test_a_socket_listened_on_by_this_process_is_seen_as_this_process(tmp_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.bind(str(tmp_path / "control_privileged"))
        s.listen(1)
        assert peer.impostor(str(tmp_path), os.getpid()) == ""


def test_describe_names_the_command_and_survives_a_gone_process():
    assert peer.describe(os.getpid()).startswith(f"pid {os.getpid()} (")
    assert peer.describe(2**22 + 12345) == f"pid {2**22 + 12345}"


def test_mpsds_own_probe_not_yet_closed_by_the_daemon_is_no_session_holder(tmp_path):
    # The impostor check connects to the control sockets; a health check right after it could
    # find the daemon still holding that accepted socket and call mpsd itself the holder (seen
    # as a flaky test_two_unanswered_health_checks_in_a_row_kill_the_daemon under load).
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(str(tmp_path / "control"))
        listener.listen(4)
        code = (
            "import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sys.argv[1]); time.sleep(60)"
        )
        other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "control")])
        own = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        held: list[socket.socket] = []
        try:
            own.connect(str(tmp_path / "control"))
            held += [listener.accept()[0], listener.accept()[0]]
            assert peer.socket_peers(os.getpid(), {str(tmp_path / "control")}) == {os.getpid(), other.pid}
            assert peer.session_holders(os.getpid(), str(tmp_path)) == [other.pid]
        finally:
            own.close()
            for conn in held:
                conn.close()
            other.kill()
            other.wait()


def test_an_mps_client_is_shown_by_the_kernel_not_by_its_environment(tmp_path):
    # A "daemon" and a "server" that hold accepted sockets, a process connected to the server:
    # SO_PEERCRED names it; one connected nowhere is refused whatever its environment says.
    server = tmp_path / "server"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(server))
        listener.listen(4)
        code = "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); time.sleep(60)"
        connected = subprocess.Popen([sys.executable, "-c", code, str(server)])
        sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
        alone = subprocess.Popen(sleep, env={"CUDA_MPS_PIPE_DIRECTORY": "/x"})
        try:
            accepted, _ = listener.accept()
            with accepted:
                assert peer.socket_peers(os.getpid()) >= {connected.pid}
                assert connected.pid in peer.socket_peers(os.getpid(), {str(server)})
                assert connected.pid not in peer.socket_peers(os.getpid(), {str(tmp_path / "control")})
                assert peer.mps_client_problem(connected.pid, 2**22 + 1, [os.getpid()]) == (
                    "it maps no CUDA driver (libcuda.so)"  # shown connected; python maps no driver
                )
                problem = peer.mps_client_problem(alone.pid, 2**22 + 1, [os.getpid()])
                assert "no socket of the MPS control daemon" in problem and str(os.getpid()) in problem
        finally:
            for proc in (connected, alone):
                proc.kill()
                proc.wait()
    assert "cannot read" in peer.mps_client_problem(2**22 + 12345, 1, [])


WANT = drift.Defaults(60.0, {0: 2 << 30, 1: None}, 0)


@pytest.mark.parametrize(
    "got, expected",
    [
        (WANT, []),
        (drift.Defaults(60.04, {0: 2 << 30, 1: None}, 0), []),
        (drift.Defaults(1.0, {0: 2 << 30, 1: None}, 0), ["activeThreadPercentage 1 (config 60)"]),
        (drift.Defaults(60.0, {0: 1 << 20, 1: None}, 0), [f"pinnedMemLimit device 0 {1 << 20} (config {2 << 30})"]),
        (drift.Defaults(60.0, {0: 2 << 30, 1: 1 << 20}, 0), [f"pinnedMemLimit device 1 {1 << 20} (config None)"]),
        (drift.Defaults(60.0, {0: 2 << 30, 1: None}, 1), ["clientPriority 1 (config 0)"]),
    ],
)
def test_drift_differences(got, expected):
    assert drift.differences(WANT, got) == expected


def test_drift_watches_managed_ordinals_unless_a_limit_is_keyed_by_uuid():
    from mpsd import config as cfg

    plain = cfg.load(None, {}, {"pinned-mem-limit": "0=2G"})
    assert drift.watched(plain, {0, 1}) == {0, 1}
    by_uuid = cfg.load(None, {}, {"pinned-mem-limit": "0=2G,GPU-8f6c1a2b-0000-1111-2222-333344445555=1G"})
    assert drift.watched(by_uuid, {0, 1}) == {0}
    assert drift.expected(plain, {1}).pinned_mem_limit == {0: 2 << 30, 1: None}
