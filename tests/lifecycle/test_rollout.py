"""``daemonLifecycle: independent``: mpsd run stops, is killed or restarts with another config,
and the control daemon, its defaults, its servers and an ``mpsd exec`` client go on as if nothing
happened. Real ``mpsd run`` and ``mpsd holder`` processes and the real control daemon; the timed
version of the same rounds is benchmarks/rollout.py."""

from __future__ import annotations

import signal

import pytest

from tests.rollout import Node, read, stop, wait_until

pytestmark = pytest.mark.mps_binary
G = 1 << 30


@pytest.fixture
def node(mps_control, shim_lib, fake_cuda_dir, tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("r"), mps_control, shim_lib, fake_cuda_dir)
    yield n
    n.close()


@pytest.mark.parametrize("holder", [True, False], ids=["holder", "detached"])
def test_sigterm_sigkill_and_a_config_change_leave_the_daemon_and_an_exec_client_running(node, holder):
    if holder:
        node.spawn("holder")
        wait_until(node.daemon_pid, "the holder's daemon")
    run, _ = node.start_timed()
    client = node.exec_client("web", "1G")
    daemon, servers = node.daemon_pid(), node.servers()
    assert daemon is not None and node.defaults() == (50, 2 * G, 1)
    region = wait_until(lambda: node.metric("mpsd_region_memory_used_bytes"), "the region's series")
    assert region == {'{device="0",region="web"}': 1 * G}
    for sig, percent in ((signal.SIGTERM, 50), (signal.SIGKILL, 50), (signal.SIGTERM, 60)):
        assert stop(run, sig) == (0 if sig == signal.SIGTERM else -9), read(run)
        assert node.daemon_pid() == daemon  # nothing runs mpsd meanwhile: the daemon does
        run, _ = node.start_timed(**{"active-thread-percentage": str(percent)})
        assert node.daemon_pid() == daemon
        assert node.quits() == 0
        assert node.defaults() == (percent, 2 * G, 1)
        assert node.servers() == servers
        assert client.poll() is None, read(client)
        assert wait_until(lambda: node.metric("mpsd_region_memory_used_bytes"), "the region's series") == region
        assert node.metric("mpsd_defaults_restored_total") == {"": 0.0}  # a config change is not tampering
        assert node.metric("mpsd_daemon_restarts_total") == {"": 0.0}
    log = read(run)
    assert f"adopted the running control daemon pid={daemon}" in log
    assert "adopted daemon's defaults set to the config's (it had activeThreadPercentage 50 (config 60))" in log
    assert stop(run) == 0 and node.daemon_pid() == daemon and node.quits() == 0


def test_owned_mode_still_quits_its_daemon_on_sigterm(node):
    run, _ = node.start_timed(**{"daemon-lifecycle": "owned"})
    daemon = node.daemon_pid()
    assert daemon is not None
    assert stop(run) == 0
    assert node.daemon_pid() is None and node.quits() == 1
