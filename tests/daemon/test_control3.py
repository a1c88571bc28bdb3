"""The MPS v3 front-end's answers as NVIDIA's "MPS v3 Interface" page shows them, and every
reasonable answer where it is silent (tables), and what a refused or missing daemon raises."""

from __future__ import annotations

import pytest

from mpsd.daemon.control import UnexpectedOutput
from mpsd.daemon.control3 import (
    Client3,
    Control3,
    Limits3,
    Namespace3,
    Server3,
    differences,
    parse_clients,
    parse_namespaces,
    parse_servers,
)
from mpsd.daemon.answers3 import quantity
from mpsd.errors import ControlError, DaemonNotRunning

READY = Server3("training", 1000, 48201, "Ready", ("GPU-abcd-1234",))


@pytest.mark.parametrize("text, expected", [
    ("", []),
    # the Interface page's example, word for word (server list --format=csv,noheader)
    ("training,1000,48201,Ready,/run/nvidia-mps/training,GPU-abcd-1234,-\n", [READY]),
    # with a header (the page's column names), and with Dynamo's table's upper case
    ("name,uid,pid,status,pipe-directory,allowed-devices,context-ids\n"
     "training,1000,48201,Ready,/run/nvidia-mps/training,GPU-abcd-1234,-\n", [READY]),
    ("NAME,UID,PID,STATUS,PIPE DIRECTORY,ALLOWED DEVICES,CONTEXT IDS\n"
     "training,1000,48201,Ready,/run/nvidia-mps/training,GPU-abcd-1234,-\n", [READY]),
    # columns in another order, and one more than the page names
    ("context-ids,allowed-devices,pipe-directory,status,pid,uid,name,extra\n"
     "-,GPU-abcd-1234,/run/nvidia-mps/training,Ready,48201,1000,training,x\n", [READY]),
    # several devices: quoted, or not
    ('g0,,-,Ready,/p/g0,"GPU-a,GPU-b",-\n', [Server3("g0", None, None, "Ready", ("GPU-a", "GPU-b"))]),
    ("g0,,-,Ready,/p/g0,GPU-a,GPU-b,-\n", [Server3("g0", None, None, "Ready", ("GPU-a", "GPU-b"))]),
    ("name,uid,pid,status,pipe-directory,allowed-devices,context-ids\ng0,0,7,FAULT,/p/g0,GPU-a,GPU-b,-\n",
     [Server3("g0", 0, 7, "FAULT", ("GPU-a", "GPU-b"))]),
])
def test_server_list(text, expected):
    assert parse_servers(text) == expected


@pytest.mark.parametrize("word, known, fault", [
    ("Ready", True, False), ("ACTIVE", True, False), ("FAULT", True, True), ("Fault", True, True),
    ("Degraded", False, False), ("recovering", False, False),
])
def test_status_words_are_kept_and_classified_never_refused(word, known, fault):
    [server] = parse_servers(f"g0,0,1,{word},/p,GPU-a,-")
    assert (server.status, server.known, server.fault) == (word, known, fault)


@pytest.mark.parametrize("text", ["g0,0,x1,Ready,/p,GPU-a,-", "g0", "name,uid\n,1\n"])
def test_a_server_list_mpsd_cannot_read_names_the_line(text):
    with pytest.raises(UnexpectedOutput, match="unreadable .*line") as err:
        parse_servers(text)
    assert "\n" not in str(err.value)


PAGE_NS = Namespace3("training", "high_priority", Limits3("4G", "25", "0"))


@pytest.mark.parametrize("text, expected", [
    # the page's seven columns without a header, then with one
    ("high_priority,training,Ready,4G,25,0,/run/nvidia-mps/training/high_priority\n", [PAGE_NS]),
    ("name,server,server-status,pinned-memory-limit,active-thread-percentage,client-priority,pipe-directory\n"
     "high_priority,training,Ready,4G,25,0,/p/training/high_priority\n", [PAGE_NS]),
    # Dynamo's table's five columns (no client priority): unknown, not guessed
    ("NAME,SERVER,SERVER STATUS,PINNED MEMORY LIMIT,ACTIVE THREAD PERCENTAGE\nsmall,shared,Ready,20G,30.00\n",
     [Namespace3("shared", "small", Limits3("20G", "30.00", None))]),
    ("small,shared,Ready,20G,30.00\n", [Namespace3("shared", "small", Limits3("20G", "30.00", None))]),
    # no limit set
    ("default,g0,Ready,-,,-,/p/g0/default\n", [Namespace3("g0", "default", Limits3("", "", ""))]),
])
def test_namespace_list(text, expected):
    assert parse_namespaces(text) == expected


@pytest.mark.parametrize("text, expected", [
    # the page's example (client list --format=csv,noheader): pid, server, device, namespace, command
    ("51023,training,0,default,python train.py\n51087,training,0,high_priority,python eval.py\n",
     [Client3(51023, "training", "default"), Client3(51087, "training", "high_priority")]),
    ("PID,SERVER,DEVICE,NAMESPACE,CMD,EXTRA\n51023,training,0,default,python a, b.py,x\n",
     [Client3(51023, "training", "default")]),
    ("namespace,pid\nhigh_priority,7\n", [Client3(7, "", "high_priority")]),
])
def test_client_list(text, expected):
    assert parse_clients(text) == expected


def test_a_client_list_in_v2_s_order_is_refused_not_misread():
    with pytest.raises(UnexpectedOutput, match="client"):
        parse_clients("x,1000,g0,a1\n")


@pytest.mark.parametrize("text, nbytes", [
    ("2G", 2 << 30), ("2048M", 2 << 30), ("2097152K", 2 << 30), ("2GiB", 2 << 30), ("2048 MiB", 2 << 30),
    ("1.5G", 3 << 29), ("10g", 10 << 30), ("8 GB", 8 << 30), ("lots", None),
])
def test_memory_limits_are_quantities(text, nbytes):
    assert quantity(text) == nbytes


@pytest.mark.parametrize("want, got, wrong", [
    (Limits3("2G", "25", "0"), Limits3("2048M", "25.00", "0"), []),
    (Limits3("8G", "25", ""), Limits3("8G", "25", "1"), []),  # a field mpsd does not set: not compared
    (Limits3("8G", "25", "0"), Limits3("9G", "25", "0"), ["pinned-memory-limit 9G (expected 8G)"]),
    (Limits3("8G", "25", "0"), Limits3("8G", "50", "0"), ["active-thread-percentage 50 (expected 25)"]),
    (Limits3("8G", "25", "1"), Limits3("8G", "25", None), ["client-priority unknown"]),
    (Limits3("8G", "", ""), Limits3("", "", ""), ["pinned-memory-limit unset (expected 8G)"]),
])
def test_differences(want, got, wrong):
    assert differences(want, got) == wrong


def test_options_are_the_pages_flags():
    assert Limits3("4G", "25", "0").options() == [
        "--pinned-memory-limit=4G", "--active-thread-percentage=25", "--client-priority=0"]
    assert Limits3().options() == []


def test_no_daemon_is_told_by_the_socket_not_by_a_message(tmp_path):
    from tests.fakes import install_fake_mps_v3

    fake_v3_binary = install_fake_mps_v3(tmp_path / "bin")
    with pytest.raises(DaemonNotRunning, match="no MPS control daemon listens"):
        Control3(str(fake_v3_binary), str(tmp_path / "nothing")).server_list()
    with pytest.raises(ControlError, match="cannot run control binary"):
        Control3(str(tmp_path / "missing"), str(tmp_path)).server_list()
    # a binary that fails with the v2 message while nothing listens: still "not running", by the socket
    liar = tmp_path / "liar"
    liar.write_text("#!/bin/sh\necho 'some other words' >&2\nexit 3\n")
    liar.chmod(0o755)
    with pytest.raises(DaemonNotRunning, match="exit status 3"):
        Control3(str(liar), str(tmp_path)).server_list()


def test_descends_from_reads_the_parent_chain(tmp_path):
    from mpsd.lifecycle.v3 import descends_from

    for pid, ppid, comm in ((30, 20, "srv) x (y"), (20, 10, "nvidia-cuda-mps"), (10, 1, "init-ish"), (40, 1, "pod")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0")
    assert descends_from(30, 10, proc=str(tmp_path))  # a server's child: two steps, a comm with ") "
    assert descends_from(20, 10, proc=str(tmp_path))
    assert not descends_from(40, 10, proc=str(tmp_path))
    assert not descends_from(99, 10, proc=str(tmp_path))
