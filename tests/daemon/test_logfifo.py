"""Pure parts of mpsd.daemon.logfifo (a daemon blocked on its log FIFO: contested), by tables."""

from __future__ import annotations

import pytest

from mpsd.daemon.logfifo import Blocked, describe, opened_for_writing, reason, under, written_fd

# What the real daemons' main thread shows when blocked (535.216 to 555.58, x86_64): write(2) on fd 11.
BLOCKED_535 = "1 0xb 0x7ffe3a10e3f0 0x47 0xa3d70a3d70a3d70b 0x0 0x640 0x7ffe3a10e380 0x7f9305de838f"


@pytest.mark.parametrize("text, machine, fd", [
    (BLOCKED_535, "x86_64", 11),
    ("20 0x3 0x7ffe 0x2 0x0 0x0 0x0 0x7ffe 0x7f93", "x86_64", 3),  # writev
    ("0 0x9 0x7ffe 0x30 0x0 0x0 0x0 0x7ffe 0x7f93", "x86_64", None),  # read: the log reader, waiting
    ("7 0x7ffe 0x3 0x3e8 0x0 0x0 0x0 0x7ffe 0x7f93", "x86_64", None),  # poll: the idle main thread
    ("64 0xb 0xffff 0x47 0x0 0x0 0x0 0xffff 0xffff", "aarch64", 11),
    ("1 0xb 0xffff 0x47 0x0 0x0 0x0 0xffff 0xffff", "aarch64", None),  # 1 is not write there
    ("running", "x86_64", None),
    ("-1 0x7ffe3a10e3f0 0x7f9305de838f", "x86_64", None),  # blocked outside a system call
    ("1 0xzz", "x86_64", None),
    ("1", "x86_64", None),
    ("", "x86_64", None),
    (BLOCKED_535, "riscv64", None),  # a machine whose numbers are not known: never "blocked"
])
def test_written_fd(text, machine, fd):
    assert written_fd(text, machine) == fd


@pytest.mark.parametrize("text, writing", [
    ("pos:\t0\nflags:\t02100001\nmnt_id:\t27\nino:\t9987932\n", True),  # O_WRONLY (the daemon's writer)
    ("pos:\t0\nflags:\t02100002\nmnt_id:\t27\n", True),  # O_RDWR (the daemon's reader holds it so)
    ("pos:\t0\nflags:\t04000\nmnt_id:\t27\n", False),  # O_RDONLY|O_NONBLOCK: mpsd's look
    ("pos:\t0\nflags:\tzz\n", False),
    ("", False),
])
def test_opened_for_writing(text, writing):
    assert opened_for_writing(text) is writing


@pytest.mark.parametrize("path, root, inside", [
    ("/run/mps/pipe/log", "/run/mps/pipe", True),
    ("/run/mps/pipe/g0/log", "/run/mps/pipe", True),  # v3: a server's own directory
    ("/run/mps/pipe/log (deleted)", "/run/mps/pipe", True),
    ("/run/mps/pipe2/log", "/run/mps/pipe", False),
    ("/run/mps/pipe", "/run/mps/pipe", False),
    ("pipe:[2953541]", "/run/mps/pipe", False),  # an anonymous pipe (mpsd's end of its stdout)
    ("/log", "/", True),
])
def test_under(path, root, inside):
    assert under(path, root) is inside


def test_describe_names_the_writers_or_says_they_have_gone():
    found = Blocked("/run/mps/pipe/log", (41,), 65488, 65536, (7, 8))
    line = describe(found, ["pid 7 ('sh') pod 0b1c container 0123456789ab", "pid 8 ('python3')"])
    assert line == ("contested, not hung: daemon thread(s) 41 blocked writing its log FIFO /run/mps/pipe/log, "
                    "65488 of 65536 bytes queued, which it no longer reads (a record it could not parse was "
                    "written into it); held open for writing by pid 7 ('sh') pod 0b1c container 0123456789ab, "
                    "pid 8 ('python3')")
    gone = describe(Blocked("/p/log", (41, 42), None, None, ()), [])
    assert "thread(s) 41,42 blocked writing its log FIFO /p/log, which" in gone
    assert gone.endswith("no process but the daemon holds it open for writing now (the writer has gone)")
    many = describe(found, [f"pid {n}" for n in range(8)])
    assert many.endswith("pid 3, pid 4 and 3 more")
    assert reason(31.4, 30, "X").startswith("no health verdict for 31s (verdictTimeout 30s): X; the daemon is left")
