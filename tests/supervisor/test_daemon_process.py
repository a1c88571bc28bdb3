"""The control daemon child: its exit is reported once, and a reaped PID is never signalled."""

from __future__ import annotations

import os
import threading

from mpsd import config as cfg
from mpsd.daemon import DaemonProcess


def test_kill_after_exit_signals_no_reaped_pid(tmp_path, monkeypatch):
    binary = tmp_path / "control"
    binary.write_text("#!/bin/sh\necho started\nexit 3\n")
    binary.chmod(0o755)
    config = cfg.load(None, {}, {"control-binary": str(binary), "log-dir": str(tmp_path)})
    exited = threading.Event()
    codes: list[int] = []
    daemon = DaemonProcess(config, lambda d, code: (codes.append(code), exited.set()))
    assert exited.wait(30) and codes == [3]
    assert not daemon.alive()
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append((-pgid, sig)))
    daemon.kill()  # the PID may have been reused by now: only the group may be signalled
    assert (daemon.pid, 9) not in signalled and signalled == [(-daemon.pid, 9)]
