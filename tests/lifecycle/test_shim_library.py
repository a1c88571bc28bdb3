"""Which libmpsshim.so clients get: one rule for `mpsd exec` and the device plugin."""
from __future__ import annotations

import threading

import pytest

from mpsd import config as cfg
from mpsd.errors import MpsdError
from mpsd.lifecycle.health import HealthBoard
from mpsd.node import _ready, _start_plugin, shim_library_path


def _config(**values: str) -> cfg.Config:
    return cfg.load(None, {}, {"metrics-address": "", **values})


def test_a_configured_library_that_exists_is_used(tmp_path):
    lib = tmp_path / "libmpsshim.so"
    lib.write_bytes(b"\x7fELF")
    assert shim_library_path(_config(**{"shim-library": str(lib)})) == str(lib)


def test_a_configured_library_that_is_missing_is_named(tmp_path):
    missing = tmp_path / "nope.so"
    with pytest.raises(MpsdError, match=r"shimLibrary '.*nope\.so': no such file"):
        shim_library_path(_config(**{"shim-library": str(missing)}))


def test_the_device_plugin_does_not_start_on_a_missing_library_and_readyz_says_why(tmp_path):
    missing = tmp_path / "nope.so"
    config = _config(**{"shim-library": str(missing), "device-plugin": "true"})
    board = HealthBoard()
    plugin = _start_plugin(config, board, None, list, threading.Event())
    assert plugin.thread is None
    ready, reason = _ready(board, plugin)
    assert not ready
    assert reason.startswith("device plugin not started: shimLibrary") and "nope.so" in reason
