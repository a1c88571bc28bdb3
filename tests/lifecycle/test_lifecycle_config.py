"""daemonLifecycle: a YAML key, a flag and an environment variable like every key; a bad value is
one line naming it and what is accepted; a reload cannot switch it under a running daemon."""

from __future__ import annotations

import pytest

from mpsd import config as cfg
from mpsd.errors import ConfigError
from mpsd.config.reload import merge_live


def test_owned_is_the_default():
    assert cfg.default_config().daemon_lifecycle == "owned"


def test_file_flag_and_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\ndaemonLifecycle: independent\n")
    assert cfg.load(str(path), {}, {}).daemon_lifecycle == "independent"
    assert cfg.load(None, {"MPSD_DAEMON_LIFECYCLE": "independent"}, {}).daemon_lifecycle == "independent"
    assert cfg.load(str(path), {}, {"daemon-lifecycle": "owned"}).daemon_lifecycle == "owned"  # flag > file


@pytest.mark.parametrize("bad", ["Independent", "detached", "", 1])
def test_a_bad_value_is_one_line_naming_it(bad):
    with pytest.raises(ConfigError) as exc:
        cfg.load(None, {}, {"daemon-lifecycle": bad})
    message = str(exc.value)
    assert "\n" not in message and "daemonLifecycle: expected owned or independent, got" in message


def test_a_reload_defers_it_to_the_next_start():
    current = cfg.default_config()
    merged, live, later = merge_live(current, cfg.replace(current, daemon_lifecycle="independent"))
    assert merged.daemon_lifecycle == "owned" and "daemonLifecycle" not in live and later == ["daemonLifecycle"]
