"""What mpsd prints comes partly from others: a client's argv in the daemon's ``ps`` (chosen by
the pod), region file names, a pod's region contents in error messages. Control characters
(C0, DEL, C1, and with ESC every escape sequence) are printed escaped, never sent to the
operator's terminal: one pure function (mpsd.errors.printable) behind every table and line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpsd.errors import one_line, printable
from mpsd.status import render_status

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "python \x1b]0;owned\x07\x1b[2J\x1b[31mred\x9b1m\r\x00\x7f\x85\u202eevil\u2028x"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("python serve.py --port 8000", "python serve.py --port 8000"),
        ("naïve 日本語 ✓", "naïve 日本語 ✓"),  # printable text stays as it is
        ("\x1b[2J", "\\x1b[2J"),  # ESC: no sequence reaches the terminal
        ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),  # OSC ended by BEL
        ("a\tb\nc\rd\x00", "a\\tb\\nc\\rd\\x00"),  # C0
        ("\x7f", "\\x7f"),  # DEL
        ("\x9b31m\x85\x90", "\\x9b31m\\x85\\x90"),  # C1: CSI, NEL, DCS
        ("\u202eevil\u2028", "\\u202eevil\\u2028"),  # bidi override, line separator
        ("\U000e0001", "\\U000e0001"),  # a format character outside the BMP
        ("\udcff", "\\udcff"),  # a lone surrogate (os.fsdecode of a byte that is not UTF-8)
        ("", ""),
    ],
)
def test_printable_escapes_every_control_character(text, shown):
    assert printable(text) == shown


def test_one_line_is_printable_too():
    assert one_line("bad\n  value \x1b[2J") == "bad value \\x1b[2J"


def terminal_safe(text: str) -> bool:
    return all(ch.isprintable() or ch == "\n" for ch in text)


def test_status_table_prints_no_control_character_from_the_daemons_answers():
    data = {
        "pipeDir": "/run/mps\x1b[2J",
        "daemon": "up",
        "error": "front-end said \x1b[31mno",
        "settings": {"activeThreadPercentage": 100.0, "pinnedMemLimit": {}, "clientPriority": 0},
        "servers": [{"pid": 900, "clients": [901]}],
        "gpus": [{"index": 0, "name": "H100\x1b[8m", "uuid": "GPU-1\x07", "memory_used": 0, "memory_total": 1 << 30}],
        "clients": [{"pid": 901, "client_id": 0, "server": 900, "device": "GPU-1\x1b[A", "namespace": "1",
                     "command": HOSTILE}],
    }
    text = render_status(data)
    assert terminal_safe(text)
    assert len(text.splitlines()) == 6  # nothing in a field starts a line of its own
    assert text.splitlines()[-1].endswith(printable(HOSTILE))


def test_shim_usage_error_for_a_hostile_region_name_is_printable(tmp_path):
    region = tmp_path / "r\x1b[2J\x1b]0;owned\x07"
    region.write_bytes(b"\0" * 64)  # a regular file of no region's size: the library's refusal names it
    result = subprocess.run([sys.executable, "-m", "shim", "usage", str(region)], capture_output=True, text=True,
                            cwd=REPO, timeout=60, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert terminal_safe(result.stderr), repr(result.stderr)


def test_mpsd_status_prints_no_control_character_of_a_pipe_dir(tmp_path):
    pipe = tmp_path / "p\x1b[2J"
    result = subprocess.run([sys.executable, "-m", "mpsd", "status", f"--pipe-dir={pipe}",
                             "--control-binary=/bin/false"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout.startswith("daemon: ")
    assert terminal_safe(result.stdout + result.stderr), repr(result.stdout + result.stderr)
