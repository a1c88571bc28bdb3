"""``mpsd status``: what a running node looks like, through the control front-end (pipe dir
from the config) and NVML. Plain data for JSON, and a table."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict
from typing import Any

from . import config as cfg
from .daemon import drift, multiuser, peer
from .daemon.control import Control, PsEntry
from .errors import ControlBusy, ControlError, DaemonNotRunning, InventoryError, MpsdError, printable
from .logs import LOG_FORMAT
from .node import open_inventory
from .units import format_size

log = logging.getLogger(__name__)


def collect_status(config: cfg.Config, control: Control | None = None, inventory=None) -> dict[str, Any]:
    """The node as seen through the control front-end and NVML; plain data for JSON."""
    control = control or Control(config.control_binary, config.pipe_dir, config.log_dir, config.health_timeout)
    out: dict[str, Any] = {
        "pipeDir": config.pipe_dir,
        "daemon": "down",
        "error": "",
        "settings": {},
        "settingsDrift": [],  # how the daemon's defaults differ from the config (any UID can set them)
        "servers": [],
        "gpus": [],
        "clients": [],
        "multiUser": None,  # the daemon serves every UID from one server (None: cannot tell)
        "waiting": [],  # clients waiting for another UID's server (mpsd.daemon.multiuser)
    }
    from .sharing.build import read_record

    out["sharing"] = read_record(config.state_dir)  # the running mpsd's backend, and what enforces memory
    if out["sharing"].get("protocol") == 3:
        _collect_v3(config, out)
    else:
        _collect_v2(control, config, out)
    out["claims"] = _claims(config)
    own = inventory is None
    if own:
        inventory = open_inventory(config)
    if inventory is not None:
        try:
            out["gpus"] = [asdict(g) for g in inventory.gpus()]
            memory = {(c.gpu_index, c.pid): c.used_memory for c in inventory.mps_clients()}
            for client in out["clients"]:
                client["usedMemory"] = next((m for (g, p), m in memory.items() if p == client["pid"]), None)
            out["nvmlClients"] = [{"gpu": g, "pid": p, "usedMemory": m} for (g, p), m in sorted(memory.items())]
        except InventoryError as exc:
            out["error"] = out["error"] or str(exc)
        finally:
            if own:
                inventory.close()
    return out


def _collect_v2(control: Control, config: cfg.Config, out: dict[str, Any]) -> None:
    """An MPS v2 daemon: its defaults, servers and clients through the interactive front-end."""
    try:
        out["settings"]["activeThreadPercentage"] = control.get_default_active_thread_percentage()
        out["daemon"] = "up"
        limits = {}
        for device in config.pinned_mem_limit or {}:
            limits[str(device)] = control.get_default_device_pinned_mem_limit(device)
        out["settings"]["pinnedMemLimit"] = limits
        out["settings"]["clientPriority"] = control.get_default_client_priority()
        out["settingsDrift"] = _drift(config, out["settings"])
        ps: list[PsEntry] = control.ps()
        for server in control.get_server_list():
            out["servers"].append({"pid": server, "clients": control.get_client_list(server)})
        out["clients"] = [asdict(p) for p in ps]
        out["multiUser"], out["waiting"] = _uid_sharing(config.pipe_dir, [s["pid"] for s in out["servers"]])
    except DaemonNotRunning as exc:
        out["error"] = str(exc)
    except ControlBusy as exc:  # it runs, but another front-end holds it
        out["daemon"] = "busy"
        out["error"] = str(exc)
    except ControlError as exc:
        out["daemon"] = "unhealthy" if out["daemon"] == "up" else "down"
        out["error"] = str(exc)


def _collect_v3(config: cfg.Config, out: dict[str, Any]) -> None:
    """An MPS v3 daemon: its servers and their namespaces (mpsd/daemon/control3.py)."""
    from .daemon.control3 import Control3

    control = Control3(config.control_binary, config.pipe_dir, config.log_dir, config.health_timeout)
    try:
        clients = [(c.server, c.namespace) for c in control.client_list()]
        for server in control.server_list():
            namespaces = [{"name": n.name, **asdict(n.limits), "clients": clients.count((server.name, n.name))}
                          for n in control.namespace_list(server.name)]
            out["servers"].append({"name": server.name, "pid": server.pid, "status": server.status,
                                   "namespaces": namespaces})
        out["daemon"] = "up"
    except DaemonNotRunning as exc:
        out["error"] = str(exc)
    except ControlError as exc:
        out["daemon"] = "unhealthy"
        out["error"] = str(exc)



def _uid_sharing(pipe_dir: str, servers: list[int]) -> tuple[bool | None, list[dict[str, Any]]]:
    """Whether the daemon behind the pipe dir runs multi-user, and the clients waiting for
    another UID's server: from the kernel's view of its sockets (needs root, as mpsd run has)."""
    for name in peer.CONTROL_SOCKETS:
        daemon = peer.listener_pid(os.path.join(pipe_dir, name))
        if daemon:
            break
    else:
        return None, []
    multi = multiuser.daemon_is_multi_user(daemon)
    if multi is not False:
        return multi, []
    return False, [w.as_dict() for w in multiuser.waiting_clients(daemon, pipe_dir, servers)]


def _claims(config: cfg.Config) -> list[dict[str, Any]]:
    """The DRA claims prepared on this node (from the DRA plugin's state file), as plain data."""
    try:
        from .dra.service import read_prepared

        claims = read_prepared(config.state_dir)
    except (ImportError, OSError, MpsdError) as exc:
        log.warning("prepared DRA claims unreadable: %s", exc)
        return []
    return [
        {"namespace": c.namespace, "name": c.name, "uid": c.uid, "pods": list(c.pods),
         "gpus": [{"index": g.index, "memoryLimit": g.memory_limit} for g in c.gpus],
         "activeThreadPercentage": c.active_thread_percentage, "regionDir": c.region_dir}
        for c in claims
    ]


def _render_claims(claims: list[dict[str, Any]]) -> list[str]:
    if not claims:
        return []
    lines = [f"{'CLAIM':<40} {'GPU':<6} {'MEMORY':>10} {'COMPUTE':>8}  PODS"]
    for c in claims:
        gpus = ",".join(str(g["index"]) for g in c["gpus"])
        memory = ",".join(f"{g['memoryLimit'] >> 20}M" for g in c["gpus"])
        lines.append(f"{c['namespace'] + '/' + c['name']:<40} {gpus:<6} {memory:>10} "
                     f"{c['activeThreadPercentage']:>7g}%  {','.join(c['pods']) or '-'}")
    return lines


def _drift(config: cfg.Config, settings: dict[str, Any]) -> list[str]:
    limits = {int(d): v for d, v in settings["pinnedMemLimit"].items() if d.isdigit()}
    got = drift.Defaults(settings["activeThreadPercentage"], limits, settings["clientPriority"])
    return drift.differences(drift.expected(config, set()), got)


def render_status(data: dict[str, Any]) -> str:
    lines = [
        f"daemon: {data['daemon']}  pipe dir: {data['pipeDir']}"
        + (f"  error: {data['error']}" if data["error"] else "")
    ]
    s = data["settings"]
    if s:
        limits = (
            ",".join(f"{d}={'unset' if v is None else format_size(v)}" for d, v in s.get("pinnedMemLimit", {}).items())
            or "none"
        )
        lines.append(
            f"defaults: active threads {s.get('activeThreadPercentage')}%  pinned limit {limits}  "
            f"client priority {s.get('clientPriority')}"
        )
    if data.get("settingsDrift"):
        lines.append(f"defaults NOT as configured (mpsd run restores them): {'; '.join(data['settingsDrift'])}")
    for g in data["gpus"]:
        lines.append(
            f"gpu {g['index']}: {g['name']} {g['uuid']}  memory {g['memory_used'] >> 20}/{g['memory_total'] >> 20} MiB"
        )
    sharing = data.get("sharing") or {}
    if sharing:
        lines.append(f"sharing: {sharing.get('backend')} ({sharing.get('reason')}); memory enforced by "
                     f"{sharing.get('memory')}; shim {sharing.get('shim')}")
    lines.append(f"servers: {', '.join(str(x.get('name') or x['pid']) for x in data['servers']) or 'none'}")
    for server in data["servers"]:
        for n in server.get("namespaces", []):
            lines.append(f"  namespace {server['name']}/{n['name']}: memory {n['pinned_memory_limit'] or '-'} "
                         f"threads {n['active_thread_percentage'] or '-'} priority {n['client_priority'] or '-'} "
                         f"clients {n['clients']}")
    if data.get("multiUser") is not None:
        lines.append("UIDs: " + ("every UID shares one server (-multiuser-server)" if data["multiUser"]
                                 else "one UID at a time (a client of another UID waits)"))
    for w in data.get("waiting", []):
        servers = ", ".join(f"{s['pid']} (uid {s['uid']})" for s in w["servers"])
        lines.append(f"WAITING for another UID's server: {w['who']} uid {w['uid']}; running server {servers}")
    lines += _render_claims(data.get("claims", []))
    if not data["clients"]:
        lines.append("clients: none")
        return _table(lines)
    lines.append(f"{'PID':>8} {'SERVER':>8} {'DEVICE':<24} {'MEMORY':>10}  COMMAND")
    for c in data["clients"]:
        mem = "-" if c.get("usedMemory") is None else f"{c['usedMemory'] >> 20}M"
        lines.append(f"{c['pid']:>8} {c['server']:>8} {c['device']:<24} {mem:>10}  {c['command']}")
    return _table(lines)


def _table(lines: list[str]) -> str:
    """The lines printed: a client's argv (chosen by the pod) or a name may hold anything."""
    return "\n".join(printable(line) for line in lines)


def status_main(config: cfg.Config, as_json: bool = False) -> int:
    logging.basicConfig(level=logging.ERROR, format=LOG_FORMAT, stream=sys.stderr)
    data = collect_status(config)
    print(json.dumps(data, indent=2) if as_json else render_status(data))
    return 0 if data["daemon"] == "up" else 1
