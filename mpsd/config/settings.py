"""Every setting of mpsd's configuration as one row of :data:`SETTINGS` (key, flag, parser,
default, help), and the parsers of their values with their JSON schema: the one table the file,
the environment, the flags, the docs and the Helm chart's schema (mpsd/config/schema.py) follow. Pure."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, TypeVar

from ..errors import ConfigError
from ..units import (
    DEVICE_PATTERN as _DEVICE,
    LIMITS_FORM,
    LIMITS_PATTERN,
    PERCENTAGE_PATTERN,
    SIZE_PATTERN,
    duration_pattern,
    is_decimal,
    parse_duration,
    parse_limits,
    parse_percentage,
    parse_size,
)
from .address import ADDRESS_PATTERN, parse_address

VERSION = "v1"
LOG_LEVELS = ("debug", "info", "warning", "error")
IPC_MODES = ("hostIPC", "tmpfs")
PROTOCOLS = ("auto", "2", "3")
SHIM_MODES = ("auto", "on", "off")
LIFECYCLES = ("owned", "independent")  # daemonLifecycle (docs/operations.md, "Upgrading mpsd")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# ------------------------------------------------ value parsers (raise ValueError with the accepted form)

# What each parser accepts as JSON schema, never more (tests/config/test_config_schema.py): the Helm
# chart's schema is generated from it. Keywords of one type ignore values of another, so that
# {"type": ["number", "string"], "maximum": 100, "pattern": ...} bounds both.
SCHEMAS: dict[Callable[[Any], Any], dict[str, Any]] = {}
_Parser = TypeVar("_Parser", bound=Callable[[Any], Any])


def _accepts(**schema: Any) -> Callable[[_Parser], _Parser]:
    def record(parse: _Parser) -> _Parser:
        SCHEMAS[parse] = schema
        return parse

    return record


@_accepts(type="string")
def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a string")
    return value


@_accepts(type="string", minLength=1)
def _path(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("a non-empty path")
    return value


@_accepts(type="string", pattern="^/")
def _abs_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError("an absolute path")
    return value


# The daemon's sockets (PIPE/control_privileged) must fit a unix socket address: 535 starts with
# an 87-byte pipe dir and fails with 88 (seen on the real binary), leaving nothing to connect to.
MAX_PIPE_DIR_BYTES = 87
_ASCII_PATH = "^[ -~]+$"  # in ASCII a byte bound is a maxLength


@_accepts(type="string", maxLength=MAX_PIPE_DIR_BYTES, pattern=_ASCII_PATH)
def _pipe_dir(value: Any) -> str:
    path = _path(value)
    if len(os.fsencode(os.path.normpath(path))) > MAX_PIPE_DIR_BYTES:
        raise ValueError(f"a path of at most {MAX_PIPE_DIR_BYTES} bytes (the daemon's sockets in it must fit a "
                         "unix socket address)")
    return path


@_accepts(type=["string", "null"])
def _optional_path(value: Any) -> str | None:
    return None if value is None or value == "" else _path(value)


@_accepts(type="boolean")  # not "yes": the chart's templates read some of them as booleans
def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ValueError("true or false")


@cache  # one parser per range: SCHEMAS keeps each once
def _int_range(low: int, high: int) -> Callable[[Any], int]:
    @_accepts(type="integer", minimum=low, maximum=high)
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not (isinstance(value, int) or is_decimal(value)):
            raise ValueError(f"an integer {low}..{high}")
        number = int(value)
        if not low <= number <= high:
            raise ValueError(f"an integer {low}..{high}")
        return number

    return parse


@_accepts(type=["number", "string"], exclusiveMinimum=0, maximum=100, pattern=f"^{PERCENTAGE_PATTERN}$")
def _percentage(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("a number in (0, 100]")
    try:
        return parse_percentage(value)
    except ConfigError:
        raise ValueError("a number in (0, 100]") from None


@_accepts(type=["string", "null"], pattern=f"^({LIMITS_PATTERN})?$")
def _limits(value: Any) -> dict[int | str, int]:
    if value is None:
        return {}
    if not isinstance(value, str):
        raise ValueError(LIMITS_FORM)
    try:
        return parse_limits(value)
    except ConfigError:
        raise ValueError(LIMITS_FORM) from None


MAX_DURATION = 86400.0 * 7  # timers beyond this are mistakes; ~1e10 s overflows the loop's wait


# 0, or 1e-4 and up: Helm writes a number below as 5e-05, which YAML reads as a string
@_accepts(anyOf=[{"const": 0}, {"type": ["number", "string"], "minimum": 1e-4, "maximum": MAX_DURATION,
                                "pattern": duration_pattern(False)}])
def _duration(value: Any) -> float:
    accepted = "a duration such as 500ms, 2s, 1m or a number of seconds, at most 7 days"
    if isinstance(value, bool):
        raise ValueError(accepted)
    try:
        seconds = parse_duration(value)
    except ConfigError:
        raise ValueError(accepted) from None
    if seconds > MAX_DURATION:
        raise ValueError(accepted)
    return seconds


@_accepts(type=["number", "string"], minimum=1e-4, maximum=MAX_DURATION, pattern=duration_pattern(True))
def _positive_duration(value: Any) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise ValueError("a duration above zero such as 500ms, 2s, 1m")
    return seconds


@_accepts(type=["integer", "string", "null"], minimum=0, maximum=1, pattern="^[01]?$")
def _priority(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return _int_range(0, 1)(value)


@_accepts(type=["string", "integer", "array", "null"], minimum=0, pattern=f"^(|{_DEVICE}(,{_DEVICE})*)$",
          minItems=1, items={"type": ["string", "integer"], "minimum": 0, "pattern": f"^{_DEVICE}$"})
def _visible_devices(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, list) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str) or not re.fullmatch(f"{_DEVICE}(?:,{_DEVICE})*", value):
        raise ValueError('a comma-separated list of GPU indices or UUIDs such as "0,1" or "GPU-..."')
    return value


@_accepts(type=["string", "null"], maxLength=255, pattern=f"^({ADDRESS_PATTERN})?$")  # the host: 253 at most
def _address(value: Any) -> str:
    """What the metrics server accepts (parse_address), so check-config catches an address that
    ``mpsd run`` would refuse."""
    if value == "" or value is None:
        return ""
    if isinstance(value, str):
        try:
            parse_address(value)
            return value
        except ValueError:  # ConfigError, or int() of a port of thousands of digits
            pass
    raise ValueError('host:port such as "0.0.0.0:9400" or "[::1]:9400", port 0..65535, or "" to disable')


@cache
def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    @_accepts(type="string", enum=list(choices))
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(" or ".join(choices))
        return value

    return parse


_DRIVER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+")


@_accepts(type="string", maxLength=63, pattern=f"^{_DRIVER_NAME.pattern}$")
def _driver_name(value: Any) -> str:
    """A DRA driver name as the API server takes it: a lower-case DNS subdomain of at most 63
    characters with a domain of the vendor's (it names sockets and ResourceSlices too)."""
    if isinstance(value, str) and len(value) <= 63 and _DRIVER_NAME.fullmatch(value):
        return value
    raise ValueError("a DNS subdomain of at most 63 lower-case characters with a dot, e.g. gpu.mpsd.io")


MIG_PIPE_ROOT_BYTES = MAX_PIPE_DIR_BYTES - len("/MIG-00000000-0000-0000-0000-000000000000")


@_accepts(type="string", maxLength=MIG_PIPE_ROOT_BYTES, pattern=_ASCII_PATH)
def _mig_pipe_root(value: Any) -> str:
    """mig.pipeRoot: each instance's pipe dir is <pipeRoot>/<MIG-uuid>, which must fit like pipeDir."""
    path = _path(value)
    if len(os.fsencode(os.path.normpath(path))) > MIG_PIPE_ROOT_BYTES:
        raise ValueError(f"a path of at most {MIG_PIPE_ROOT_BYTES} bytes (<pipeRoot>/<MIG-uuid> is an instance's "
                         f"pipe dir, at most {MAX_PIPE_DIR_BYTES} bytes)")
    return path


# a string of at most 20 digits, as units.is_decimal takes
@_accepts(type=["string", "integer"], minimum=1, maximum=100,
          pattern="^(auto|0{0,19}[1-9]|0{0,18}[1-9][0-9]|0{0,17}100)$")
def _slices_per_instance(value: Any) -> str | int:
    """mig.slicesPerInstance: auto, or an integer 1..100."""
    if value == "auto":
        return value
    try:
        return _int_range(1, 100)(value)
    except ValueError:
        raise ValueError("auto or an integer 1..100") from None


_PROFILE = re.compile(r"(?:[1-8]c\.)?[1-8]g\.[0-9]+gb(?:[+-][a-z0-9]+(?:\.[a-z0-9]+)?)?")  # go-nvlib's spelling


@_accepts(type=["string", "array", "null"], pattern=f"^(|{_PROFILE.pattern}(,{_PROFILE.pattern})*)$",
          items={"type": "string", "pattern": f"^{_PROFILE.pattern}$"})
def _profiles(value: Any) -> tuple[str, ...]:
    """mig.smPartitionProfiles: MIG profiles, comma-separated ("1g.10gb,3g.40gb"), or "" for none."""
    if value is None or value == "":
        return ()
    items = value if isinstance(value, list) else value.split(",") if isinstance(value, str) else None
    if items is None or not all(isinstance(p, str) and _PROFILE.fullmatch(p.strip()) for p in items):
        raise ValueError('MIG profiles such as "1g.10gb,3g.40gb", or "" for none')
    return tuple(p.strip() for p in items)


@_accepts(type=["string", "null"], pattern=f"^(|{PERCENTAGE_PATTERN}%|{SIZE_PATTERN})$")
def _memory_limit(value: Any) -> str:
    """devicePlugin.memoryLimit: "" (no burst), a percentage of the GPU ("50%") or a size ("40G")."""
    accepted = 'a size such as 40G, a percentage of the GPU such as 50%, or "" for none'
    if value is None or value == "":
        return ""
    if isinstance(value, str) and value.endswith("%"):
        try:
            if 0 < float(value[:-1]) <= 100:
                return value
        except ValueError:
            pass
        raise ValueError(accepted)
    try:
        if isinstance(value, str) and parse_size(value) > 0:
            return value
    except ConfigError:
        pass
    raise ValueError(accepted)


MIN_LOG_SIZE = 64 << 10


# integers up to what a JSON number holds exactly; strings 0 or with a unit, 64K and up
@_accepts(anyOf=[{"const": 0}, {"type": "integer", "minimum": MIN_LOG_SIZE, "maximum": 1 << 53},
                 {"type": "string", "pattern": "^(0+|0*(6[4-9]|[7-9][0-9]|[1-9][0-9]{2,6})[Kk][Bb]?|"
                                               "0*[1-9][0-9]{0,6}[MGTmgt][Bb]?)$"}])
def _log_size(value: Any) -> int:
    """logMaxSize: 0 (never rotate) or a size of at least MIN_LOG_SIZE."""
    accepted = "0 (never rotate) or a size of at least 64K, such as 64M"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(accepted)
    try:
        size = parse_size(str(value))
    except ConfigError:
        raise ValueError(accepted) from None
    if size and size < MIN_LOG_SIZE:
        raise ValueError(accepted)
    return size


@_accepts(type=["string", "integer"], enum=[*PROTOCOLS, 2, 3])
def _protocol(value: Any) -> str:
    """mps.protocol: auto, 2 or 3 (YAML may give the numbers as integers)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if value in PROTOCOLS:
        return value
    raise ValueError(" | ".join(PROTOCOLS))


@_accepts(type=["string", "boolean"], enum=["auto", "on", "off", True, False])  # YAML's bare on/off
def _multi_user(value: Any) -> str:
    """auto | on | off; YAML 1.1 reads a bare on/off as a boolean, taken as on/off here."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.lower() in ("auto", "on", "off"):
        return value.lower()
    raise ValueError("auto, on or off")


@_accepts(type="string", enum=list(LOG_LEVELS))
def _log_level(value: Any) -> str:
    if isinstance(value, str) and value.lower() in LOG_LEVELS:
        return value.lower()
    raise ValueError(" | ".join(LOG_LEVELS))


@dataclass(frozen=True)
class Setting:
    key: str  # YAML path, dotted
    flag: str  # without the leading dashes
    parse: Callable[[Any], Any]
    default: Any  # in YAML form (parsed like any other value)
    help: str

    @property
    def attr(self) -> str:
        return _snake(self.key.split(".")[-1])

    @property
    def env(self) -> str:
        return "MPSD_" + self.flag.upper().replace("-", "_")

    @property
    def is_bool(self) -> bool:
        return self.parse is _bool


# fmt: off
SETTINGS: tuple[Setting, ...] = (
    Setting("controlBinary", "control-binary", _path, "nvidia-cuda-mps-control",
            "MPS control binary: a name on PATH or an absolute path"),
    Setting("pipeDir", "pipe-dir", _pipe_dir, "/tmp/nvidia-mps",
            "CUDA_MPS_PIPE_DIRECTORY of the daemon and its clients"),
    Setting("logDir", "log-dir", _path, "/var/log/nvidia-mps",
            "CUDA_MPS_LOG_DIRECTORY: control.log and server.log"),
    Setting("logMaxSize", "log-max-size", _log_size, "64M",
            "control.log (server.log of a detached daemon) is rotated before it passes this size; 0 = never"),
    Setting("logKeep", "log-keep", _int_range(0, 100), 3,
            "rotated logs kept (control.log.1 is the newest); 0 = older lines are dropped"),
    Setting("visibleDevices", "visible-devices", _visible_devices, None,
            "the daemon's CUDA_VISIBLE_DEVICES (\"0,1\" or UUIDs); empty = all GPUs"),
    Setting("activeThreadPercentage", "active-thread-percentage", _percentage, 100,
            "default active thread percentage of new servers, (0, 100]"),
    Setting("pinnedMemLimit", "pinned-mem-limit", _limits, "",
            'default pinned device memory limit per client, by device index: "0=20G,1=10G"'),
    Setting("clientPriority", "client-priority", _priority, None,
            "default client priority: 0 (normal) or 1 (below normal); empty = driver default"),
    Setting("exclusiveProcess", "exclusive-process", _bool, False,
            "set EXCLUSIVE_PROCESS compute mode on managed GPUs, restore it on exit"),
    Setting("nvidiaSmi", "nvidia-smi", _path, "nvidia-smi",
            "nvidia-smi used to change the compute mode"),
    Setting("healthInterval", "health-interval", _positive_duration, "5s",
            "time between health checks of the daemon"),
    Setting("healthTimeout", "health-timeout", _positive_duration, "3s",
            "a control command without answer in this time means the daemon hangs"),
    Setting("verdictTimeout", "verdict-timeout", _positive_duration, "30s",
            "/readyz fails once health checks were inconclusive (a held control session), or found "
            "the defaults changed again and again, this long"),
    Setting("restartBackoffInitial", "restart-backoff-initial", _positive_duration, "0.2s",
            "wait before the first restart; doubles with every failure in a row"),
    Setting("restartBackoffMax", "restart-backoff-max", _positive_duration, "30s",
            "longest wait between restarts"),
    Setting("shutdownTimeout", "shutdown-timeout", _positive_duration, "10s",
            "on SIGTERM: quit -t this long, then kill"),
    Setting("metricsAddress", "metrics-address", _address, "0.0.0.0:9400",
            'host:port of /metrics, /healthz, /readyz; "" disables'),
    Setting("stateDir", "state-dir", _path, "/var/lib/mpsd",
            "mpsd's own state (per-exec accounting regions)"),
    Setting("shimLibrary", "shim-library", _optional_path, None,
            "libmpsshim.so preloaded into clients; empty = the one in the shim package"),
    Setting("nvmlLibrary", "nvml-library", _optional_path, None,
            "libnvidia-ml.so.1 to load; empty = pynvml's search"),
    Setting("logLevel", "log-level", _log_level, "info",
            "debug | info | warning | error"),
    Setting("faultPolicy", "fault-policy", _choice(("report", "terminate")), "report",
            "clients of an MPS server in FAULT: report (leave them) | terminate (terminate_client, then SIGKILL)"),
    Setting("daemonLifecycle", "daemon-lifecycle", _choice(LIFECYCLES), "owned",
            "owned (mpsd's child, quit when mpsd stops) | independent (outlives mpsd; the next mpsd adopts it)"),
    Setting("multiUser", "multi-user", _multi_user, "auto",
            "one MPS server for every UID (-multiuser-server, driver 555+): auto (where the daemon can) | on | off"),
    Setting("devicePlugin.enabled", "device-plugin", _bool, False,
            "serve the kubelet device plugin"),
    Setting("devicePlugin.resourceName", "resource-name", _text, "mpsd.io/gpu",
            "extended resource name advertised to the kubelet"),
    Setting("devicePlugin.slicesPerGpu", "slices-per-gpu", _int_range(1, 100), 10,
            "slices advertised per GPU, 1..100"),
    Setting("devicePlugin.kubeletDir", "kubelet-dir", _path, "/var/lib/kubelet/device-plugins",
            "kubelet device-plugin socket directory"),
    Setting("devicePlugin.podResourcesSocket", "pod-resources-socket", _path,
            "/var/lib/kubelet/pod-resources/kubelet.sock",
            "kubelet pod-resources socket"),
    Setting("devicePlugin.regionDir", "region-dir", _path, "/var/lib/mpsd/regions",
            "host directory with one accounting region per allocation"),
    Setting("devicePlugin.shimHostDir", "shim-host-dir", _path, "/var/lib/mpsd/lib",
            "host directory where the shim is installed for pods, one file per region layout "
            "(libmpsshim.so.3; an older mpsd's libmpsshim.so is left for the containers it served)"),
    Setting("devicePlugin.ipcMode", "ipc-mode", _choice(IPC_MODES), "hostIPC",
            "hostIPC | tmpfs: how pods share /dev/shm with the daemon"),
    Setting("devicePlugin.shmDir", "shm-dir", _path, "/var/lib/mpsd/shm",
            "tmpfs mode: host tmpfs mounted as /dev/shm in daemon and pods"),
    Setting("devicePlugin.memoryLimit", "memory-limit", _memory_limit, "",
            "burst: a container's hard GPU memory limit above its slices (the guarantee): "
            "40G, or 50%% of the GPU; MPS v3 with memory partitioning only"),
    # the sharing backend (mpsd/sharing, docs/mps-v3.md)
    Setting("mps.protocol", "mps-protocol", _protocol, "auto",
            "auto (MPS v3 where the control binary and driver R615+ have it, else v2) | 2 | 3"),
    Setting("mps.shim", "mps-shim", _choice(SHIM_MODES), "auto",
            "auto (the shim only where the driver does not enforce and report memory) | on | off"),
    Setting("mps.cgroupRoot", "cgroup-root", _path, "/sys/fs/cgroup",
            "cgroup v2 mount: pods' cgroups whose GPU memory the driver limits (MPS v3)"),
    # MIG (mpsd/inventory/mig.py, docs/mig.md): one MPS control daemon per MIG instance
    Setting("mig.enabled", "mig", _bool, True,
            "serve the instances of GPUs in MIG mode (one MPS daemon per instance); false: leave them alone"),
    Setting("mig.pipeRoot", "mig-pipe-root", _mig_pipe_root, "/tmp/nvidia-mps-mig",
            "each instance's pipe dir is <pipeRoot>/<MIG-uuid> (its log dir <logDir>/<MIG-uuid>)"),
    Setting("mig.slicesPerInstance", "mig-slices-per-instance", _slices_per_instance, "auto",
            "slices of each instance: auto (slicesPerGpu, fewer where the instance cannot hold them) or 1..100"),
    Setting("mig.smPartitionProfiles", "mig-sm-partition-profiles", _profiles, "",
            "MIG profiles whose slices get static SM partitions instead of a thread cap (CUDA 13.1+ daemons)"),
    Setting("mig.capsFile", "mig-caps-file", _path, "/proc/driver/nvidia-caps/mig-minors",
            "the driver's MIG capability minors (/dev/nvidia-caps nodes of each instance)"),
    Setting("mig.capsDir", "mig-caps-dir", _path, "/dev/nvidia-caps",
            "where mpsd sees the host's /dev/nvidia-caps nodes (an instance without its nodes is not offered)"),
    # DRA: regionDir, shimHostDir, ipcMode, shmDir and slicesPerGpu (slices mode) are the device plugin's
    Setting("dra.enabled", "dra", _bool, False,
            "serve the DRA kubelet plugin (ResourceClaims prepared with CDI specs)"),
    Setting("dra.driverName", "dra-driver-name", _driver_name, "gpu.mpsd.io",
            "DRA driver name: registration, ResourceSlices, claims' results"),
    Setting("dra.mode", "dra-mode", _choice(("capacity", "slices")), "capacity",
            "capacity (one device per GPU, consumable memory and compute) | slices (N devices per GPU)"),
    Setting("dra.pluginsDir", "dra-plugins-dir", _path, "/var/lib/kubelet/plugins",
            "kubelet plugins directory: the DRA socket is <pluginsDir>/<driverName>/dra.sock"),
    Setting("dra.registryDir", "dra-registry-dir", _path, "/var/lib/kubelet/plugins_registry",
            "kubelet plugin registration directory: <driverName>-reg.sock"),
    Setting("dra.cdiDir", "dra-cdi-dir", _path, "/var/run/cdi",
            "CDI spec directory the container runtime reads (a real directory, not a symlink)"),
    Setting("dra.devRoot", "dra-dev-root", _abs_path, "/",
            "host directory whose dev/ holds the driver's device nodes, for those no NVIDIA CDI spec names "
            "(nvidia-ctk --dev-root; the GPU operator's driver container: /run/nvidia/driver)"),
    Setting("dra.taintAfter", "dra-taint-after", _duration, "30s",
            "a GPU unhealthy this long gets a taint on its devices in the node's ResourceSlices"),
    Setting("dra.taintEffect", "dra-taint-effect", _choice(("NoSchedule", "NoExecute", "none")), "NoSchedule",
            "effect of that taint: NoSchedule | NoExecute (evicts pods that do not tolerate it) | none (no taints)"),
)
# fmt: on
BY_KEY = {s.key: s for s in SETTINGS}
BY_FLAG = {s.flag: s for s in SETTINGS}
