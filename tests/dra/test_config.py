"""The dra.* settings: defaults of the contract, file, environment and flags, one-line errors."""

from __future__ import annotations

import pytest

from mpsd import config as cfg
from mpsd.errors import ConfigError


def test_defaults_match_the_contract():
    d = cfg.default_config().dra
    assert (d.enabled, d.driver_name, d.mode) == (False, "gpu.mpsd.io", "capacity")
    assert (d.plugins_dir, d.registry_dir, d.cdi_dir) == (
        "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi")
    assert d.dev_root == "/"  # the driver's device nodes in the host's /dev


def test_file_env_and_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("version: v1\ndra:\n  enabled: true\n  mode: slices\n  cdiDir: /etc/cdi\n")
    c = cfg.load(str(f), {"MPSD_DRA_DRIVER_NAME": "gpu.example.com"}, {"dra-plugins-dir": "/k/plugins"})
    assert (c.dra.enabled, c.dra.mode, c.dra.cdi_dir) == (True, "slices", "/etc/cdi")
    assert (c.dra.driver_name, c.dra.plugins_dir) == ("gpu.example.com", "/k/plugins")
    assert c.to_dict()["dra"]["driverName"] == "gpu.example.com"
    assert cfg.load(None, {"MPSD_DRA_DEV_ROOT": "/run/nvidia/driver"}, {}).dra.dev_root == "/run/nvidia/driver"


@pytest.mark.parametrize("key, value, message", [
    ("dra.mode", "shares", 'dra.mode: expected capacity or slices, got "shares"'),
    ("dra.driverName", "GPU.mpsd.io", "dra.driverName: expected a DNS subdomain"),
    ("dra.driverName", "gpu", "dra.driverName: expected a DNS subdomain"),
    ("dra.driverName", "a." + "b" * 62, "dra.driverName: expected a DNS subdomain"),
    ("dra.enabled", "maybe", "dra.enabled: expected true or false"),
    ("dra.devRoot", "run/nvidia/driver", 'dra.devRoot: expected an absolute path, got "run/nvidia/driver"'),
])
def test_bad_values_are_one_line(key, value, message):
    with pytest.raises(ConfigError, match=message) as info:
        cfg.load(None, {}, {key: value})
    assert "\n" not in str(info.value) and "flag --dra" in str(info.value)


def test_an_unknown_dra_key_names_the_known_ones(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("version: v1\ndra:\n  cdidir: /x\n")
    with pytest.raises(ConfigError, match="dra.cdidir: unknown key; known keys here: cdiDir, devRoot, driverName"):
        cfg.load(str(f), {}, {})
