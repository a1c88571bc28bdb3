"""A stand-in for ``nvidia-cuda-mps-control`` speaking MPS v3 (driver R615/R620), for tests on
machines without the driver. No v3 binary is reachable here (shared/reference/mps-facts.md), so
this follows NVIDIA's MPS documentation, releases 615 and 620; each behaviour names its page:

[IF]  "MPS v3 Interface" (docs.nvidia.com/deploy/mps/620/mpsv3-interface.html)
[CF]  "MPS v3 Configuration File" (.../mpsv3-configuration-file.html)
[NS]  "MPS v3 Namespaces" (.../mpsv3-namespaces.html)
[QS]  "Quick Start" (.../615/quick-start.html)

What the pages leave open is marked INFERRED and kept as plain as possible; tests/gpu checks the
real binary where a lent GPU has R615+:
- the verb options are spelled ``--key=value`` as [QS] spells ``server create --uid=$UID``, the
  namespace limits as their TOML keys with dashes (``--pinned-memory-limit=``);
- list verbs print CSV (``--format=csv`` with a header line, ``--format=csv,noheader``
  without); ``server list`` columns are name,uid,pid,status,pipe-directory,allowed-devices,
  context-ids; ``namespace list|get``: server,name,pinned-memory-limit,active-thread-percentage,
  client-priority,clients; ``client list --all``: pid,uid,server,namespace;
- a refused verb exits 1 with ``Error: ...`` on stderr; a configuration error exits 1 with
  ``Configuration error: <file>: <key>: ...``;
- servers have no processes of their own here: a server is STOPPED until a client connects,
  then ACTIVE with the daemon's PID (the daemon serves every socket).

Test hooks that are not NVIDIA's: env FAKE_MPS_RELEASE (615 default, or 620: which keys the
TOML takes), FAKE_MPS_DEVICES (comma-separated GPU UUIDs the daemon sees; unset: any), and the
verbs ``_fake fault --server=S`` / ``_fake recover --server=S``.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import socket
import struct
import sys
import time
import tomllib

PROTOCOL_ENV = "CUDA_MPS_PROTOCOL_VERSION"
HELP = """MPS Control Daemon (protocol 3 stand-in)
Usage: nvidia-cuda-mps-control [options] [<module> <verb> [--key=value ...]]
Options: -h, --help | -d, --daemon | -f, --foreground | -m, --multiuser | -a, --apply <file>
         -p, --protocol <2|3> | -q, --quit
Modules: server (list, create), namespace (create, delete, list, set, get), client (list)
"""
# [CF]: the keys each table accepts; "any other key is a configuration error"; 620 adds some
SERVER_KEYS = {"allowed_devices", "pinned_memory_limit", "active_thread_percentage", "client_priority", "uid",
               "locality_domains", "namespaces", "devices"}
SERVER_KEYS_620 = {"timeslice_pct"}
NAMESPACE_KEYS = {"pinned_memory_limit", "active_thread_percentage", "client_priority"}
NAMESPACE_KEYS_620 = {"cgroup", "cgroup_depth", "devices"}
TOP_KEYS = {"schema_version", "servers", "features"}
TOP_KEYS_620 = {"compute_policy"}
LIMITS = ("pinned_memory_limit", "active_thread_percentage", "client_priority")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SIZE = re.compile(r"[0-9]{1,12}[MG]")


class Refused(Exception):
    pass


def release() -> int:
    return int(os.environ.get("FAKE_MPS_RELEASE", "615"))


# ---------------------------------------------------------------- values and the TOML file


def check_limit(key: str, value: object, where: str) -> str:
    """A limit as the TOML and the verbs take it (strings, [CF]'s examples); Refused otherwise."""
    text = str(value)
    if key == "pinned_memory_limit" and not _SIZE.fullmatch(text):
        raise Refused(f"{where}: pinned_memory_limit {text!r}: expected <n>M or <n>G")
    if key == "active_thread_percentage":
        try:
            ok = 0 < float(text) <= 100
        except ValueError:
            ok = False
        if not ok:
            raise Refused(f"{where}: active_thread_percentage {text!r}: expected a number in (0, 100]")
    if key == "client_priority" and text not in ("0", "1"):
        raise Refused(f"{where}: client_priority {text!r}: expected 0 or 1")
    return text


def _keys(table: dict, allowed: set, extra_620: set, where: str) -> None:
    for key in table:
        if key in allowed or (key in extra_620 and release() >= 620):
            continue
        raise Refused(f"{where}.{key}: unknown key")


def load_config(path: str) -> dict:
    """{server: {"allowed": [...], "uid": int|None, "limits": {...}, "namespaces": {ns: {...}}}} [CF]."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    _keys(data, TOP_KEYS, TOP_KEYS_620, "")
    if data.get("schema_version") != "1.0":
        raise Refused(f"schema_version {data.get('schema_version')!r}: expected \"1.0\"")
    seen = [d for d in os.environ.get("FAKE_MPS_DEVICES", "").split(",") if d]
    servers = {}
    for name, table in (data.get("servers") or {}).items():
        where = f"servers.{name}"
        if not isinstance(table, dict) or not _NAME.fullmatch(name):
            raise Refused(f"{where}: expected a table named with letters, digits, '_', '.', '-'")
        _keys(table, SERVER_KEYS, SERVER_KEYS_620, where)
        allowed = [d for d in str(table.get("allowed_devices", "")).split(",") if d]
        for device in allowed:
            if seen and device not in seen:
                raise Refused(f"{where}.allowed_devices: device {device} not found")
        if "locality_domains" in table and not isinstance(table["locality_domains"], bool):
            raise Refused(f"{where}.locality_domains: expected a boolean")  # [CF] "boolean only"
        limits = {k: check_limit(k, table[k], where) for k in LIMITS if k in table}
        namespaces = {}
        for ns, nst in (table.get("namespaces") or {}).items():
            nwhere = f"{where}.namespaces.{ns}"
            if not isinstance(nst, dict) or not _NAME.fullmatch(ns):
                raise Refused(f"{nwhere}: expected a table")
            _keys(nst, NAMESPACE_KEYS, NAMESPACE_KEYS_620, nwhere)
            namespaces[ns] = {k: check_limit(k, nst[k], nwhere) for k in LIMITS if k in nst}
        servers[name] = {"allowed": allowed, "uid": table.get("uid"), "limits": limits, "namespaces": namespaces,
                         "status": "STOPPED", "clients": {}}
    return servers


# ---------------------------------------------------------------- the daemon


class Daemon:
    def __init__(self, pipe: str, log_dir: str, servers: dict, multiuser: bool) -> None:
        self.pipe, self.log_dir, self.servers, self.multiuser = pipe, log_dir, servers, multiuser
        self.sel = selectors.DefaultSelector()
        self.listeners: dict[str, tuple[str, str]] = {}  # socket path -> (server, namespace); main: ("", "")
        self.owner = os.geteuid()
        self.quitting = False

    def log(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}.000 Control {os.getpid():5d}] {text}", flush=True)

    def listen(self, path: str, server: str, ns: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(path)
        os.chmod(path, 0o666)
        sock.listen(64)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, ("listen", server, ns))
        self.listeners[path] = (server, ns)

    def ns_path(self, server: str, ns: str) -> str:
        return os.path.join(self.pipe, server, ns, "control")  # [NS]: <pipe>/<server>/<ns>/control

    def add_namespace(self, server: str, ns: str) -> None:
        self.listen(self.ns_path(server, ns), server, ns)

    def drop_namespace(self, server: str, ns: str) -> None:
        path = self.ns_path(server, ns)
        for key in list(self.sel.get_map().values()):
            if key.data[0] == "listen" and key.data[1:] == (server, ns):
                self.sel.unregister(key.fileobj)
                key.fileobj.close()
        self.listeners.pop(path, None)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    def start(self) -> None:
        os.makedirs(self.pipe, exist_ok=True)
        for name, srv in self.servers.items():
            self.listen(os.path.join(self.pipe, name, "control"), name, "default")  # [NS]: the default namespace
            self.add_namespace(name, "default")
            for ns in srv["namespaces"]:
                self.add_namespace(name, ns)
        # The top-level socket last: whoever waits for it (tests, mpsd's start) finds every
        # namespace socket of the file already bound (seen racing under load otherwise).
        self.listen(os.path.join(self.pipe, "control"), "", "")
        self.log(f"Starting control daemon using socket {self.pipe}/control (protocol 3)")

    def serve(self) -> None:
        while not self.quitting:
            for key, _ in self.sel.select(timeout=0.5):
                kind = key.data[0]
                if kind == "listen":
                    self.accept(key)
                else:
                    self.readable(key)

    def accept(self, key) -> None:
        try:
            conn, _ = key.fileobj.accept()
        except OSError:
            return
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        conn.setblocking(False)
        server, ns = key.data[1], key.data[2]
        self.sel.register(conn, selectors.EVENT_READ, ("conn", server, ns, pid, uid))
        if server:  # a client on a server's or namespace's socket [NS]
            srv = self.servers[server]
            srv["clients"][pid] = (ns, uid)
            if srv["status"] == "STOPPED":
                srv["status"] = "ACTIVE"

    def readable(self, key) -> None:
        conn = key.fileobj
        _, server, ns, pid, uid = key.data
        try:
            data = conn.recv(1 << 16)
        except OSError:
            data = b""
        if data and not server and data.startswith(b"{"):  # a front-end on the main socket
            try:
                rc, out, err = self.command(json.loads(data)["argv"], uid)
            except Refused as exc:
                rc, out, err = 1, "", f"Error: {exc}\n"
            conn.send(json.dumps({"rc": rc, "out": out, "err": err}).encode())
            self.log(f"command {' '.join(json.loads(data)['argv'])!r} rc={rc}")
            return
        if not data:
            self.sel.unregister(conn)
            conn.close()
            if server:
                self.servers[server]["clients"].pop(pid, None)

    # -- verbs [IF]

    def command(self, argv: list[str], uid: int) -> tuple[int, str, str]:
        if argv in (["-q"], ["--quit"]):
            self.quitting = True
            return 0, "", ""
        if len(argv) < 2:
            raise Refused(f"expected <module> <verb>, got {' '.join(argv)!r}")
        module, verb, opts = argv[0], argv[1], _options(argv[2:])
        fmt = opts.pop("format", "csv")
        if module == "server" and verb == "list":
            rows = [[n, "" if s["uid"] is None else str(s["uid"]), str(os.getpid()) if s["status"] != "STOPPED" else "-",
                     s["status"], os.path.join(self.pipe, n), ",".join(s["allowed"]), "-"]
                    for n, s in self.servers.items()]
            return 0, _csv("name,uid,pid,status,pipe-directory,allowed-devices,context-ids", rows, fmt), ""
        if module == "client" and verb == "list":
            rows = [[str(pid), str(cuid), n, cns] for n, s in self.servers.items()
                    for pid, (cns, cuid) in sorted(s["clients"].items())]
            return 0, _csv("pid,uid,server,namespace", rows, fmt), ""
        if module == "namespace":
            return self.namespace(verb, opts, uid, fmt)
        if module == "_fake" and verb in ("fault", "recover"):  # a test hook, not NVIDIA's
            self._server(opts)["status"] = "FAULT" if verb == "fault" else "ACTIVE"
            return 0, "", ""
        raise Refused(f"unknown command {module} {verb}")

    def _server(self, opts: dict) -> dict:
        name = opts.get("server", "")
        if name not in self.servers:
            raise Refused(f"server {name!r} not found")
        return self.servers[name]

    def namespace(self, verb: str, opts: dict, uid: int, fmt: str) -> tuple[int, str, str]:
        srv = self._server(opts)
        server = opts["server"]
        name = opts.get("name")
        header = "server,name,pinned-memory-limit,active-thread-percentage,client-priority,clients"

        def row(ns: str) -> list[str]:
            limits = srv["limits"] if ns == "default" else srv["namespaces"][ns]
            clients = sum(1 for c in srv["clients"].values() if c[0] == ns)
            return [server, ns, *(limits.get(k, "") for k in LIMITS), str(clients)]

        if verb == "list":
            return 0, _csv(header, [row(n) for n in ["default", *srv["namespaces"]]], fmt), ""
        if name is None or not _NAME.fullmatch(name):
            raise Refused(f"namespace name {name!r}: expected letters, digits, '_', '.', '-'")
        exists = name == "default" or name in srv["namespaces"]
        if verb == "get":
            if not exists:
                raise Refused(f"namespace {name!r} not found on server {server!r}")
            return 0, _csv(header, [row(name)], fmt), ""
        if uid not in (0, self.owner):  # changes only from root or the daemon's user (as 550+ v2 does)
            raise Refused("control daemon settings can only be modified by the user that started it or by root")
        limits = {k: check_limit(k, opts[k.replace("_", "-")], name) for k in LIMITS if k.replace("_", "-") in opts}
        if verb == "create":
            if exists:
                raise Refused(f"namespace {name!r} already exists on server {server!r}")
            srv["namespaces"][name] = limits
            self.add_namespace(server, name)
        elif verb == "set":
            if not exists:
                raise Refused(f"namespace {name!r} not found on server {server!r}")
            (srv["limits"] if name == "default" else srv["namespaces"][name]).update(limits)
        elif verb == "delete":
            if name == "default":
                raise Refused("the default namespace cannot be deleted")
            if not exists:
                raise Refused(f"namespace {name!r} not found on server {server!r}")
            del srv["namespaces"][name]
            self.drop_namespace(server, name)
        else:
            raise Refused(f"unknown command namespace {verb}")
        return 0, "", ""


def _options(args: list[str]) -> dict[str, str]:
    opts = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            if arg == "--all":
                continue
            raise Refused(f"bad option {arg!r}: expected --key=value")
        key, _, value = arg[2:].partition("=")
        opts[key] = value
    return opts


def _csv(header: str, rows: list[list[str]], fmt: str) -> str:
    lines = [] if "noheader" in fmt else [header]
    lines += [",".join(r) for r in rows]
    return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------- the command line [IF]


def front_end(pipe: str, argv: list[str]) -> int:
    """Send one verb to the running daemon; print its answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    try:
        sock.connect(os.path.join(pipe, "control"))
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        return 1
    sock.send(json.dumps({"argv": argv}).encode())
    answer = json.loads(sock.recv(1 << 20))
    sys.stdout.write(answer["out"])
    sys.stderr.write(answer["err"])
    return answer["rc"]


def main(argv: list[str]) -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or ("/run/nvidia-mps" if os.geteuid() == 0 else "/tmp/nvidia-mps")
    log_dir = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
    protocol, apply, foreground, multiuser, rest = "2", None, False, False, []
    args = list(argv)
    while args and args[0].startswith("-") and not args[0].startswith("--format"):
        opt = args.pop(0)
        if opt in ("-h", "--help"):
            print(HELP, end="")
            return 0
        if opt in ("-p", "--protocol"):
            protocol = args.pop(0) if args else ""
        elif opt in ("-a", "--apply"):
            apply = args.pop(0) if args else None
        elif opt in ("-f", "--foreground"):
            foreground = True
        elif opt in ("-m", "--multiuser"):
            multiuser = True
        elif opt in ("-q", "--quit"):
            return front_end(pipe, ["-q"])
        elif opt in ("-d", "--daemon"):
            print("this stand-in runs in the foreground only (-f)", file=sys.stderr)
            return 1
        else:
            print(f"Error: unknown option {opt}", file=sys.stderr)
            return 1
    protocol = os.environ.get(PROTOCOL_ENV) or protocol  # [IF]: the variable wins over -p
    if not foreground:
        return front_end(pipe, args + rest)  # [IF]: a front-end follows the running daemon's protocol
    if protocol != "3":
        print("this stand-in implements protocol 3 only (the real binaries cover protocol 2)", file=sys.stderr)
        return 1
    try:
        servers = load_config(apply) if apply else {}
    except (Refused, tomllib.TOMLDecodeError, OSError) as exc:
        print(f"Configuration error: {apply}: {exc}", file=sys.stderr)  # [CF]: applied once at start
        return 1
    daemon = Daemon(pipe, log_dir, servers, multiuser)
    daemon.start()
    daemon.serve()
    for path in list(daemon.listeners):
        try:
            os.unlink(path)
        except OSError:
            pass
    daemon.log("Control daemon exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
