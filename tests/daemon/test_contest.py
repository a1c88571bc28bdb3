"""Tables for the pure parts of defaults kept against a writer (issue 21, defect 1): a batch's
answers, the commands that set and read the defaults, the daemon log lines that name a write,
and the run of contested health rounds."""

from __future__ import annotations

import pytest

from mpsd import config as cfg
from mpsd.daemon import drift
from mpsd.daemon.contest import LOG_EVERY, Contest, written_default
from mpsd.daemon.control import MARK_ANSWER, UnexpectedOutput, split_answers
from mpsd.daemon.peer import parse_stat_ppid

M = f"{MARK_ANSWER}\n"


@pytest.mark.parametrize(
    "output,count,answers",
    [
        (f"60.0\n{M}", 1, ["60.0\n"]),
        (f"{M}2G\n{M}{M}0\n{M}", 4, ["", "2G\n", "", "0\n"]),  # set limit prints nothing; unset reads nothing
        (f"Server 1 not found\n{M}", 1, ["Server 1 not found\n"]),
    ],
)
def test_split_answers(output, count, answers):
    assert split_answers(output, count) == answers


@pytest.mark.parametrize(
    "output,count",
    [
        ("", 1),  # not served
        (f"60.0\n{M}", 2),  # an answer missing
        (f"60.0\n{M}junk\n", 1),  # something after the last mark
        ('60.0\nUnknown command "mpsd-end-of-answers"\n', 1),  # another unknown command is no mark
    ],
)
def test_split_answers_refuses_a_malformed_batch(output, count):
    with pytest.raises(UnexpectedOutput, match="expected"):
        split_answers(output, count)


def test_set_commands_cover_every_watched_device_and_what_a_reload_dropped():
    old = cfg.load(None, {}, {"pinned-mem-limit": "0=2G,3=1G,GPU-8f6c1a2b-0000-1111-2222-333344445555=1G"})
    new = cfg.load(None, {}, {"active-thread-percentage": "40", "pinned-mem-limit": "0=1044M"})
    assert drift.set_commands(new, {0, 1}, previous=old) == [
        "set_default_active_thread_percentage 40",
        "set_default_device_pinned_mem_limit 0 1044M",
        "set_default_device_pinned_mem_limit 1 0",
        "set_default_device_pinned_mem_limit 3 0",
        "set_default_device_pinned_mem_limit GPU-8f6c1a2b-0000-1111-2222-333344445555 0",
        "set_default_client_priority 0",
    ]
    assert drift.read_commands([0, 1]) == [
        "get_default_active_thread_percentage",
        "get_default_device_pinned_mem_limit 0",
        "get_default_device_pinned_mem_limit 1",
        "get_default_client_priority",
    ]
    assert drift.parse_read(["40.0\n", "1G\n", "", "1\n"], [0, 1]) == drift.Defaults(40.0, {0: 1 << 30, 1: None}, 1)


@pytest.mark.parametrize(
    "line,command",
    [
        (
            "[2026-11-26 17:24:22.023 Control 14013] Cmd:set_default_active_thread_percentage 1",
            "set_default_active_thread_percentage 1",
        ),
        ("[…] Cmd:set_default_device_pinned_mem_limit 0 1M", "set_default_device_pinned_mem_limit 0 1M"),
        ("[…] Cmd:set_default_client_priority 1", "set_default_client_priority 1"),
        ("[…] Cmd:get_default_active_thread_percentage", ""),
        ("[…] Cmd:set_active_thread_percentage 4242 30", ""),  # one server's, not a default
        ("[…] 60.0", ""),
        (  # a long argument: 64 characters of it
            "[…] Cmd:set_default_active_thread_percentage " + "9" * 500,
            "set_default_active_thread_percentage " + "9" * 64,
        ),
    ],
)
def test_written_default(line, command):
    assert written_default(line) == command


@pytest.mark.parametrize(
    "stat,ppid",
    [
        ("4242 (sh) S 17 4242 4242 0 -1", 17),
        ("4242 (a b) c) (R) R 99 1 1", 99),  # a comm with spaces and parentheses
        ("4242 (sh)", None),
        ("", None),
    ],
)
def test_parse_stat_ppid(stat, ppid):
    assert parse_stat_ppid(stat) == ppid


def test_a_contest_runs_while_changes_come_back_within_the_bound():
    c, bound = Contest(), 3.0
    assert c.changed("atp 1 (config 60)", "pid 7 ('w')", 100.0, bound) is True  # the first: logged
    assert c.reason(100.0, bound) == ""
    c.held(101.0, bound)  # one quiet round does not end it
    assert c.changed("atp 1 (config 60)", "", 102.0, bound) is False  # not logged again at once
    assert c.changed("atp 1 (config 60)", "", 103.5, bound) is False
    assert c.age(103.5) == 3.5 and c.rounds == 3
    reason = c.reason(103.5, bound)
    assert "for 4s (verdictTimeout 3s)" in reason and "atp 1 (config 60)" in reason and "pid 7 ('w')" in reason
    assert c.changed("atp 1 (config 60)", "", 100.0 + LOG_EVERY, bound) is True  # > bound apart: a new run
    assert c.rounds == 1 and "could not be named" in c.reason(100 + LOG_EVERY + bound, bound)  # its own writer
    c.held(100.0 + LOG_EVERY + bound, bound)  # quiet for the bound: over
    assert c.age(200.0) == 0.0 and c.reason(200.0, bound) == ""


def test_a_long_contest_is_logged_once_a_minute():
    c = Contest()
    logged = [c.changed("x", "", float(t), 10.0) for t in range(0, 130, 5)]
    assert logged.count(True) == 3  # at 0, 60, 120
