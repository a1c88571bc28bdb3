"""A stand-in for ``nvidia-cuda-mps-control`` speaking MPS v3 (driver R615/R620), for tests on
machines without the driver. Every answer it gives is one NVIDIA's pages show, named beside it:

[IF]  "MPS v3 Interface" (docs.nvidia.com/deploy/mps/mpsv3-interface.html)
[CF]  "MPS v3 Configuration File" (.../mpsv3-configuration-file.html; 620's adds keys)
[NS]  "MPS v3 Namespaces" (.../mpsv3-namespaces.html)
[QS]  "Quick Start" (.../quick-start.html), [CT] "Common Tasks" (.../common-tasks.html)
[DY]  NVIDIA Dynamo, "Per-GPU Compute and Memory Limits with MPS" (run on driver 615.71.09)

Where the pages are silent the stand-in VARIES, chosen per test with FAKE_MPS_VARIANT (comma-
separated), so that mpsd's tolerance is tested, not assumed (docs/mps-v3.md lists each):
  csv-noheader  ``--format=csv`` prints no header line ([IF] shows only ``csv,noheader`` output)
  upper-header  the header as [DY]'s table has it ("PINNED MEMORY LIMIT"), not the page's names
  reorder       the header's columns in another order than the page lists them
  extra-column  one more column than the page names, last ("extra")
  mib           memory limits echoed in M (``2048M`` for ``2G``; [IF] takes both units)
  decimals      percentages echoed with two decimals ([DY]'s table: ``30.00``)
  quoted        a list inside a CSV cell quoted ("GPU-a,GPU-b"); unquoted otherwise
  status=WORD   the server status word (``Ready`` in [IF] and [DY]; other words are not shown)
  no-priority   ``namespace list`` without the client-priority and pipe-directory columns
                ([DY]'s table has five columns; [IF] names seven)
Also INFERRED (no page says): a refused verb exits 1 with ``Error: ...`` on stderr; a
configuration error ends the daemon with ``Configuration error: <file>: <key>: ...``; the
status of a server that faulted (``FAULT``, v2's word) is set only by the test hook below.

Test hooks that are not NVIDIA's: FAKE_MPS_RELEASE (615, or 620: which TOML keys it takes),
FAKE_MPS_DEVICES (GPU UUIDs the daemon sees; unset: any), the verbs ``_fake status --server=S
--status=WORD``, ``_fake drop --server=S`` (the server exits and leaves ``server list``, as
[DY] warns), ``_fake hook --name=H --value=V`` (refuse-set, ignore-set: a set taken but not
held, refuse-delete, garbage: ``server list`` answers a line no one can read; "" clears), and
FAKE_MPS_V2_MULTIUSER=1 (``-f -multiuser-server`` without ``-p 3`` starts
a protocol-2 daemon as a 555+ v2 binary does, mps-facts.md, and serves nothing).
"""

from __future__ import annotations

import csv
import io
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
Usage: nvidia-cuda-mps-control [options] [<module> <verb> [positional-args] [--key=value ...]]
Options: -h, --help | -d, --daemon | -f, --foreground | -m, --multiuser | -a, --apply <file>
         -p, --protocol <2|3> | -q, --quit | -v, --version
Modules: server, namespace, client, device, sm-partition, feature, memacct, context-share
"""  # [IF] "Control Daemon Options" and "CLI Command Structure"
SERVER_KEYS = {"allowed_devices", "pinned_memory_limit", "active_thread_percentage", "client_priority", "uid",
               "locality_domains", "namespaces", "devices"}  # [CF] "[servers.<name>] accepts ..."
SERVER_KEYS_620 = {"timeslice_pct"}  # [CF] 620's example
NAMESPACE_KEYS = {"pinned_memory_limit", "active_thread_percentage", "client_priority"}  # [CF] "accepts only"
NAMESPACE_KEYS_620 = {"cgroup", "cgroup_depth", "devices"}
TOP_KEYS, TOP_KEYS_620 = {"schema_version", "servers", "features"}, {"compute_policy"}
LIMITS = ("pinned_memory_limit", "active_thread_percentage", "client_priority")
# [IF] "Server and namespace names must be lowercase letters, digits, and underscores only, up to 64"
_NAME = re.compile(r"[a-z0-9_]{1,64}")
_SIZE = re.compile(r"([0-9]{1,12})([KMG])")  # [IF] "Memory limit values use unit suffixes: 4G, 512M, 1024K"
UNIT = {"K": 1, "M": 1024, "G": 1024 * 1024}  # KiB per suffix ([DY]: "10G is 10,737,418,240 bytes")
SERVER_COLUMNS = ["name", "uid", "pid", "status", "pipe-directory", "allowed-devices", "context-ids"]  # [IF]
NAMESPACE_COLUMNS = ["name", "server", "server-status", "pinned-memory-limit", "active-thread-percentage",
                     "client-priority", "pipe-directory"]  # [IF] "namespace list ... Output columns"
# [IF] names no columns for ``client list``; its example ``51023,training,0,default,python train.py``
# is pid, server, device, namespace, command (``client get`` fields: pid, server, device, ..., cmd)
CLIENT_COLUMNS = ["pid", "server", "device", "namespace", "command"]


class Refused(Exception):
    pass


HOOKS: dict[str, str] = {}  # set by ``_fake hook``: refuse-set, ignore-set, refuse-delete, garbage


def variant(name: str) -> str | None:
    if name in HOOKS:
        return HOOKS[name] or None
    for flag in os.environ.get("FAKE_MPS_VARIANT", "").split(","):
        key, _, value = flag.partition("=")
        if key == name:
            return value or "on"
    return None


def release() -> int:
    return int(os.environ.get("FAKE_MPS_RELEASE", "615"))


def check_limit(key: str, value: object, where: str) -> str:
    """A limit as the TOML ([CF]: strings) and the verbs ([IF]) take it; Refused otherwise."""
    text = str(value)
    if key == "pinned_memory_limit" and not _SIZE.fullmatch(text):
        raise Refused(f"{where}: pinned_memory_limit {text!r}: expected <n>K, <n>M or <n>G")
    if key == "active_thread_percentage" and not re.fullmatch(r"[0-9]{1,3}(\.[0-9]+)?", text) or (
            key == "active_thread_percentage" and not 1 <= float(text) <= 100):  # [IF] "1-100"; INFERRED: a
        raise Refused(f"{where}: active_thread_percentage {text!r}: expected 1-100")  # fraction ([DY] shows 30.00)
    if key == "client_priority" and text not in ("0", "1"):
        raise Refused(f"{where}: client_priority {text!r}: expected 0 or 1")  # [IF] "0 (normal) or 1"
    return text


def shown_limit(key: str, text: str) -> str:
    """A limit as list verbs echo it: as set ([IF] ``namespace get`` -> ``4G``), or varied."""
    if not text:
        return ""
    if key == "pinned_memory_limit" and variant("mib"):
        m = _SIZE.fullmatch(text)
        assert m is not None
        kib = int(m.group(1)) * UNIT[m.group(2)]
        return f"{kib // 1024}M" if kib % 1024 == 0 else f"{kib}K"
    if key == "active_thread_percentage" and variant("decimals"):
        return f"{float(text):.2f}"  # [DY]: ``30.00``
    return text


def _keys(table: dict, allowed: set, extra_620: set, where: str) -> None:
    for key in table:
        if key not in allowed and not (key in extra_620 and release() >= 620):
            raise Refused(f"{where}.{key}: unknown key")  # [CF] "Any other key is a configuration error"


def load_config(path: str) -> dict:
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
            raise Refused(f"{where}: expected a table named with lowercase letters, digits and '_'")
        _keys(table, SERVER_KEYS, SERVER_KEYS_620, where)
        allowed = [d for d in str(table.get("allowed_devices", "")).split(",") if d]
        for device in allowed:
            if seen and device not in seen:
                raise Refused(f"{where}.allowed_devices: device {device} not found")
        if "uid" in table and not isinstance(table["uid"], int):
            raise Refused(f"{where}.uid: expected an integer")  # [CF] ``uid = 1000``
        if "locality_domains" in table and not isinstance(table["locality_domains"], bool):
            raise Refused(f"{where}.locality_domains: expected a boolean")  # [CF] "boolean only"
        namespaces = {}
        for ns, nst in (table.get("namespaces") or {}).items():
            nwhere = f"{where}.namespaces.{ns}"
            if not isinstance(nst, dict) or not _NAME.fullmatch(ns):
                raise Refused(f"{nwhere}: expected a table named with lowercase letters, digits and '_'")
            _keys(nst, NAMESPACE_KEYS, NAMESPACE_KEYS_620, nwhere)
            namespaces[ns] = {k: check_limit(k, nst[k], nwhere) for k in LIMITS if k in nst}
        limits = {k: check_limit(k, table[k], where) for k in LIMITS if k in table}
        namespaces["default"] = {**limits, **namespaces.get("default", {})}  # [CF]: "default" is the built-in one
        servers[name] = {"allowed": allowed, "uid": table.get("uid"), "namespaces": namespaces,
                         "status": variant("status") or "Ready", "clients": {}}  # [IF] example: Ready
    return servers


def render(columns: list[str], rows: list[list[str]], fmt: str) -> str:
    """A list verb's answer in ``--format=<table|csv>[,noheader]`` ([IF])."""
    if variant("extra-column"):
        columns, rows = columns + ["extra"], [r + ["x"] for r in rows]
    if variant("reorder"):
        order = list(range(len(columns)))[::-1]
        columns, rows = [columns[i] for i in order], [[r[i] for i in order] for r in rows]
    header = [c.replace("-", " ").upper() for c in columns] if variant("upper-header") else columns
    if fmt.startswith("csv"):
        out = io.StringIO()
        quoting = csv.QUOTE_MINIMAL if variant("quoted") else csv.QUOTE_NONE
        writer = csv.writer(out, lineterminator="\n", quoting=quoting, escapechar=None if variant("quoted") else "\\")
        if "noheader" not in fmt and not variant("csv-noheader"):
            writer.writerow(header)
        for row in rows:
            if quoting == csv.QUOTE_NONE:
                out.write(",".join(row) + "\n")  # a list in a cell stays unquoted: its commas show
            else:
                writer.writerow(row)
        return out.getvalue()
    # table: upper-case header and padded columns as [DY]'s ``namespace list`` and [IF]'s sm-partition list
    table = ([] if "noheader" in fmt else [[c.replace("-", " ").upper() for c in columns]]) + rows
    widths = [max(len(r[i]) for r in table) + 2 for i in range(len(columns))]
    return "".join("".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in table)


class Daemon:
    def __init__(self, pipe: str, servers: dict) -> None:
        self.pipe, self.servers = pipe, servers
        self.sel = selectors.DefaultSelector()
        self.listeners: dict[str, tuple[str, str]] = {}
        self.owner = os.geteuid()
        self.quitting = False

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}.000 Control {os.getpid():5d}] {text}", flush=True)

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

    def drop_namespace(self, server: str, ns: str) -> None:
        for key in list(self.sel.get_map().values()):
            if key.data[0] == "listen" and key.data[1:] == (server, ns):
                self.sel.unregister(key.fileobj)
                key.fileobj.close()
        self.listeners.pop(self.ns_path(server, ns), None)
        shutil.rmtree(os.path.dirname(self.ns_path(server, ns)), ignore_errors=True)

    def start(self) -> None:
        os.makedirs(self.pipe, exist_ok=True)
        for name, srv in self.servers.items():
            self.listen(os.path.join(self.pipe, name, "control"), name, "default")  # [NS]: the server's socket
            for ns in srv["namespaces"]:
                self.listen(self.ns_path(name, ns), name, ns)
        self.listen(os.path.join(self.pipe, "control"), "", "")  # last: every namespace socket is bound by then
        self.log(f"Starting control daemon using socket {self.pipe}/control (protocol 3)")
        # [IF] "At startup, the daemon prints the pipe directory clients should connect through"
        self.log(f"To connect CUDA applications to this daemon, set CUDA_MPS_PIPE_DIRECTORY={self.pipe}")

    def serve(self) -> None:
        while not self.quitting:
            for key, _ in self.sel.select(timeout=0.5):
                self.accept(key) if key.data[0] == "listen" else self.readable(key)

    def accept(self, key) -> None:
        try:
            conn, _ = key.fileobj.accept()
        except OSError:
            return
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        conn.setblocking(False)
        server, ns = key.data[1], key.data[2]
        self.sel.register(conn, selectors.EVENT_READ, ("conn", server, ns, pid, uid))
        if server:  # a client on a server's or a namespace's socket [NS]; one entry per connection
            self.servers[server]["clients"][conn.fileno()] = (pid, ns, conn)

    def readable(self, key) -> None:
        conn = key.fileobj
        _, server, ns, pid, uid = key.data
        try:
            data = conn.recv(1 << 16)
        except OSError:
            data = b""
        if data and not server and data.startswith(b"{"):  # a front-end on the main socket
            argv = json.loads(data)["argv"]
            try:
                rc, out, err = self.command(argv, uid)
            except Refused as exc:
                rc, out, err = 1, "", f"Error: {exc}\n"
            conn.send(json.dumps({"rc": rc, "out": out, "err": err}).encode())
            self.log(f"command {' '.join(argv)!r} rc={rc}")
            return
        if not data:
            self.end_client(conn, server, pid)

    def end_client(self, conn, server: str, pid: int) -> None:
        if server:
            self.servers[server]["clients"].pop(conn.fileno(), None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _server(self, name: str) -> dict:
        if name not in self.servers:
            raise Refused(f"server {name!r} not found")
        return self.servers[name]

    def _changes_allowed(self, uid: int) -> None:
        if uid not in (0, self.owner):  # INFERRED: as 550+ v2's daemon refuses other users' settings
            raise Refused("control daemon settings can only be modified by the user that started it or by root")

    def command(self, argv: list[str], uid: int) -> tuple[int, str, str]:
        if argv in (["-q"], ["--quit"]):
            self.quitting = True
            return 0, "", ""
        if len(argv) < 2:
            raise Refused(f"expected <module> <verb>, got {' '.join(argv)!r}")
        module, verb = argv[0], argv[1]
        pos, opts, flags = _arguments(argv[2:])
        fmt = opts.pop("format", "table")  # [IF] ``--format=<table|csv>[,noheader]``
        if module == "server" and verb == "list":
            if variant("garbage"):
                return 0, "%%% no such form %%%\n", ""
            rows = [self.server_row(n, s) for n, s in self.servers.items() if not pos or n == pos[0]]
            return 0, render(SERVER_COLUMNS, rows, fmt), ""
        if module == "server" and verb == "set":  # [IF]: "applied to the server's default namespace"
            self._changes_allowed(uid)
            limits = _limit_options(opts, pos[0] if pos else "")
            self._server(pos[0] if pos else "")["namespaces"]["default"].update(limits)
            return 0, "", ""
        if module == "client" and verb == "list":  # [IF] example: pid,server,device,namespace,command
            rows = [[str(pid), n, "0", cns, "python serve.py"] for n, s in self.servers.items()
                    for pid, cns, _c in sorted(s["clients"].values(), key=lambda c: c[0])
                    if "all" in flags or opts.get("server") == n]
            return 0, render(CLIENT_COLUMNS, rows, fmt), ""
        if module == "client" and verb == "terminate":  # [IF] ``client terminate <pid>``
            self._changes_allowed(uid)
            ended = [(n, c) for n, s in self.servers.items() for cpid, _ns, c in list(s["clients"].values())
                     if pos and str(cpid) == pos[0]]
            if not ended:
                raise Refused(f"client {pos[0] if pos else ''!r} not found")
            for n, c in ended:
                self.end_client(c, n, 0)
            return 0, "", ""
        if module == "namespace":
            return self.namespace(verb, pos, opts, flags, uid, fmt)
        if module == "_fake" and verb == "status":  # test hooks, not NVIDIA's
            self._server(opts.get("server", ""))["status"] = opts["status"]
            return 0, "", ""
        if module == "_fake" and verb == "drop":
            self._server(opts.get("server", ""))
            for ns in self.servers[opts["server"]]["namespaces"]:
                self.drop_namespace(opts["server"], ns)
            del self.servers[opts["server"]]
            return 0, "", ""
        if module == "_fake" and verb == "hook":
            HOOKS[opts["name"]] = opts.get("value", "on")
            return 0, "", ""
        raise Refused(f"unknown command {module} {verb}")

    def server_row(self, name: str, s: dict) -> list[str]:
        pid = str(os.getpid()) if s["clients"] else "-"  # INFERRED: [IF]'s example shows a pid; none before a client
        devices = ",".join(s["allowed"])
        return [name, "" if s["uid"] is None else str(s["uid"]), pid, s["status"], os.path.join(self.pipe, name),
                devices, "-"]

    def namespace(self, verb: str, pos: list[str], opts: dict, flags: set, uid: int, fmt: str):
        if verb == "list":  # [IF] ``namespace list [<name>] [--server=<s>]``
            columns = NAMESPACE_COLUMNS[:5] if variant("no-priority") else NAMESPACE_COLUMNS
            rows = [self.ns_row(n, s, ns)[:len(columns)] for n, s in self.servers.items()
                    if opts.get("server") in (None, n) for ns in s["namespaces"] if not pos or ns == pos[0]]
            return 0, render(columns, rows, fmt), ""
        if verb == "get":  # [IF] ``namespace get <name> <server> <field>`` -> ``4G``
            if len(pos) != 3 or pos[2] not in NAMESPACE_COLUMNS:
                raise Refused("expected namespace get <name> <server> <field>")
            srv = self._server(pos[1])
            if pos[0] not in srv["namespaces"]:
                raise Refused(f"namespace {pos[0]!r} not found on server {pos[1]!r}")
            return 0, self.ns_row(pos[1], srv, pos[0])[NAMESPACE_COLUMNS.index(pos[2])] + "\n", ""
        server = opts.pop("server", "")
        srv = self._server(server)
        if len(pos) != 1 or not _NAME.fullmatch(pos[0]):  # [IF]: the name is positional
            raise Refused(f"namespace {verb}: expected one name of lowercase letters, digits and '_', got {pos}")
        name = pos[0]
        self._changes_allowed(uid)
        exists = name in srv["namespaces"]
        if verb == "create":  # [IF] ``namespace create <name> --server=<s>``: no limit options shown
            if opts:
                raise Refused(f"namespace create takes no option {', '.join(sorted(opts))}")
            if exists:
                raise Refused(f"namespace {name!r} already exists on server {server!r}")
            srv["namespaces"][name] = {}  # [DY]: "a namespace that sets no limits gets the whole GPU"
            self.listen(self.ns_path(server, name), server, name)
        elif verb == "set":  # [IF] "At least one option flag is required"
            if not exists:
                raise Refused(f"namespace {name!r} not found on server {server!r}")
            if variant("refuse-set"):
                raise Refused(f"namespace {name!r}: set refused (test hook)")
            limits = _limit_options(opts, name)
            if not variant("ignore-set"):
                srv["namespaces"][name].update(limits)
        elif verb == "delete":  # [IF] "--force allows deletion even with active clients"
            if name == "default" or not exists:
                raise Refused(f"namespace {name!r} cannot be deleted from server {server!r}: not found")
            if variant("refuse-delete"):
                raise Refused(f"namespace {name!r}: delete refused (test hook)")
            held = [c for _pid, cns, c in list(srv["clients"].values()) if cns == name]
            if held and "force" not in flags:
                raise Refused(f"namespace {name!r} has {len(held)} active client(s): use --force")
            for c in held:
                self.end_client(c, server, 0)
            del srv["namespaces"][name]
            self.drop_namespace(server, name)
        else:
            raise Refused(f"unknown command namespace {verb}")
        return 0, "", ""

    def ns_row(self, server: str, srv: dict, ns: str) -> list[str]:
        limits = srv["namespaces"][ns]
        return [ns, server, srv["status"], *(shown_limit(k, limits.get(k, "")) for k in LIMITS),
                os.path.dirname(self.ns_path(server, ns))]


def _arguments(args: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """[IF]: "positional (up to 3), or given as --key=value / key=value, or as valueless flags"."""
    pos, opts, flags = [], {}, set()
    for arg in args:
        if arg in ("--force", "--all"):
            flags.add(arg[2:])
        elif "=" in arg:
            key, _, value = arg.lstrip("-").partition("=")
            opts[key] = value
        elif arg.startswith("-"):
            raise Refused(f"bad option {arg!r}")
        else:
            pos.append(arg)
    if len(pos) > 3:
        raise Refused("at most 3 positional arguments")
    return pos, opts, flags


def _limit_options(opts: dict, where: str) -> dict:
    limits = {k: check_limit(k, opts.pop(k.replace("_", "-")), where) for k in LIMITS if k.replace("_", "-") in opts}
    if opts:
        raise Refused(f"unknown option {', '.join(sorted(opts))}")
    if not limits:
        raise Refused("at least one option flag is required")
    return limits


def front_end(pipe: str, argv: list[str]) -> int:
    """Send one verb to the running daemon; print its answer ([IF]: it follows that daemon's protocol)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    try:
        sock.connect(os.path.join(pipe, "control"))
    except OSError:
        print("Error: no MPS control daemon is running", file=sys.stderr)  # INFERRED wording: mpsd reads the rc
        return 1
    sock.send(json.dumps({"argv": argv}).encode())
    answer = json.loads(sock.recv(1 << 20))
    sys.stdout.write(answer["out"])
    sys.stderr.write(answer["err"])
    return answer["rc"]


def main(argv: list[str]) -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or ("/run/nvidia-mps" if os.geteuid() == 0 else "/tmp/nvidia-mps")
    protocol, apply, foreground, v2_multiuser = "2", None, False, False
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
        elif opt in ("-m", "--multiuser"):  # [IF]: v3's multi-user option
            pass
        elif opt == "-multiuser-server" and os.environ.get("FAKE_MPS_V2_MULTIUSER"):
            v2_multiuser = True  # protocol 2's option (555+), which [IF] does not list for v3
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
        return front_end(pipe, args)
    if v2_multiuser and protocol == "2":  # a v2 daemon's start, as the multiUser probe sees it
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}.000 Control {os.getpid():5d}] Starting control daemon using "
              f"socket {pipe}/control", flush=True)
        time.sleep(60)
        return 0
    if protocol != "3" or v2_multiuser:
        print("Error: unknown option -multiuser-server" if v2_multiuser else
              "this stand-in implements protocol 3 only (the real binaries cover protocol 2)", file=sys.stderr)
        return 1
    try:
        servers = load_config(apply) if apply else {}
    except (Refused, tomllib.TOMLDecodeError, OSError) as exc:
        print(f"Configuration error: {apply}: {exc}", file=sys.stderr)  # [CF]: applied once at start
        return 1
    daemon = Daemon(pipe, servers)
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
