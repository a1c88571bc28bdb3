"""control.log sits in logDir, which a careless setup may leave writable to others: mpsd (root)
appends to it without following a link and only as a regular file."""

from __future__ import annotations

import os

from mpsd.daemon.process import LogFile


def test_a_symlink_in_place_of_control_log_is_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"host file\n")
    (tmp_path / "control.log").symlink_to(target)
    log = LogFile(str(tmp_path / "control.log"))
    try:
        assert log.write(b"a line\n") is False
        assert log.dropped == 1
    finally:
        log.close()
    assert target.read_bytes() == b"host file\n"


def test_a_fifo_in_place_of_control_log_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "control.log")
    reader = os.open(tmp_path / "control.log", os.O_RDONLY | os.O_NONBLOCK)  # a writer would not block either way
    log = LogFile(str(tmp_path / "control.log"))
    try:
        assert log.write(b"a line\n") is False
        assert os.read(reader, 100) == b""
    finally:
        log.close()
        os.close(reader)


def test_a_regular_control_log_is_appended_to(tmp_path):
    (tmp_path / "control.log").write_bytes(b"old\n")
    log = LogFile(str(tmp_path / "control.log"))
    try:
        assert log.write(b"new\n") is True
    finally:
        log.close()
    assert (tmp_path / "control.log").read_bytes() == b"old\nnew\n"
