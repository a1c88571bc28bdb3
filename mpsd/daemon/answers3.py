"""The MPS v3 front-end's answers, read as NVIDIA's "MPS v3 Interface" page documents them and
tolerant where it is silent. Pure (tables in tests/daemon/test_control3.py).

- The list verbs are asked for ``--format=csv``. A header line, when the daemon prints one, maps
  the columns by name (case, spaces, dashes and underscores ignored: the page's ``pinned-memory-
  limit`` and Dynamo's ``PINNED MEMORY LIMIT`` are one), so columns in another order or extra
  ones are fine. Without a header the page's order is taken. A column the answer lacks is
  ``None`` (unknown), never a guess.
- ``server list``: name, uid, pid, status, pipe-directory, allowed-devices, context-ids. A
  device list holds commas: quoted, it is one cell; unquoted, the cells between the pipe
  directory and the columns after it are the devices.
- ``namespace list``: name, server, server-status, pinned-memory-limit, active-thread-
  percentage, client-priority, pipe-directory.
- ``client list``: the page names no columns; its example ``51023,training,0,default,python
  train.py`` is pid, server, device, namespace, command.
- Server statuses: the pages show ``Ready`` only. A word mpsd does not know is kept as it is
  and reported by the caller, never an error; ``FAULT`` (v2's word) is taken as a fault.
- Limits compare as quantities: ``2G`` = ``2048M`` = ``2097152K``; ``30`` = ``30.00``.
An answer that cannot be read raises UnexpectedOutput naming the line.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass

from .control import UnexpectedOutput
from ..units import shown

SERVER_COLUMNS = ("name", "uid", "pid", "status", "pipe-directory", "allowed-devices", "context-ids")
NAMESPACE_COLUMNS = ("name", "server", "server-status", "pinned-memory-limit", "active-thread-percentage",
                     "client-priority", "pipe-directory")
CLIENT_COLUMNS = ("pid", "server", "device", "namespace", "command")
ALIASES = {"cmd": "command", "memory-limit": "pinned-memory-limit", "pinned-memory": "pinned-memory-limit",
           "thread-percentage": "active-thread-percentage", "priority": "client-priority",
           "namespace-name": "name", "server-name": "server", "devices": "allowed-devices"}
OK_STATES = frozenset({"ready", "active", "running", "initializing", "starting", "stopped", "idle"})
FAULT_STATES = frozenset({"fault", "faulted"})
UNSET = frozenset({"", "-", "none", "unset", "n/a", "default", "unlimited", "max"})
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_UUID = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z/_-]+")


@dataclass(frozen=True)
class Limits3:
    """A namespace's limits in the daemon's syntax: "" = not set; None (read only) = the answer
    has no such column."""

    pinned_memory_limit: str | None = ""
    active_thread_percentage: str | None = ""
    client_priority: str | None = ""

    def options(self) -> list[str]:
        pairs = (("pinned-memory-limit", self.pinned_memory_limit),
                 ("active-thread-percentage", self.active_thread_percentage),
                 ("client-priority", self.client_priority))
        return [f"--{k}={v}" for k, v in pairs if v]


FIELDS = (("pinned_memory_limit", "pinned-memory-limit"), ("active_thread_percentage", "active-thread-percentage"),
          ("client_priority", "client-priority"))


@dataclass(frozen=True)
class Server3:
    name: str
    uid: int | None
    pid: int | None  # None while the server has no process
    status: str  # as the daemon printed it
    allowed_devices: tuple[str, ...]

    @property
    def fault(self) -> bool:
        return self.status.strip().lower() in FAULT_STATES

    @property
    def known(self) -> bool:
        word = self.status.strip().lower()
        return word in OK_STATES or word in FAULT_STATES


@dataclass(frozen=True)
class Namespace3:
    server: str
    name: str
    limits: Limits3


@dataclass(frozen=True)
class Client3:
    pid: int
    server: str
    namespace: str


def key(column: str) -> str:
    word = re.sub(r"[\s_]+", "-", column.strip().lower())
    return ALIASES.get(word, word)


def _table(output: str, columns: tuple[str, ...], what: str) -> list[dict[str, str]]:
    """Rows as {column: cell}; the first line is a header when it names the first column and half
    of its cells are known columns."""
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        return []
    rows = [next(csv.reader([line], skipinitialspace=True), []) for line in lines]  # a line is a row
    first = [key(c) for c in rows[0]]
    named = first[0] == columns[0] or columns[0] in first
    if named and sum(c in columns for c in first) * 2 >= len(first):
        header, rows, lines = first, rows[1:], lines[1:]
    else:
        header = list(columns)
    out = []
    for line, cells in zip(lines, rows, strict=True):
        cells = [c.strip() for c in cells]
        if len(cells) < min(len(header), 2):
            raise UnexpectedOutput(f"unreadable {what} line {shown(line)}: expected columns {','.join(header)}")
        spill = len(cells) - len(header)
        if spill > 0 and "allowed-devices" in header:  # an unquoted device list
            at = header.index("allowed-devices")
            cells = cells[:at] + [",".join(cells[at:at + spill + 1])] + cells[at + spill + 1:]
        row = dict(zip(header, cells, strict=False))  # a row shorter than the header: those columns unknown
        row["_line"] = line
        out.append(row)
    return out


def _int(text: str | None, what: str, line: str) -> int | None:
    if text is None or text.strip().lower() in UNSET:
        return None
    if not text.isdigit() or len(text) > 10:
        raise UnexpectedOutput(f"unreadable {what} {shown(text)} in line {shown(line)}: expected a number or -")
    return int(text)


def parse_servers(output: str) -> list[Server3]:
    servers = []
    for row in _table(output, SERVER_COLUMNS, "server list"):
        line = row["_line"]
        if not row.get("name") or "status" not in row:
            raise UnexpectedOutput(f"unreadable server list line {shown(line)}: expected a name and a status")
        devices = tuple(d.strip() for d in row.get("allowed-devices", "").split(",") if d.strip() not in UNSET)
        servers.append(Server3(row["name"], _int(row.get("uid"), "uid", line), _int(row.get("pid"), "pid", line),
                               row["status"], devices))
    return servers


def parse_namespaces(output: str, server: str = "") -> list[Namespace3]:
    out = []
    for row in _table(output, NAMESPACE_COLUMNS, "namespace list"):
        if not row.get("name"):
            raise UnexpectedOutput(f"unreadable namespace list line {shown(row['_line'])}: expected a name")
        limits = Limits3(*(None if col not in row else ("" if row[col].lower() in UNSET else row[col])
                           for _f, col in FIELDS))
        out.append(Namespace3(row.get("server") or server, row["name"], limits))
    return out


def parse_clients(output: str) -> list[Client3]:
    out = []
    for row in _table(output, CLIENT_COLUMNS, "client list"):
        pid = _int(row.get("pid"), "client pid", row["_line"])
        if pid is None or "namespace" not in row:
            raise UnexpectedOutput(f"unreadable client list line {shown(row['_line'])}: expected a pid and a namespace")
        out.append(Client3(pid, row.get("server", ""), row["namespace"]))
    return out


def quantity(text: str) -> int | None:
    """Bytes of a memory limit (binary units, as Dynamo's guide: ``10G`` is 10,737,418,240 bytes)."""
    m = _QUANTITY.fullmatch(text.strip())
    return None if m is None else int(float(m.group(1)) * _UNIT[m.group(2).upper()])


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def same_value(field: str, want: str, got: str) -> bool:
    if field == "pinned_memory_limit":
        w, g = quantity(want), quantity(got)
        return w is not None and g is not None and abs(w - g) < (1 << 20)  # shown to the MiB at best
    w2, g2 = _number(want), _number(got)
    return w2 is not None and g2 is not None and abs(w2 - g2) < 0.05


def differences(want: Limits3, got: Limits3) -> list[str]:
    """The fields ``want`` sets that ``got`` holds otherwise ("unknown" for a column the answer lacks)."""
    out = []
    for field, column in FIELDS:
        w, g = getattr(want, field), getattr(got, field)
        if not w:
            continue
        if g is None:
            out.append(f"{column} unknown")
        elif not same_value(field, w, g):
            out.append(f"{column} {g or 'unset'} (expected {w})")
    return out


def same_limits(want: Limits3, got: Limits3) -> bool:
    return not differences(want, got)


def uuids(devices: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(d for d in devices if _UUID.fullmatch(d))
