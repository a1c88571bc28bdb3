"""The control daemon child: its exit is reported once, and a reaped PID is never signalled."""

from __future__ import annotations

import os
import threading
import time

from mpsd import config as cfg
from mpsd.daemon.process import DaemonProcess


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


def test_visible_devices_reach_the_daemon_in_nvidia_smi_order(tmp_path, monkeypatch):
    binary = tmp_path / "control"
    binary.write_text("#!/bin/sh\nenv\n")
    binary.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # mpsd's own must not leak through
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")
    config = cfg.load(None, {}, {"control-binary": str(binary), "log-dir": str(tmp_path), "visible-devices": "1,3"})
    exited = threading.Event()
    DaemonProcess(config, lambda d, code: exited.set())
    assert exited.wait(30)
    log = tmp_path / "control.log"
    deadline = time.monotonic() + 10
    while not all(k in (log.read_text() if log.exists() else "") for k in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE")):
        assert time.monotonic() < deadline, "daemon output never reached control.log"
        time.sleep(0.02)
    env = dict(line.split("=", 1) for line in log.read_text().splitlines() if "=" in line)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env


def test_a_device_plugin_that_stops_makes_the_node_not_ready(tmp_path, monkeypatch):
    import mpsd.plugin
    from mpsd.errors import PluginError
    from mpsd.lifecycle.health import HealthBoard
    from mpsd.node import _ready, _start_plugin

    library = tmp_path / "libmpsshim.so"
    library.write_bytes(b"")
    config = cfg.load(None, {}, {"device-plugin": "true", "shim-library": str(library)})
    board = HealthBoard()
    board.update(daemon_up=True, configured=True)
    assert _ready(board, None) == (True, "")
    calls = []

    def failing(config, **kwargs):
        calls.append(kwargs)
        raise PluginError("kubelet registration refused: unknown API version")

    monkeypatch.setattr(mpsd.plugin, "run_plugin", failing)
    plugin = _start_plugin(config, board, None, list, threading.Event())
    plugin.thread.join(30)
    assert calls and calls[0]["shim_library"] == str(library)
    assert _ready(board, plugin) == (False, "device plugin stopped: kubelet registration refused: unknown API version")

    monkeypatch.setattr(mpsd.plugin, "run_plugin", lambda config, **kwargs: None)  # returns without a stop
    plugin = _start_plugin(config, board, None, list, threading.Event())
    plugin.thread.join(30)
    assert _ready(board, plugin) == (False, "device plugin stopped without being asked to")

    stop = threading.Event()
    stop.set()
    plugin = _start_plugin(config, board, None, list, stop)  # asked to stop: no problem
    plugin.thread.join(30)
    assert plugin.problem == ""
