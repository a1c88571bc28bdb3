"""The MPS v3 front-end's answers, parsed (tables), and what a refused or missing daemon raises."""

from __future__ import annotations

import pytest

from mpsd.daemon.control import UnexpectedOutput
from mpsd.daemon.control3 import (
    Client3,
    Control3,
    Limits3,
    Namespace3,
    Server3,
    parse_clients,
    parse_namespaces,
    parse_servers,
    same_limits,
)
from mpsd.errors import ControlError, DaemonNotRunning


@pytest.mark.parametrize("text, expected", [
    ("", []),
    ("g0,,-,STOPPED,/p/g0,GPU-a,-\n", [Server3("g0", None, None, "STOPPED", ("GPU-a",))]),
    ("g1,0,4242,FAULT,/p/g1,GPU-a,GPU-b,-\n", [Server3("g1", 0, 4242, "FAULT", ("GPU-a", "GPU-b"))]),
])
def test_server_list(text, expected):
    assert parse_servers(text) == expected


@pytest.mark.parametrize("text", ["g0,0,1,ASLEEP,/p,GPU-a,-", "g0,0,x1,ACTIVE,/p,GPU-a,-", "g0,0"])
def test_server_list_in_an_unknown_form_is_unexpected_output(text):
    with pytest.raises(UnexpectedOutput):
        parse_servers(text)


def test_namespaces_and_clients():
    assert parse_namespaces("g0,a1,8G,25,0,2\n") == [Namespace3("g0", "a1", Limits3("8G", "25", "0"), 2)]
    assert parse_clients("12,1000,g0,a1\n") == [Client3(12, 1000, "g0", "a1")]
    with pytest.raises(UnexpectedOutput):
        parse_clients("x,1000,g0,a1\n")


@pytest.mark.parametrize("want, got, same", [
    (Limits3("8G", "25", "0"), Limits3("8G", "25.0", "0"), True),
    (Limits3("8G", "25", "0"), Limits3("8G", "50", "0"), False),
    (Limits3("8G", "25", "0"), Limits3("9G", "25", "0"), False),
    (Limits3("8G", "25", ""), Limits3("8G", "25", "1"), False),
])
def test_same_limits(want, got, same):
    assert same_limits(want, got) is same


def test_no_daemon_and_no_binary(tmp_path, fake_v3_binary):
    with pytest.raises(DaemonNotRunning):
        Control3(str(fake_v3_binary), str(tmp_path / "nothing")).server_list()
    with pytest.raises(ControlError, match="cannot run control binary"):
        Control3(str(tmp_path / "missing"), str(tmp_path)).server_list()


def test_descends_from_reads_the_parent_chain(tmp_path):
    from mpsd.lifecycle.v3 import descends_from

    for pid, ppid, comm in ((30, 20, "srv) x (y"), (20, 10, "nvidia-cuda-mps"), (10, 1, "init-ish"), (40, 1, "pod")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0")
    assert descends_from(30, 10, proc=str(tmp_path))  # a server's child: two steps, a comm with ") "
    assert descends_from(20, 10, proc=str(tmp_path))
    assert not descends_from(40, 10, proc=str(tmp_path))
    assert not descends_from(99, 10, proc=str(tmp_path))
