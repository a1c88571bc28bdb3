"""mpsd on a daemon that answers as NVIDIA's MPS v3 pages show (tests/fakes/mps_control_v3.py
names each page), and on every reasonable answer where they are silent: the node comes up,
slices become namespaces read back before anyone uses them, deletes end the slice's clients,
only mpsd's own namespaces are deleted, answers it cannot read are said, not restarted over."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc
import pytest

from mpsd.daemon.control3 import Limits3
from mpsd.dra.claims import ClaimRef
from mpsd.errors import SetupError
from mpsd.lifecycle.v3 import supervision_for
from mpsd.sharing.toml3 import namespace_name

from tests.plugin.conftest import allocate, stub
from tests.sharing.conftest import wait_for
from tests.sharing.test_v3_node import GPUS, namespaces, node, plugin, preparer_for, up  # noqa: F401 (fixtures)

VARIANTS = ["", "csv-noheader", "upper-header", "reorder", "extra-column", "mib", "decimals", "quoted",
            "no-priority", "status=ACTIVE", "mib,decimals,reorder,upper-header,extra-column"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_node_comes_up_and_keeps_its_namespaces_on_every_answer(node, plugin, monkeypatch, variant):  # noqa: F811
    monkeypatch.setenv("FAKE_MPS_VARIANT", variant)
    config, backend, running = node()
    up(running)
    dp = plugin(config, backend)
    channel, s = stub(dp)
    with channel:
        allocate(s, [f"{GPUS[0].uuid}::0", f"{GPUS[0].uuid}::1"])
    ns = namespace_name(dp.store.all()[0].allocation_id)
    assert backend.control().namespace_get("g0", ns, "pinned-memory-limit") not in ("", "-")
    # rounds that find it as wanted (2G = 2048M, 20 = 20.00) change nothing
    checks = running.sup.status().health_checks
    assert wait_for(lambda: running.sup.status().health_checks >= checks + 3, timeout=20)
    assert running.sup.status().defaults_restored == 0 and running.sup.status().restarts == 0
    # an operator's change is put back (the page's columns read, not another order)
    backend.control().namespace_set("g0", ns, Limits3("70G", "100"))
    assert wait_for(lambda: running.sup.status().defaults_restored >= 1)
    assert backend.control().namespace_get("g0", ns, "active-thread-percentage") in ("20", "20.00")
    if variant == "status=ACTIVE":
        assert "ACTIVE" not in running.board.current().last_error


def test_prepare_without_a_daemon_fails_in_one_line_and_leaves_nothing(node, short_tmp):  # noqa: F811
    config, backend, running = node()
    running.stop()  # -q: no daemon now
    preparer, _ = preparer_for(config, backend, short_tmp)
    with pytest.raises(Exception) as err:
        preparer.prepare(ClaimRef("ns", "c1", "u1"))
    assert "no MPS control daemon listens" in str(err.value) and "\n" not in str(err.value)
    assert preparer.cdi.ours() == [] and preparer.store.all() == [] and backend.wanted() == {}


@pytest.mark.parametrize("hook", ["refuse-set", "ignore-set"])
def test_a_namespace_whose_limits_are_not_held_is_deleted_and_the_grant_refused(node, plugin, hook):  # noqa: F811
    config, backend, running = node()
    up(running)
    backend.control().run("_fake", "hook", f"--name={hook}")
    dp = plugin(config, backend)
    channel, s = stub(dp)
    with channel, pytest.raises(grpc.RpcError) as err:
        allocate(s, [f"{GPUS[0].uuid}::0"])
    assert "not ready" in err.value.details() and "\n" not in err.value.details()
    assert set(namespaces(backend)) == {"default"}  # created, then deleted: never left without limits


def test_unprepare_ends_the_claims_clients_and_a_refused_delete_names_the_namespace(node, short_tmp):  # noqa: F811
    config, backend, running = node()
    up(running)
    preparer, _ = preparer_for(config, backend, short_tmp)
    rec = preparer.prepare(ClaimRef("ns", "c1", "u1"))
    ns = namespace_name(preparer.slices(rec)[0].key)
    assert namespaces(backend, "g1")[ns] == Limits3("10G", "25", "1")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
        client.connect(os.path.join(config.pipe_dir, "g1", ns, "control"))
        assert wait_for(lambda: backend.control().client_list() != [])
        backend.control().run("_fake", "hook", "--name=refuse-delete")
        outcome = preparer.unprepare_many([ClaimRef("ns", "c1", "u1")])["u1"]
        assert f"namespace g1/{ns} not deleted" in outcome and "\n" not in outcome
        assert ns in namespaces(backend, "g1") and preparer.store.all() != []  # the kubelet retries
        backend.control().run("_fake", "hook", "--name=refuse-delete", "--value=")
        assert preparer.unprepare_many([ClaimRef("ns", "c1", "u1")])["u1"] == ""
        assert client.recv(16) == b""  # the claim's client was ended
    assert ns not in namespaces(backend, "g1") and preparer.store.all() == []


def test_a_status_word_mpsd_does_not_know_is_reported_not_fatal(node, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FAKE_MPS_VARIANT", "status=Degraded")
    config, backend, running = node()
    state = running.wait_for(lambda st: "Degraded" in st.last_error, what="unknown status reported")
    assert state.daemon_up and state.configured and not state.faulted_gpus
    assert running.sup.status().restarts == 0


def test_an_answer_mpsd_cannot_read_is_said_with_its_line_never_not_listening(node):  # noqa: F811
    config, backend, running = node()
    up(running)
    backend.control().run("_fake", "hook", "--name=garbage")
    state = running.wait_for(lambda st: "cannot read" in st.unverified, what="unreadable answer in /readyz")
    assert "%%% no such form %%%" in state.unverified and "not listening" not in state.last_error
    checks = running.sup.status().health_checks
    assert wait_for(lambda: running.sup.status().health_checks >= checks + 3, timeout=20)
    assert running.sup.status().restarts == 0 and running.sup.status().state == "running"
    backend.control().run("_fake", "hook", "--name=garbage", "--value=")
    running.wait_for(lambda st: st.unverified == "", what="readable again")


def test_multi_user_is_the_v3_daemons_own_option_and_no_v2_probe(node, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FAKE_MPS_V2_MULTIUSER", "1")  # a v2 probe would be told "supported", as by R615
    config, backend, running = node(**{"multi-user": "auto"})
    up(running)
    with open(f"/proc/{running.sup.status().pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"-m" in argv and b"-multiuser-server" not in argv
    assert "uid =" not in Path(config.state_dir, "mps-v3.toml").read_text()


def test_a_non_root_mpsd_names_its_uid_in_the_file_and_asks_no_multi_user(node):  # noqa: F811
    config, backend, _ = node()
    v3 = supervision_for(backend, config)
    assert v3.uid_policy("auto", euid=1000).options == ()
    assert "uid = 1000" in backend.toml() and v3.daemon_options()["args"] == ["-p", "3", "-a", v3.toml_path]
    with pytest.raises(SetupError, match="root"):
        v3.uid_policy("on", euid=1000)
    assert v3.uid_policy("auto", euid=0).options == ("-m",) and "uid =" not in backend.toml()


def test_fault_policy_terminate_ends_the_faulted_servers_clients(node):  # noqa: F811
    config, backend, running = node(**{"fault-policy": "terminate"})
    up(running)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
        client.connect(os.path.join(config.pipe_dir, "g1", "control"))
        assert wait_for(lambda: backend.control().client_list() != [])
        backend.control().run("_fake", "status", "--server=g1", "--status=FAULT")
        state = running.wait_for(lambda st: "terminated" in st.last_error, what="clients terminated")
        assert "1 client(s) terminated (client terminate)" in state.last_error and state.faulted_gpus == {1}
        client.settimeout(10)
        assert client.recv(16) == b""


def test_a_server_that_leaves_the_list_marks_only_its_gpu(node):  # noqa: F811
    config, backend, running = node()
    up(running)
    backend.control().run("_fake", "drop", "--server=g1")
    state = running.wait_for(lambda st: st.faulted_gpus, what="server gone seen")
    assert state.faulted_gpus == {1} and state.gpu_healthy(0) and "g1 of mpsd's file not listed" in state.last_error
    assert running.sup.status().restarts == 0


def test_make_ends_a_client_that_connected_before_the_limits(tmp_path):
    from mpsd.daemon.control3 import Client3, Namespace3
    from mpsd.sharing.namespaces3 import make
    from mpsd.sharing.owned3 import Owned

    class Daemon:  # a scripted daemon: a client connects between create and set
        def __init__(self):
            self.limits, self.calls = None, []

        def namespace_list(self, server):
            return [Namespace3(server, "n1", self.limits)] if self.limits is not None else []

        def namespace_create(self, server, name):
            self.calls.append("create")
            self.limits = Limits3("", "", "")

        def client_list(self):
            return [Client3(42, "g0", "n1")]

        def namespace_set(self, server, name, limits):
            self.calls.append("set")
            self.limits = limits

        def client_terminate(self, pid):
            self.calls.append(f"terminate {pid}")

    daemon = Daemon()
    owned = Owned(str(tmp_path / "owned.json"))
    notes = make(daemon, "g0", "n1", Limits3("1G", "10", "0"), owned)  # type: ignore[arg-type]
    assert daemon.calls == ["create", "set", "terminate 42"] and "connected before its limits" in notes[0]
    assert Owned(str(tmp_path / "owned.json")).has("g0", "n1")  # journaled, on disk
