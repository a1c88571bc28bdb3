"""Tables for the pure parsers of the control front-end's output (texts seen on 535)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsd.daemon.control import (
    CommandRejected,
    PsEntry,
    UnknownCommand,
    check_rejection,
    mem_limit_as_displayed,
    parse_device_client_list,
    parse_mem_limit,
    parse_percentage,
    parse_pids,
    parse_priority,
    parse_ps,
    parse_server_status,
    parse_terminate,
    strip_sentinel,
)
from mpsd.errors import ControlError
from mpsd.units import format_size_mps_control, parse_size

G, M = 1 << 30, 1 << 20


@pytest.mark.parametrize(
    "output,answer",
    [
        ("100.0\n", ""),  # a command that prints nothing (set_default_device_pinned_mem_limit, empty server list)
        ("25.0\n25.0\n", "25.0\n"),
        ("12\n34\n100.0\n", "12\n34\n"),
        ('Unknown command "bogus"\n100.0\n', 'Unknown command "bogus"\n'),
        ("Server 1 not found\nServer 1 not found!\n1\n100.0", "Server 1 not found\nServer 1 not found!\n1\n"),
    ],
)
def test_strip_sentinel(output, answer):
    assert strip_sentinel(output) == answer


@pytest.mark.parametrize(
    "output,pids", [("", []), ("\n", []), ("1234\n", [1234]), ("12\n34\n", [12, 34]), ("12 34", [12, 34])]
)
def test_parse_pids(output, pids):
    assert parse_pids(output) == pids


@pytest.mark.parametrize("output", ["Server 1 not found", "12 x", "12 \u00b2", "\u0663"])
def test_parse_pids_rejects_words(output):
    with pytest.raises(ControlError):
        parse_pids(output)


@given(st.lists(st.integers(min_value=1, max_value=2**22), max_size=20), st.sampled_from(["\n", " ", "\n\n"]))
def test_parse_pids_round_trip(pids, sep):
    assert parse_pids(sep.join(map(str, pids)) + "\n") == pids


@pytest.mark.parametrize("output,value", [("100.0\n", 100.0), ("25.0\n", 25.0), ("0.5", 0.5)])
def test_parse_percentage(output, value):
    assert parse_percentage(output) == value


@pytest.mark.parametrize("output", ["", "abc\n"])
def test_parse_percentage_rejects(output):
    with pytest.raises(ControlError):
        parse_percentage(output)


@pytest.mark.parametrize("output,value", [("2G\n", 2 * G), ("512M\n", 512 * M), ("", None), ("\n", None)])
def test_parse_mem_limit(output, value):
    assert parse_mem_limit(output) == value


@pytest.mark.parametrize("output", ["2T\n", "2 G", "lots", "9" * 5000 + "G\n"])  # int() of it raised ValueError
def test_parse_mem_limit_rejects(output):
    with pytest.raises(ControlError):
        parse_mem_limit(output)


# What the 535 daemon printed back for each value set (run by hand against the real binary).
@pytest.mark.parametrize(
    "set_to,shown",
    [
        ("1044M", "1G"),
        ("1536M", "1G"),
        ("512M", "512M"),
        ("2048M", "2G"),
        ("3G", "3G"),
        ("1025M", "1G"),
        ("1M", "1M"),
        ("4095M", "3G"),
        ("70000M", "68G"),
        ("100G", "100G"),
    ],
)
def test_mem_limit_as_displayed_matches_daemon(set_to, shown):
    assert mem_limit_as_displayed(parse_size(set_to)) == parse_size(shown)


@given(st.integers(min_value=1, max_value=1 << 50))
def test_displayed_limit_never_exceeds_what_was_set_at_mib_resolution(nbytes):
    shown = mem_limit_as_displayed(nbytes)
    sent = parse_size(format_size_mps_control(nbytes))
    assert shown <= sent
    assert mem_limit_as_displayed(sent) == shown  # idempotent on what the daemon receives


@pytest.mark.parametrize("output,value", [("0\n", 0), ("1\n", 1)])
def test_parse_priority(output, value):
    assert parse_priority(output) == value


@pytest.mark.parametrize("output", ["", "2\n", "x"])
def test_parse_priority_rejects(output):
    with pytest.raises(ControlError):
        parse_priority(output)


@pytest.mark.parametrize(
    "output,state",
    [
        ("ACTIVE\n", "ACTIVE"),
        ("FAULT", "FAULT"),
        ("1234 INITIALIZING\n", "INITIALIZING"),
        ("Server 12: Active", "ACTIVE"),
    ],
)
def test_parse_server_status(output, state):
    assert parse_server_status(output) == state


def test_parse_server_status_rejects():
    with pytest.raises(ControlError):
        parse_server_status("RUNNING")


@pytest.mark.parametrize(
    "output,table",
    [
        ("", {}),
        ("GPU-abc 12 13\n", {"GPU-abc": [12, 13]}),
        ("0 5\n1\n", {"0": [5], "1": []}),
        ("GPU-a 1,2", {"GPU-a": [1, 2]}),
    ],
)
def test_parse_device_client_list(output, table):
    assert parse_device_client_list(output) == table


PS = """PID       ID        SERVER    DEVICE         NAMESPACE      COMMAND
9741      0         6472      GPU-cb1213a3-d6a4-be7f 4026531836    ./nbody -benchmark -numbodies=1000
9742      1         6472      GPU-cb1213a3-d6a4-be7f 4026531836    python
"""


def test_parse_ps_table_keeps_spaces_in_command():
    assert parse_ps(PS) == [
        PsEntry(9741, 0, 6472, "GPU-cb1213a3-d6a4-be7f", "4026531836", "./nbody -benchmark -numbodies=1000"),
        PsEntry(9742, 1, 6472, "GPU-cb1213a3-d6a4-be7f", "4026531836", "python"),
    ]


@pytest.mark.parametrize("output", ["", "PID ID SERVER DEVICE NAMESPACE COMMAND\n"])
def test_parse_ps_empty(output):
    assert parse_ps(output) == []


def test_parse_ps_rejects_garbage():
    with pytest.raises(ControlError):
        parse_ps("x y z\n")


@pytest.mark.parametrize("output,code", [("0\n", 0), ("Client terminated\n0\n", 0), ("1\n", 1)])
def test_parse_terminate(output, code):
    assert parse_terminate(output) == code


@pytest.mark.parametrize("output", ["--1\n", "\u00b2\n", "-\n", "ok\n"])
def test_parse_terminate_rejects_what_is_not_a_result_code(output):
    with pytest.raises(ControlError):
        parse_terminate(output)


@pytest.mark.parametrize(
    "output,exc",
    [
        ('Unknown command "get_server_status"\n', UnknownCommand),
        ("Server 999 not found\n", CommandRejected),
        ("Server 1 not found\nServer 1 not found!\n1\n", CommandRejected),
        ("Invalid priority value - must be 0 or 1!\n", CommandRejected),
        ("Server not found\n", CommandRejected),
        (
            "Insufficient privileges for UID 1000. Control deamon settings can only be modified by the user "
            "started it or by the root user.\n",
            CommandRejected,
        ),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE should be between (0.0, 100.0]\n", CommandRejected),
    ],
)
def test_rejections_are_read_from_the_output(output, exc):
    with pytest.raises(exc) as info:
        check_rejection("cmd", output)
    assert output.splitlines()[0] in str(info.value)


@pytest.mark.parametrize("output", ["", "100.0\n", "1234\n5678\n", "2G\n"])
def test_answers_are_not_rejections(output):
    check_rejection("cmd", output)


def test_a_busy_daemon_whose_last_try_runs_out_of_time_is_busy_not_hung(monkeypatch) -> None:
    """Seen under load: the front-end was told 'busy', tried again with the few milliseconds
    left, and that last run timing out was reported as ControlTimeout, a hung daemon."""
    import subprocess

    from mpsd.daemon import control as ctl
    from mpsd.errors import ControlBusy, ControlTimeout

    tries = []

    def run_once(self, command, script, limit, left):
        tries.append(left)
        if len(tries) == 1:
            return subprocess.CompletedProcess([], 1, "", ctl.BUSY + "\n")
        raise ControlTimeout(f"{command!r}: no answer from the MPS control daemon in {limit:g}s")

    monkeypatch.setattr(ctl.Control, "_run_once", run_once)
    with pytest.raises(ControlBusy, match="another front-end holds its control connection"):
        ctl.Control("unused", "/nonexistent").call("get_server_list", timeout=5)
    assert len(tries) == 2


def test_a_daemon_that_never_answered_is_still_a_timeout(monkeypatch) -> None:
    from mpsd.daemon import control as ctl
    from mpsd.errors import ControlTimeout

    def run_once(self, command, script, limit, left):
        raise ControlTimeout(f"{command!r}: no answer from the MPS control daemon in {limit:g}s")

    monkeypatch.setattr(ctl.Control, "_run_once", run_once)
    with pytest.raises(ControlTimeout):
        ctl.Control("unused", "/nonexistent").call("get_server_list", timeout=5)
