"""Command line: ``mpsd run | status | check-config | exec | holder | stop-daemon |
dra-remove-slices | mig-pause | mig-resume``. Only wiring: flags onto config.

Every config key has a flag (``--pipe-dir``) and an environment variable (``MPSD_PIPE_DIR``);
precedence flag > env > file > default. A malformed file, flag or env value exits 2 with one
line naming the key and the accepted form; a setup failure exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Mapping, NoReturn, Sequence

from . import config as cfg
from .alloc.clientenv import client_env
from .alloc.frameworks import VARIABLES as FRAMEWORK_VARIABLES
from .errors import ConfigError, MpsdError, one_line, printable
from .trees import remove_tree
from .units import parse_limits, parse_percentage, parse_size

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_FAILURE = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="config file (YAML, version: v1); env MPSD_CONFIG")
    group = p.add_argument_group("settings (each also read from MPSD_<FLAG> in the environment)")
    for s in cfg.SETTINGS:
        if s.is_bool:
            group.add_argument(f"--{s.flag}", nargs="?", const="true", default=None, metavar="BOOL", help=s.help)
        else:
            group.add_argument(f"--{s.flag}", default=None, metavar="VALUE", help=s.help)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpsd", description="GPU sharing for inference nodes on NVIDIA MPS")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="start and supervise the MPS control daemon (and the device plugin)")
    _add_config_flags(run)
    status = sub.add_parser("status", help="daemon state, settings, servers and clients of a running node")
    _add_config_flags(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    holder = sub.add_parser("holder", help="keep the MPS control daemon running for daemonLifecycle: independent")
    _add_config_flags(holder)
    stop = sub.add_parser("stop-daemon", help="quit the control daemon an independent mpsd run left running")
    _add_config_flags(stop)
    check = sub.add_parser("check-config", help="validate a config file and print the resolved settings")
    check.add_argument("file")
    check.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    ex = sub.add_parser("exec", help="run one MPS client with its limits, pipe dir and the shim preloaded")
    _add_config_flags(ex)
    ex.add_argument(
        "--gpu-memory", default=None, metavar="SIZE", help='memory cap: "4G" for device 0, or MPS syntax "0=4G,1=2G"'
    )
    ex.add_argument("--gpu-compute", default=None, metavar="PERCENT", help="active thread percentage (0, 100]")
    ex.add_argument(
        "--region", default=None, metavar="PATH", help="accounting region file shared by the processes of one slice"
    )
    ex.add_argument("--no-shim", action="store_true", help="do not preload libmpsshim.so (MPS limits only)")
    ex.add_argument("--mig-instance", default=None, metavar="MIG-UUID",
                    help="run inside that MIG instance: its daemon's pipe dir; the instance is device 0")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    rm = sub.add_parser("dra-remove-slices",
                        help="delete this node's ResourceSlices of the DRA driver (DRA turned off, mpsd uninstalled)")
    _add_config_flags(rm)
    rm.add_argument("--node", default=None, help="the node (default: NODE_NAME, else the host name)")
    for name, what in (("mig-pause", "quit the MIG instance daemons before a MIG layout change (docs/mig.md)"),
                       ("mig-resume", "serve the MIG instances again after mig-pause")):
        _add_config_flags(sub.add_parser(name, help=what))
    return parser


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> cfg.Config:
    path = args.config or env.get("MPSD_CONFIG") or None
    overrides = {s.flag: getattr(args, s.flag.replace("-", "_")) for s in cfg.SETTINGS}
    return cfg.load(path, env, overrides)


RELOAD_TIMEOUT_S = 10.0


def reloader(
    args: argparse.Namespace, env: Mapping[str, str], timeout: float = RELOAD_TIMEOUT_S
) -> Callable[[], cfg.Config]:
    """What SIGHUP runs: the config again from the same file, environment and flags. It fails
    only with a one-line ConfigError, which the supervisor logs while it keeps the running
    config and daemon: an unexpected error escaping here would end ``mpsd run`` and take the
    control daemon, and every MPS client of the node, down with it. The read runs in a thread
    and is waited for at most TIMEOUT seconds: a config on a hung network mount must not stop
    the supervisor loop (health checks, restarts). While such a read is still stuck, a new
    reload is refused at once rather than piling up threads."""
    source = args.config or env.get("MPSD_CONFIG") or "the config"
    stuck: list[threading.Thread] = []

    def read(result: list) -> None:
        try:
            result.append(resolve(args, env))
        except ConfigError as exc:
            result.append(ConfigError(one_line(exc)))
        except BaseException as exc:  # noqa: BLE001 - a bug on some input: still not a reason to stop serving
            result.append(ConfigError(f"unexpected {type(exc).__name__}: {one_line(exc)[:200]}"))

    def reload() -> cfg.Config:
        if stuck and stuck[0].is_alive():
            raise ConfigError(f"{source}: an earlier reload is still reading it; try again later")
        stuck.clear()
        result: list = []
        thread = threading.Thread(target=read, args=(result,), name="mpsd-reload", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            stuck.append(thread)
            raise ConfigError(
                f"{source}: not read within {timeout:g}s (a hung filesystem?); "
                "the running config stays"
            )
        if isinstance(result[0], ConfigError):
            raise result[0]
        return result[0]

    return reload


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    if args.command == "run":  # a SIGHUP from now on is a reload, even before the loop runs
        from .config.reload import hold_reloads

        hold_reloads()
    try:
        if args.command == "check-config":
            return _check_config(args, env)
        config = resolve(args, env)
        if args.command == "run":
            from . import grpcready  # noqa: F401  (the faces serve gRPC: an old grpcio is one line, before anything starts)
            from .node import run

            return run(config, reload=reloader(args, env))
        if args.command == "status":
            from .status import status_main

            return status_main(config, as_json=args.json)
        if args.command == "dra-remove-slices":
            from .dra.service import remove_slices

            print(f"{remove_slices(config, args.node)} ResourceSlice(s) of {config.dra.driver_name} deleted")
            return 0
        if args.command == "holder":
            from .lifecycle.holder import holder_main

            return holder_main(config)
        if args.command in ("mig-pause", "mig-resume"):
            from .mig import pause

            print(printable(pause.pause(config) if args.command == "mig-pause" else pause.resume(config)))
            return 0
        if args.command == "stop-daemon":
            from .lifecycle.independent import stop_daemon

            print(printable(stop_daemon(config)))
            return 0
        return _exec(args, config, env)
    except ConfigError as exc:
        print(f"mpsd: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except MpsdError as exc:
        print(f"mpsd: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE


def _check_config(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    config = cfg.load(args.file, env, {})
    if args.json:
        print(json.dumps(config.to_dict(), indent=2))
    else:
        print(printable(f"{args.file}: ok"))
        for s in cfg.SETTINGS:
            print(printable(f"  {s.key} = {cfg.format_value(config, s.key)}"))
    from .sharing.build import node_choice

    choice = node_choice(config)  # SetupError (exit 1) where mps.protocol 3 cannot be had
    print(printable(f"sharing backend on this node: MPS v{choice.protocol} ({choice.reason})"),
          file=sys.stderr if args.json else sys.stdout)
    return 0


# ---------------------------------------------------------------- mpsd exec


def exec_limits(gpu_memory: str | None) -> dict[int | str, int]:
    """``4G`` -> {0: 4G}; ``0=4G,1=2G`` as in CUDA_MPS_PINNED_DEVICE_MEM_LIMIT."""
    if gpu_memory is None:
        return {}
    try:
        return parse_limits(gpu_memory) if "=" in gpu_memory else {0: parse_size(gpu_memory)}
    except ConfigError as exc:
        raise ConfigError(f"--gpu-memory: {exc}") from None


def _shim_path(config: cfg.Config) -> str:
    from .node import shim_library_path

    try:
        return shim_library_path(config)
    except MpsdError as exc:
        raise MpsdError(f"{exc}, or use --no-shim") from exc


def _region_dir(config: cfg.Config) -> str:
    base = os.path.join(config.state_dir, "exec")
    try:
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix="region-", dir=base)
    except OSError:
        return tempfile.mkdtemp(prefix="mpsd-region-")


def _remove_region_dir(path: str) -> None:
    """The command's region directory, whatever it left there (its exit code is what counts)."""
    result = remove_tree(path)
    if not result.complete:
        log.warning("region directory not removed path=%s error=%s", path, result.error)


def _exec(args: argparse.Namespace, config: cfg.Config, env: Mapping[str, str]) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ConfigError("exec: expected a command after --, e.g. mpsd exec --gpu-memory 4G -- python serve.py")
    limits = exec_limits(args.gpu_memory)
    percent = None
    if args.gpu_compute is not None:
        try:
            percent = parse_percentage(args.gpu_compute)
        except ConfigError as exc:
            raise ConfigError(f"--gpu-compute: {exc}") from None
    shim_library = None if args.no_shim else _shim_path(config)
    made_region = None
    region = args.region
    if shim_library and region is None:
        made_region = _region_dir(config)
        region = os.path.join(made_region, "region")
    child_env = dict(env)
    pipe_dir = config.pipe_dir
    if args.mig_instance is not None:  # the instance's own daemon (mpsd/mig/fleet.py); it is the server's device 0
        from .mig.fleet import served_pipe_dir

        pipe_dir = served_pipe_dir(config, args.mig_instance)
        child_env.pop("CUDA_VISIBLE_DEVICES", None)
    child_env.update(
        client_env(
            pipe_dir=pipe_dir,
            active_thread_percentage=percent,
            memory_limits=limits,
            shim_library=shim_library,
            region_path=region,
        )
    )
    child_env.update({name: env[name] for name in FRAMEWORK_VARIABLES if name in env})  # the user's own wins
    if shim_library and env.get("LD_PRELOAD"):
        child_env["LD_PRELOAD"] = f"{shim_library}:{env['LD_PRELOAD']}"
    log.debug("exec cmd=%s env=%s", cmd, {k: child_env[k] for k in child_env if k not in env or env[k] != child_env[k]})
    try:
        proc = subprocess.Popen(cmd, env=child_env)
    except OSError as exc:
        raise MpsdError(f"cannot run {cmd[0]!r}: {exc.strerror}") from exc
    forward = lambda signum, _frame: proc.send_signal(signum)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if made_region:
            _remove_region_dir(made_region)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
