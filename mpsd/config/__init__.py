"""mpsd's configuration: a versioned YAML file, environment variables and flags.

Precedence: flag > environment (``MPSD_`` + flag name) > file > default. Every setting is one
row of :data:`SETTINGS`; the CLI builds its flags from the same table, and the docs list it.
Every error is a ConfigError with one line naming the key and the accepted form.

The package: the table of settings and their parsers (settings.py), the values as a typed
:class:`Config` and their loading (here), the file read as untrusted input (yamlfile.py), what a
SIGHUP reload changes at once (reload.py). It imports only mpsd.errors and mpsd.units.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError
from ..units import SHOWN, format_limits
from . import yamlfile
from .settings import BY_FLAG, BY_KEY, MAX_PIPE_DIR_BYTES, SETTINGS, VERSION, Setting, _snake, parse_address

__all__ = [
    "BY_FLAG", "BY_KEY", "MAX_PIPE_DIR_BYTES", "SETTINGS", "VERSION", "Config", "DevicePluginConfig", "DraConfig",
    "MigConfig", "MpsConfig", "Setting", "changed_keys", "default_config", "describe", "format_value", "load",
    "parse_address", "read_file", "replace",
]


@dataclass(frozen=True)
class DevicePluginConfig:
    enabled: bool
    resource_name: str
    slices_per_gpu: int
    kubelet_dir: str
    pod_resources_socket: str
    region_dir: str
    shim_host_dir: str
    ipc_mode: str
    shm_dir: str
    memory_limit: str = ""


@dataclass(frozen=True)
class DraConfig:
    enabled: bool = False
    driver_name: str = "gpu.mpsd.io"
    mode: str = "capacity"
    plugins_dir: str = "/var/lib/kubelet/plugins"
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"
    dev_root: str = "/"
    taint_after: float = 30.0
    taint_effect: str = "NoSchedule"


@dataclass(frozen=True)
class MpsConfig:
    protocol: str = "auto"
    shim: str = "auto"
    cgroup_root: str = "/sys/fs/cgroup"


@dataclass(frozen=True)
class MigConfig:
    enabled: bool = True
    pipe_root: str = "/tmp/nvidia-mps-mig"
    slices_per_instance: str | int = "auto"
    sm_partition_profiles: tuple[str, ...] = ()
    caps_file: str = "/proc/driver/nvidia-caps/mig-minors"
    caps_dir: str = "/dev/nvidia-caps"


@dataclass(frozen=True)
class Config:
    control_binary: str
    pipe_dir: str
    log_dir: str
    visible_devices: str | None
    active_thread_percentage: float
    pinned_mem_limit: dict[int | str, int]
    client_priority: int | None
    exclusive_process: bool
    nvidia_smi: str
    health_interval: float
    health_timeout: float
    verdict_timeout: float
    restart_backoff_initial: float
    restart_backoff_max: float
    shutdown_timeout: float
    metrics_address: str
    state_dir: str
    shim_library: str | None
    nvml_library: str | None
    log_level: str
    fault_policy: str
    device_plugin: DevicePluginConfig
    dra: DraConfig = field(default_factory=DraConfig)
    mps: MpsConfig = field(default_factory=MpsConfig)
    daemon_lifecycle: str = "owned"
    mig: MigConfig = field(default_factory=MigConfig)
    multi_user: str = "auto"  # auto | on | off (mpsd.daemon.multiuser)
    log_max_size: int = 64 << 20  # rotation of the daemon's logs (mpsd.daemon.logfiles); 0: never
    log_keep: int = 3
    source: str | None = field(default=None, compare=False)  # the file it came from

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape back (durations as seconds, limits in MPS syntax)."""
        out: dict[str, Any] = {"version": VERSION}
        for s in SETTINGS:
            value = self.get(s.key)
            if s.key == "pinnedMemLimit":
                value = format_limits(value)
            section, _, name = s.key.rpartition(".")
            (out.setdefault(section, {}) if section else out)[name or s.key] = value
        return out

    def get(self, key: str) -> Any:
        obj: Any = self
        for part in key.split("."):
            obj = getattr(obj, _snake(part))
        return obj


def default_config() -> Config:
    return load(None, {}, {})


def load(path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]) -> Config:
    """Resolve the config from a file (or none), the environment and flag overrides.

    ``overrides`` is keyed by YAML key (``devicePlugin.slicesPerGpu``) or flag name
    (``slices-per-gpu``); ``None`` values are ignored (flag not given)."""
    raw: dict[str, Any] = {s.key: s.default for s in SETTINGS}
    origin: dict[str, str] = {s.key: "default" for s in SETTINGS}
    if path is not None:
        for key, value in read_file(path).items():
            raw[key], origin[key] = value, path
    for s in SETTINGS:
        if s.env in env:
            raw[s.key], origin[s.key] = env[s.env], f"environment {s.env}"
    for name, value in overrides.items():
        if value is None:
            continue
        flag = BY_KEY.get(name) or BY_FLAG.get(name)
        if flag is None:
            raise ConfigError(f"unknown setting {name!r}")
        raw[flag.key], origin[flag.key] = value, f"flag --{flag.flag}"
    values: dict[str, Any] = {}
    for s in SETTINGS:
        try:
            values[s.key] = s.parse(raw[s.key])
        except ValueError as exc:
            raise ConfigError(f"{origin[s.key]}: {s.key}: expected {exc}, got {_show(raw[s.key])}") from None
    top = {s.attr: values[s.key] for s in SETTINGS if "." not in s.key}
    mps = MpsConfig(**{s.attr: values[s.key] for s in SETTINGS if s.key.startswith("mps.")})
    plugin = DevicePluginConfig(**{s.attr: values[s.key] for s in SETTINGS if s.key.startswith("devicePlugin.")})
    dra = DraConfig(**{s.attr: values[s.key] for s in SETTINGS if s.key.startswith("dra.")})
    mig = MigConfig(**{s.attr: values[s.key] for s in SETTINGS if s.key.startswith("mig.")})
    return Config(**top, device_plugin=plugin, dra=dra, mps=mps, mig=mig, source=path)


def read_file(path: str) -> dict[str, Any]:
    """The file's settings as {dotted key: raw value}; unknown keys and versions rejected.
    Reading and parsing are bounded (mpsd.config.yamlfile); every failure is one ConfigError line."""
    data = yamlfile.load(path)
    path = yamlfile.display(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with version: {VERSION}, got {_show(data)}")
    if "version" not in data:
        raise ConfigError(f"{path}: version: required, expected {VERSION}")
    if data["version"] != VERSION:
        raise ConfigError(f"{path}: version: expected {VERSION}, got {_show(data['version'])}")
    flat: dict[str, Any] = {}
    _flatten(path, data, "", flat)
    return flat


def _flatten(path: str, data: dict, prefix: str, out: dict[str, Any]) -> None:
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key == "version":
            continue
        if key in BY_KEY:
            out[key] = value
        elif any(k.startswith(key + ".") for k in BY_KEY):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: {key}: expected a mapping of its settings, got {_show(value)}")
            _flatten(path, value, key + ".", out)
        else:
            known = sorted(
                {k.split(".")[0] if not prefix else k[len(prefix) :] for k in BY_KEY if k.startswith(prefix)}
            )
            shown = name if isinstance(name, str) and name.isprintable() and len(name) <= SHOWN else _show(name)
            raise ConfigError(f"{path}: {prefix}{shown}: unknown key; known keys here: {', '.join(known)}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, SHOWN, SHOWN


def _quote(value: Any) -> str:
    """A setting on one line: strings in double quotes, escaped when they hold a line break."""
    if isinstance(value, str):
        return f'"{value}"' if value.isprintable() else repr(value)
    return repr(value)


def _show(value: Any) -> str:
    """A bad value for a one-line error: quoted as _quote does, and cut short."""
    if isinstance(value, str):
        return _quote(value) if len(value) <= SHOWN else f"{_quote(value[:SHOWN])}... ({len(value)} characters)"
    if isinstance(value, int) and value.bit_length() > 64:  # repr() of 4300+ digits raises
        return f"an integer of {value.bit_length()} bits"
    return _REPR.repr(value)


def describe(config: Config) -> str:
    """One log line with every resolved setting."""
    return " ".join(f"{s.key}={format_value(config, s.key)}" for s in SETTINGS)


def format_value(config: Config, key: str) -> str:
    value = config.get(key)
    if key == "pinnedMemLimit":
        value = format_limits(value)
    return _quote(value)


def changed_keys(old: Config, new: Config) -> list[str]:
    return [s.key for s in SETTINGS if old.get(s.key) != new.get(s.key)]


def replace(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, **changes)
