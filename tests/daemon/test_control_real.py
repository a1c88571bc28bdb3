"""Every control command against the real nvidia-cuda-mps-control, each Debian version of it
(MPSD_TEST_MPS_VERSIONS; no GPU needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from mpsd.daemon import dirs
from mpsd.daemon.control import CommandRejected, Control, UnknownCommand
from mpsd.errors import ControlBusy, ControlTimeout, DaemonNotRunning
from tests.mpsbin import knows_server_status
from tests.mpsfixtures import FrontEndHolder

pytestmark = [pytest.mark.mps_binary, pytest.mark.every_mps_version]
G, M = 1 << 30, 1 << 20


@pytest.fixture
def daemon(mps_control, mps_dirs):
    """A bare ``-f`` daemon (no supervisor) and a Control for it; killed at teardown."""
    pipe, logs = mps_dirs
    dirs.prepare(str(pipe), str(logs))
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    proc = subprocess.Popen(
        [str(mps_control), "-f"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    control = Control(str(mps_control), str(pipe), str(logs), timeout=10)
    deadline = time.monotonic() + 20
    while True:
        try:
            control.get_server_list()
            break
        except DaemonNotRunning:
            assert time.monotonic() < deadline, "daemon did not start listening"
            time.sleep(0.05)
    yield control, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_defaults_set_and_read_back(daemon):
    control, _ = daemon
    assert control.get_default_active_thread_percentage() == 100.0
    assert control.set_default_active_thread_percentage(25) == 25.0
    assert control.get_default_active_thread_percentage() == 25.0
    control.set_default_device_pinned_mem_limit(0, "2G")
    control.set_default_device_pinned_mem_limit(1, "1044M")
    assert control.get_default_device_pinned_mem_limit(0) == 2 * G
    assert control.get_default_device_pinned_mem_limit(1) == 1 * G  # the daemon's lossy display
    assert control.get_default_device_pinned_mem_limit(2) is None  # never set
    control.set_default_client_priority(1)
    assert control.get_default_client_priority() == 1


def test_rejected_percentage_leaves_old_value_and_exit_0(daemon):
    control, _ = daemon
    control.set_default_active_thread_percentage(30)
    # The daemon refuses 250 but prints the value still in force, with exit status 0.
    assert control.set_default_active_thread_percentage(250) == 30.0


def test_rejections_raise(daemon):
    control, _ = daemon
    with pytest.raises(CommandRejected, match="Invalid priority value"):
        control.set_default_client_priority(5)
    with pytest.raises(CommandRejected, match="Server 999 not found"):
        control.shutdown_server(999)
    with pytest.raises(CommandRejected, match="Server 12 not found"):
        control.get_client_list(12)
    with pytest.raises(CommandRejected, match="Server 5 not found"):
        control.set_active_thread_percentage(5, 20)
    with pytest.raises(CommandRejected, match="Server 5 not found"):
        control.set_device_pinned_mem_limit(5, 0, "1G")
    with pytest.raises(CommandRejected, match="Server 1 not found"):
        control.terminate_client(1, 2)
    with pytest.raises(UnknownCommand, match="bogus"):
        control.call("bogus")


def test_server_commands_without_gpu(daemon, mps_version):
    control, _ = daemon
    assert control.get_server_list() == []
    assert control.ps() == []  # "Server not found" means no clients
    assert control.get_device_client_list() == {}
    control.start_server(os.getuid())  # accepted; the server exits at once without a GPU
    if knows_server_status(mps_version):  # 550+: the command is known, the server is not
        with pytest.raises(CommandRejected, match="Server 1 not found") as raised:
            control.get_server_status(1)
        assert not isinstance(raised.value, UnknownCommand)
    else:
        with pytest.raises(UnknownCommand):  # 535 has no get_server_status
            control.get_server_status(1)


def test_quit_stops_the_daemon(daemon):
    control, proc = daemon
    control.quit(timeout_s=2)
    assert proc.wait(10) is not None
    with pytest.raises(DaemonNotRunning):
        control.get_server_list()


def test_no_daemon_is_daemon_not_running(mps_control, tmp_path):
    control = Control(str(mps_control), str(tmp_path), timeout=10)
    with pytest.raises(DaemonNotRunning, match="Cannot find MPS control daemon"):
        control.get_default_active_thread_percentage()


def test_stopped_daemon_times_out(daemon):
    control, proc = daemon
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(ControlTimeout):
            control.call("get_server_list", timeout=0.5)
        assert time.monotonic() - began < 8
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_missing_binary_is_control_error(tmp_path):
    from mpsd.errors import ControlError

    with pytest.raises(ControlError, match="cannot run control binary"):
        Control(str(tmp_path / "nope"), str(tmp_path)).get_server_list()


class SendsOutOfRange(Control):
    """Sends 250 whatever percentage it is asked to set: the daemon refuses it with exit 0."""

    def batch(self, commands, timeout=None):
        refused = "set_default_active_thread_percentage 250"
        return super().batch([refused if c.startswith("set_default_active") else c for c in commands], timeout)


def test_settle_sets_and_reads_back_the_defaults_in_one_session(daemon):
    from mpsd import config as cfg
    from mpsd.daemon import drift

    control, _ = daemon
    config = cfg.load(
        None, {}, {"active-thread-percentage": "50", "pinned-mem-limit": "0=1536M,1=100M", "client-priority": "1"}
    )
    assert drift.settle(control, config, {0, 1, 2}) == []
    assert control.get_default_active_thread_percentage() == 50.0
    assert control.get_default_device_pinned_mem_limit(0) == 1 * G
    assert control.get_default_device_pinned_mem_limit(1) == 100 * M
    assert control.get_default_client_priority() == 1
    assert drift.read(control, config, {0, 1, 2}) == drift.expected(config, {0, 1, 2})
    # a reload that drops device 1 and the priority: unset, read back unset
    smaller = cfg.load(None, {}, {"active-thread-percentage": "50", "pinned-mem-limit": "0=1536M"})
    assert drift.settle(control, smaller, {0}, previous=config) == []
    assert control.get_default_device_pinned_mem_limit(1) is None and control.get_default_client_priority() == 0
    rejecting = SendsOutOfRange(control.binary, control.pipe_dir, timeout=10)
    assert drift.settle(rejecting, cfg.load(None, {}, {"active-thread-percentage": "25"}), {0}) == [
        "activeThreadPercentage 50 (config 25)"
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="a writer of another UID needs root")
def test_no_writer_comes_between_a_default_set_and_its_read_back(daemon, mps_control, mps_version):
    # The daemon serves one front-end at a time: within mpsd's one session a writer looping on
    # `control` cannot change the value between set and read-back (issue 21, defect 1). The 550
    # and later daemons take set_default_* only from root and their own user (docs/security.md):
    # there the writer is a root pod, the one that can.
    from mpsd import config as cfg
    from mpsd.daemon import drift
    from tests.lifecycle.test_defaults_race import NOBODY, start_writer, stop_writer

    control, _ = daemon
    config = cfg.load(None, {}, {"active-thread-percentage": "60"})
    uid = NOBODY if mps_version.startswith("535") else None
    writer = start_writer(str(mps_control), control.pipe_dir, uid=uid)
    try:
        deadline = time.monotonic() + 20
        while control.get_default_active_thread_percentage() != 1.0:  # the writer is in
            assert time.monotonic() < deadline, "the writer never changed the default"
        assert [drift.settle(control, config, {0}) for _ in range(100)] == [[]] * 100
    finally:
        stop_writer(writer)


class WithServers(Control):
    """The real front-end, pretending servers 777 (gone: the daemon answers "not found")
    and ``live`` exist; per-server commands to ``live`` are recorded instead of sent."""

    def __init__(self, *args, live: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.live, self.sent = live, []

    def get_server_list(self):
        return [777, self.live] + super().get_server_list()

    def call(self, command, timeout=None):
        if command.split()[1:2] == [str(self.live)]:
            self.sent.append(command)
            # set_active_thread_percentage echoes the value now in force (NVIDIA's docs)
            return f"{float(command.split()[-1])}\n" if command.startswith("set_active") else ""
        return super().call(command, timeout)


def test_servers_started_before_the_defaults_get_them_per_server(daemon):
    from mpsd import config as cfg
    from mpsd.daemon.control import limit_early_servers

    control, _ = daemon
    fake = WithServers(control.binary, control.pipe_dir, timeout=10, live=4242)
    config = cfg.load(None, {}, {"active-thread-percentage": "30", "pinned-mem-limit": "0=2G,1=1044M"})
    assert limit_early_servers(fake, config) == [4242]  # 777 is "not found" on the real daemon
    assert fake.sent == [
        "set_active_thread_percentage 4242 30",
        "set_device_pinned_mem_limit 4242 0 2G",
        "set_device_pinned_mem_limit 4242 1 1044M",
    ]
    assert limit_early_servers(control, config) == []  # no server: nothing to do


def test_a_front_end_held_open_makes_commands_wait_then_busy(daemon, mps_control):
    control, _ = daemon
    holder = FrontEndHolder(str(mps_control), control.pipe_dir)
    try:
        began = time.monotonic()
        with pytest.raises(ControlBusy, match="another front-end holds its control connection"):
            control.call("get_server_list", timeout=0.5)
        assert time.monotonic() - began >= 0.4  # tried again until the timeout
        timer = threading.Timer(0.5, holder.release)
        timer.start()
        assert control.get_default_active_thread_percentage() == 100.0  # once the holder leaves
        timer.join()
    finally:
        holder.release()


class NoGpus:
    def gpus(self):
        return []

    def mps_clients(self):
        return []


def test_status_of_a_held_daemon_is_busy_not_down(daemon, mps_control, mps_dirs):
    from mpsd import config as cfg
    from mpsd.status import collect_status

    control, _ = daemon
    config = cfg.load(
        None,
        {},
        {"control-binary": str(mps_control), "pipe-dir": control.pipe_dir, "health-timeout": "0.5s"},
    )
    holder = FrontEndHolder(str(mps_control), control.pipe_dir)
    try:
        data = collect_status(config, inventory=NoGpus())
    finally:
        holder.release()
    assert data["daemon"] == "busy" and "another front-end holds" in data["error"]
