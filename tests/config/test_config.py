"""The configuration contract: YAML v1, flags, MPSD_ env, precedence, one-line errors."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd import config as cfg
from mpsd.errors import ConfigError

G = 1 << 30


def write(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_contract():
    c = cfg.default_config()
    assert c.control_binary == "nvidia-cuda-mps-control"
    assert c.pipe_dir == "/tmp/nvidia-mps" and c.log_dir == "/var/log/nvidia-mps"
    assert c.visible_devices is None and c.client_priority is None
    assert c.active_thread_percentage == 100.0 and c.pinned_mem_limit == {}
    assert (c.health_interval, c.health_timeout) == (5.0, 3.0)
    assert (c.restart_backoff_initial, c.restart_backoff_max, c.shutdown_timeout) == (0.2, 30.0, 10.0)
    assert c.metrics_address == "0.0.0.0:9400" and c.state_dir == "/var/lib/mpsd"
    assert c.shim_library is None and c.nvml_library is None and c.log_level == "info"
    dp = c.device_plugin
    assert (dp.enabled, dp.resource_name, dp.slices_per_gpu) == (False, "mpsd.io/gpu", 10)
    assert dp.kubelet_dir == "/var/lib/kubelet/device-plugins"
    assert dp.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert (dp.region_dir, dp.shim_host_dir, dp.shm_dir) == (
        "/var/lib/mpsd/regions",
        "/var/lib/mpsd/lib",
        "/var/lib/mpsd/shm",
    )
    assert dp.ipc_mode == "hostIPC"


def test_full_file(tmp_path):
    path = write(
        tmp_path,
        """
version: v1
controlBinary: /opt/nvidia/bin/nvidia-cuda-mps-control
pipeDir: /run/mpsd/pipe
visibleDevices: "0,GPU-1234"
activeThreadPercentage: 50
pinnedMemLimit: "0=20G,1=10G"
clientPriority: 1
exclusiveProcess: true
healthInterval: 500ms
restartBackoffMax: 1m
metricsAddress: ""
devicePlugin:
  enabled: true
  slicesPerGpu: 4
  ipcMode: tmpfs
""",
    )
    c = cfg.load(path, {}, {})
    assert c.control_binary == "/opt/nvidia/bin/nvidia-cuda-mps-control"
    assert c.visible_devices == "0,GPU-1234"
    assert c.active_thread_percentage == 50.0
    assert c.pinned_mem_limit == {0: 20 * G, 1: 10 * G}
    assert c.client_priority == 1 and c.exclusive_process is True
    assert c.health_interval == 0.5 and c.restart_backoff_max == 60.0
    assert c.metrics_address == ""
    assert (c.device_plugin.enabled, c.device_plugin.slices_per_gpu, c.device_plugin.ipc_mode) == (True, 4, "tmpfs")
    assert c.source == path


def test_to_dict_round_trips_through_yaml(tmp_path):
    c = cfg.load(None, {}, {"pinned-mem-limit": "0=1044M,GPU-ab=2G", "client-priority": "1", "slices-per-gpu": "7"})
    again = cfg.load(write(tmp_path, yaml.safe_dump(c.to_dict())), {}, {})
    assert again == c


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = write(tmp_path, "version: v1\nhealthInterval: 7s\nhealthTimeout: 2s\nshutdownTimeout: 4s\n")
    env = {"MPSD_HEALTH_INTERVAL": "8s", "MPSD_HEALTH_TIMEOUT": "1s"}
    c = cfg.load(path, env, {"health-interval": "9s"})
    assert c.health_interval == 9.0  # flag
    assert c.health_timeout == 1.0  # env
    assert c.shutdown_timeout == 4.0  # file
    assert c.restart_backoff_max == 30.0  # default


def test_every_setting_has_flag_and_env():
    for s in cfg.SETTINGS:
        assert s.env == "MPSD_" + s.flag.upper().replace("-", "_")
        c = cfg.load(None, {}, {})
        assert c.get(s.key) == s.parse(s.default)
    assert cfg.BY_FLAG["slices-per-gpu"].env == "MPSD_SLICES_PER_GPU"


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "version: v1\ndevicePlugin:\n  slicesPerGpu: ten\n",
            'devicePlugin.slicesPerGpu: expected an integer 1..100, got "ten"',
        ),
        (
            "version: v1\ndevicePlugin:\n  slicesPerGpu: 101\n",
            "devicePlugin.slicesPerGpu: expected an integer 1..100, got 101",
        ),
        ("version: v1\nactiveThreadPercentage: 0\n", "activeThreadPercentage: expected a number in (0, 100], got 0"),
        ("version: v1\nactiveThreadPercentage: 150\n", "activeThreadPercentage: expected a number in (0, 100]"),
        ("version: v1\npinnedMemLimit: 0=4Q\n", "pinnedMemLimit: expected DEVICE=SIZE"),
        ("version: v1\npinnedMemLimit: 0=1G,0=2G\n", "pinnedMemLimit: expected DEVICE=SIZE"),
        ("version: v1\nclientPriority: 2\n", "clientPriority: expected an integer 0..1, got 2"),
        (
            "version: v1\nhealthInterval: soon\n",
            "healthInterval: expected a duration such as 500ms, 2s, 1m or a number of seconds, "
            'at most 7 days, got "soon"',
        ),
        ("version: v1\nhealthInterval: 0s\n", "healthInterval: expected a duration above zero"),
        ("version: v1\nhealthInterval: .nan\n", "healthInterval: expected a duration such as 500ms"),
        ("version: v1\nshutdownTimeout: .inf\n", "shutdownTimeout: expected a duration such as 500ms"),
        (
            "version: v1\nhealthInterval: 1.0e+10\n",
            "healthInterval: expected a duration such as 500ms, 2s, 1m or a number of seconds, "
            "at most 7 days, got 10000000000.0",
        ),
        ("version: v1\nrestartBackoffMax: 10081m\n", "at most 7 days"),
        # a zero backoff would restart a crashing daemon in a tight loop
        ("version: v1\nrestartBackoffInitial: 0\n", "restartBackoffInitial: expected a duration above zero"),
        ("version: v1\nrestartBackoffMax: 0s\n", "restartBackoffMax: expected a duration above zero"),
        ("version: v1\nexclusiveProcess: maybe\n", 'exclusiveProcess: expected true or false, got "maybe"'),
        ("version: v1\nmetricsAddress: localhost\n", "metricsAddress: expected host:port"),
        ("version: v1\nmetricsAddress: '::1:9400'\n", "metricsAddress: expected host:port"),  # IPv6 needs [ ]
        ("version: v1\nmetricsAddress: 'a b:9400'\n", "metricsAddress: expected host:port"),
        ("version: v1\nmetricsAddress: 'localhost:²'\n", "metricsAddress: expected host:port"),
        ("version: v1\nmetricsAddress: 'localhost:65536'\n", "metricsAddress: expected host:port"),
        ("version: v1\ndevicePlugin:\n  slicesPerGpu: '²'\n", "slicesPerGpu: expected an integer 1..100, got"),
        ("version: v1\ndevicePlugin:\n  slicesPerGpu: '٣'\n", "slicesPerGpu: expected an integer 1..100, got"),
        ("version: v1\ndevicePlugin: null\n", "devicePlugin: expected a mapping of its settings, got None"),
        ("version: v1\nvisibleDevices: all\n", "visibleDevices: expected a comma-separated list"),
        ("version: v1\nlogLevel: loud\n", "logLevel: expected debug | info | warning | error"),
        ("version: v1\ndevicePlugin:\n  ipcMode: host\n", "devicePlugin.ipcMode: expected hostIPC or tmpfs"),
        ("version: v1\npipeDir: ''\n", "pipeDir: expected a non-empty path"),
        ("version: v1\npipeDirectory: /x\n", "pipeDirectory: unknown key; known keys here:"),
        ("version: v1\ndevicePlugin:\n  slices: 3\n", "devicePlugin.slices: unknown key; known keys here: enabled,"),
        ("version: v2\n", 'version: expected v1, got "v2"'),
        ("pipeDir: /x\n", "version: required, expected v1"),
        ("- a\n- b\n", "expected a mapping with version: v1"),
        ("version: v1\npipeDir: [unclosed\n", "not valid YAML at line"),
    ],
)
def test_file_errors_are_one_line_naming_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        cfg.load(path, {}, {})
    text = str(info.value)
    assert message in text
    assert text.startswith(path)
    assert "\n" not in text


@pytest.mark.parametrize("address", ["0.0.0.0:9400", ":9400", "[::1]:0", "localhost:9400", "10.0.0.1:65535", ""])
def test_metrics_addresses_accepted(address):
    assert cfg.load(None, {}, {"metrics-address": address}).metrics_address == address


def test_env_and_flag_errors_name_their_origin():
    with pytest.raises(
        ConfigError, match=r"^environment MPSD_SLICES_PER_GPU: devicePlugin.slicesPerGpu: expected an integer 1..100"
    ):
        cfg.load(None, {"MPSD_SLICES_PER_GPU": "0"}, {})
    with pytest.raises(ConfigError, match=r"^flag --pinned-mem-limit: pinnedMemLimit: expected DEVICE=SIZE"):
        cfg.load(None, {}, {"pinned-mem-limit": "lots"})
    with pytest.raises(ConfigError, match="unknown setting"):
        cfg.load(None, {}, {"no-such-flag": "1"})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        cfg.load(str(tmp_path / "absent.yaml"), {}, {})


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("off", False), ("False", False)])
def test_bool_spellings_from_env(value, expected):
    assert cfg.load(None, {"MPSD_EXCLUSIVE_PROCESS": value}, {}).exclusive_process is expected


def test_changed_keys():
    a = cfg.default_config()
    b = cfg.load(None, {}, {"active-thread-percentage": "50", "pipe-dir": "/x", "slices-per-gpu": "3"})
    assert cfg.changed_keys(a, b) == ["pipeDir", "activeThreadPercentage", "devicePlugin.slicesPerGpu"]


def test_describe_is_one_line_with_every_key():
    line = cfg.describe(cfg.default_config())
    assert "\n" not in line
    for s in cfg.SETTINGS:
        assert f"{s.key}=" in line


@settings(max_examples=60, deadline=None)
@given(
    atp=st.floats(min_value=0.01, max_value=100.0, allow_nan=False),
    limits=st.dictionaries(st.integers(0, 63), st.integers(1, 1 << 20).map(lambda mib: mib << 20), max_size=4),
    priority=st.sampled_from([None, 0, 1]),
    interval_ms=st.integers(1, 10**6),
    slices=st.integers(1, 100),
    exclusive=st.booleans(),
    devices=st.sampled_from([None, "0", "0,1", "GPU-abc,1"]),
)
def test_any_valid_config_round_trips_through_yaml(
    tmp_path_factory, atp, limits, priority, interval_ms, slices, exclusive, devices
):
    from mpsd.units import format_limits

    c = cfg.load(
        None,
        {},
        {
            "active-thread-percentage": atp,
            "pinned-mem-limit": format_limits(limits),
            "client-priority": priority,
            "health-interval": f"{interval_ms}ms",
            "slices-per-gpu": slices,
            "exclusive-process": exclusive,
            "visible-devices": devices,
        },
    )
    assert c.pinned_mem_limit == limits and c.client_priority == priority
    assert c.health_interval == pytest.approx(interval_ms / 1000)
    path = tmp_path_factory.mktemp("rt") / "c.yaml"
    path.write_text(yaml.safe_dump(c.to_dict()))
    assert cfg.load(str(path), {}, {}) == c
