"""The fault handler's own guards (mpsd/daemon/faults.py), each shown by a test that fails
without it (issue 33): the client list is read a second time, through a pidfd already held,
before a SIGKILL (a client that has left the list by then, as a PID reused meanwhile would
have, is not killed), and PID 0, 1 and mpsd's own are never acted on, even when the daemon
lists them and the proof that they are clients is forged. The daemon's answers come from a
stand-in (a list is the daemon's word); the clients are real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpsd.daemon.faults import TERMINATE, FaultHandler

SERVER = 4242


class ListingDaemon:
    """Answers get_client_list from ``lists`` in turn (the last one again once they run out),
    and records every terminate_client; a terminated client stays (it ignores it)."""

    def __init__(self, *lists: list[int]) -> None:
        self.lists, self.calls, self.terminated = list(lists), 0, []

    def get_client_list(self, server: int) -> list[int]:
        answer = self.lists[min(self.calls, len(self.lists) - 1)]
        self.calls += 1
        return list(answer)

    def terminate_client(self, server: int, pid: int) -> int:
        self.terminated.append(pid)
        return 0


@pytest.fixture
def stuck_client():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def two_rounds(handler: FaultHandler, daemon: ListingDaemon) -> None:
    """terminate_client at the first round; the grace (0) past, the SIGKILL step at the second."""
    handler.handle(TERMINATE, daemon, [SERVER])
    handler.handle(TERMINATE, daemon, [SERVER])


def test_a_client_still_listed_at_the_second_look_is_killed(stuck_client):
    # The reference for the next test: the same rounds, the client listed throughout.
    daemon = ListingDaemon([stuck_client.pid])
    handler = FaultHandler(0.0, is_client=lambda pid, server: "")
    two_rounds(handler, daemon)
    assert stuck_client.wait(10) == -9 and handler.counts == {"terminate_client": 1, "sigkill": 1}


def test_a_client_that_left_the_list_before_the_sigkill_is_not_killed(stuck_client):
    # Listed at the first round and when the second one reads the list, gone from it by the
    # look taken once its pidfd is held (the PID could now be anyone's): not signalled,
    # although the proof asked after that look would say it is a client.
    daemon = ListingDaemon([stuck_client.pid], [stuck_client.pid], [])
    handler = FaultHandler(0.0, is_client=lambda pid, server: "")
    two_rounds(handler, daemon)
    assert daemon.calls == 3, "the list was not read again before the SIGKILL"
    assert stuck_client.poll() is None, "killed although the daemon no longer listed it"
    assert "sigkill" not in handler.counts


def test_pid_0_1_and_mpsd_itself_are_never_acted_on_even_listed_and_proven(stuck_client):
    # The daemon lists 0, 1 and mpsd's own PID among a server's clients (a list is the daemon's
    # word; an impostor's, or a PID namespace mpsd cannot see into, gives 0), and the proof
    # says yes to every PID. None of them is sent terminate_client or asked about; the real
    # client is. (The proof refuses them here all the same: without the guard the test fails
    # on what was sent and asked, and signals nothing it must not.)
    protected = [0, 1, os.getpid()]
    asked: list[int] = []

    def is_client(pid: int, server: int) -> str:
        asked.append(pid)
        return "" if pid == stuck_client.pid else "refused by the test: a protected PID reached the proof"

    daemon = ListingDaemon([*protected, stuck_client.pid])
    handler = FaultHandler(0.0, is_client=is_client)
    two_rounds(handler, daemon)
    assert daemon.terminated == [stuck_client.pid]
    assert asked == [stuck_client.pid]
    assert stuck_client.wait(10) == -9
