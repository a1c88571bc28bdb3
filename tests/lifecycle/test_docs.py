"""The configuration reference lists every setting with its flag, env variable and default."""

from __future__ import annotations

from pathlib import Path

from mpsd import config as cfg

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_setting_is_documented_with_flag_env_and_key():
    text = DOC.read_text()
    for s in cfg.SETTINGS:
        row = next((line for line in text.splitlines() if line.startswith(f"| `--{s.flag}` |")), None)
        assert row is not None, f"--{s.flag} missing from {DOC}"
        assert f"`{s.env}`" in row and f"`{s.key}`" in row


def test_cli_has_a_flag_for_every_setting():
    from mpsd.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for s in cfg.SETTINGS:
        assert f"--{s.flag}" in help_text
