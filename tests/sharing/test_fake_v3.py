"""The MPS v3 stand-in behaves as NVIDIA's pages describe (tests/fakes/mps_control_v3.py names
each page), driven through mpsd's own front-end (mpsd/daemon/control3.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mpsd.daemon.control import CommandRejected
from mpsd.daemon.control3 import Limits3

SERVER = """schema_version = "1.0"
[servers.g0]
allowed_devices = "GPU-a"
pinned_memory_limit = "80G"
active_thread_percentage = "100"
[servers.g0.namespaces.c1]
pinned_memory_limit = "8G"
active_thread_percentage = "10"
client_priority = "1"
"""


def test_namespaces_from_the_file_and_the_verbs_with_their_sockets(start_v3):
    d = start_v3(SERVER)
    c = d.control
    [server] = c.server_list()
    assert (server.name, server.status, server.pid, server.allowed_devices) == ("g0", "Ready", None, ("GPU-a",))
    names = {n.name: n.limits for n in c.namespace_list("g0")}
    assert names == {"default": Limits3("80G", "100", ""), "c1": Limits3("8G", "10", "1")}
    assert (d.pipe / "g0" / "c1" / "control").exists() and (d.pipe / "g0" / "default" / "control").exists()
    c.namespace_create("g0", "a2")  # the page: create takes the name and the server only
    assert (d.pipe / "g0" / "a2" / "control").exists()
    assert {n.name: n.limits for n in c.namespace_list("g0")}["a2"] == Limits3("", "", "")  # the whole GPU
    c.namespace_set("g0", "a2", Limits3("4G", "5", "0"))
    c.namespace_set("g0", "a2", Limits3(pinned_memory_limit="6G"))
    assert {n.name: n.limits for n in c.namespace_list("g0")}["a2"] == Limits3("6G", "5", "0")
    assert c.namespace_get("g0", "a2", "pinned-memory-limit") == "6G"
    c.server_set("g0", Limits3(active_thread_percentage="50"))  # the page: applied to the default namespace
    assert {n.name: n.limits for n in c.namespace_list("g0")}["default"].active_thread_percentage == "50"
    c.namespace_delete("g0", "a2")
    assert not (d.pipe / "g0" / "a2").exists()
    with pytest.raises(CommandRejected, match="not found"):
        c.namespace_delete("g0", "a2")
    with pytest.raises(CommandRejected, match="already exists"):
        c.namespace_create("g0", "c1")
    with pytest.raises(CommandRejected, match="1-100"):
        c.namespace_set("g0", "c1", Limits3(active_thread_percentage="150"))
    with pytest.raises(CommandRejected, match="lowercase"):  # the page: lowercase letters, digits, '_'
        c.namespace_create("g0", "Big-One")
    with pytest.raises(CommandRejected, match="takes no option"):  # mpsd never sends one; the page shows none
        c.run("namespace", "create", "x1", "--server=g0", "--pinned-memory-limit=1G")


def test_a_namespace_with_clients_is_deleted_only_with_force_or_once_they_ended(start_v3):
    from tests.sharing.conftest import wait_for

    d = start_v3(SERVER)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(d.pipe / "g0" / "c1" / "control"))
        assert wait_for(lambda: d.control.client_list() != [])
        [client] = d.control.client_list()
        assert (client.pid, client.server, client.namespace) == (os.getpid(), "g0", "c1")
        [server] = d.control.server_list()
        assert server.pid == d.proc.pid
        with pytest.raises(CommandRejected, match="active client"):
            d.control.namespace_delete("g0", "c1")
        d.control.client_terminate(os.getpid())
        assert wait_for(lambda: d.control.client_list() == [])
        assert s.recv(16) == b""  # its connection ended
    d.control.namespace_delete("g0", "c1")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        d.control.namespace_create("g0", "c2")
        s.connect(str(d.pipe / "g0" / "c2" / "control"))
        assert wait_for(lambda: d.control.client_list() != [])
        d.control.namespace_delete("g0", "c2", force=True)
        assert d.control.client_list() == [] and "c2" not in {n.name for n in d.control.namespace_list("g0")}


@pytest.mark.parametrize("variant", ["csv-noheader", "upper-header", "reorder", "extra-column", "mib", "decimals",
                                     "quoted", "status=Degraded", "no-priority", "mib,decimals,reorder,upper-header"])
def test_every_variant_reads_back_the_same(start_v3, variant):
    d = start_v3(SERVER.replace('"GPU-a"', '"GPU-a,GPU-b"'), env={"FAKE_MPS_VARIANT": variant})
    [server] = d.control.server_list()
    assert server.allowed_devices == ("GPU-a", "GPU-b")
    assert server.status == ("Degraded" if "status" in variant else "Ready")
    from mpsd.daemon.control3 import differences

    got = {n.name: n.limits for n in d.control.namespace_list("g0")}["c1"]
    unknown = ["client-priority unknown"] if variant == "no-priority" else []
    assert differences(Limits3("8G", "10", "1"), got) == unknown
    assert differences(Limits3("8192M", "10.0", ""), got) == []


@pytest.mark.parametrize("toml, message", [
    (SERVER + "bogus = 1\n", "servers.g0.namespaces.c1.bogus: unknown key"),
    (SERVER.replace('allowed_devices = "GPU-a"', 'allowed_devices = "GPU-a"\ncolor = "red"'), "servers.g0.color"),
    (SERVER.replace('"1.0"', '"2.0"'), "schema_version"),
    (SERVER + 'cgroup = "/sys/fs/cgroup/x"\n', "cgroup: unknown key"),  # a 620 key on 615
    (SERVER.replace('"8G"', '"8 GB"'), "pinned_memory_limit"),
])
def test_a_configuration_the_daemon_refuses_ends_it_with_one_line(start_v3, toml, message):
    d = start_v3(toml, expect_exit=True)
    out, err = d.proc.communicate(timeout=10)
    assert d.proc.returncode == 1
    assert err.startswith("Configuration error:") and message in err and err.count("\n") == 1


def test_620_takes_the_cgroup_keys(start_v3):
    d = start_v3(SERVER + 'cgroup = "/sys/fs/cgroup/x"\ncgroup_depth = 1\n', env={"FAKE_MPS_RELEASE": "620"})
    assert sorted(n.name for n in d.control.namespace_list("g0")) == ["c1", "default"]


def test_a_device_the_daemon_does_not_see_is_refused(start_v3):
    d = start_v3(SERVER, env={"FAKE_MPS_DEVICES": "GPU-b"}, expect_exit=True)
    assert "GPU-a not found" in d.proc.communicate(timeout=10)[1]


def test_help_names_the_v3_modules_and_quit_ends_the_daemon(start_v3, fake_v3_binary):
    help_text = subprocess.run([str(fake_v3_binary), "-p", "3", "-h"], capture_output=True, text=True).stdout
    assert "namespace" in help_text and "server" in help_text
    d = start_v3(SERVER)
    d.control.quit(wait=10)
    assert d.proc.wait(10) == 0 and not (d.pipe / "control").exists()


def test_changes_only_from_root_or_the_daemons_user(start_v3):
    d = start_v3(SERVER)
    os.chmod(d.pipe.parent, 0o755)  # mkdtemp's 0700 would keep the other user from the sockets
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(d.pipe))
    from tests.fakes import FAKES_DIR

    stand_in = [sys.executable, str(FAKES_DIR / "mps_control_v3.py")]  # the session's copy is root's
    proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *stand_in,
                           "namespace", "delete", "c1", "--server=g0"], env=env, capture_output=True, text=True)
    if "setpriv" in proc.stderr and proc.returncode == 127:
        pytest.skip("setpriv not available")
    assert proc.returncode == 1 and "can only be modified" in proc.stderr
