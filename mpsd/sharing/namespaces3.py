"""MPS v3 namespaces made, read back and removed as the pages allow, where a namespace without
limits gets the whole GPU (Dynamo's guide: "a namespace that sets no limits gets the whole GPU").

- :func:`make`: ``namespace create`` (no limit options: the Interface page shows none), then
  ``namespace set`` with every limit, then read back (``namespace list``; ``namespace get`` for
  a column the list lacks) and compared as quantities. A client that connected between the
  create and the set had no limits: it is ended (``client terminate``). When the set or the
  read-back fails, the namespace this call created is deleted again and the error raised.
- :func:`remove`: the namespace's clients ended (``client terminate``), ``namespace delete``,
  ``--force`` if refused; a delete still refused is an error naming the namespace. A namespace
  the daemon does not list is gone already.
- :func:`reconcile`: one health round's comparison of the live slices with every server's
  namespaces; it deletes only the namespaces mpsd's journal (mpsd/sharing/owned3.py) says it made.

Every step raises ControlError (CommandRejected, UnexpectedOutput, NotAsWanted ...), one line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from ..daemon.control import CommandRejected, UnexpectedOutput
from ..daemon.control3 import Control3, Limits3, Server3, differences
from ..errors import ControlError, ControlTimeout, DaemonNotRunning
from .owned3 import Owned

log = logging.getLogger(__name__)

FIELD_NAMES = (("pinned_memory_limit", "pinned-memory-limit"), ("active_thread_percentage", "active-thread-percentage"),
               ("client_priority", "client-priority"))


class NotAsWanted(ControlError):
    """The daemon took the verb, but does not hold what it was asked."""


def shown(limits: Limits3) -> str:
    return " ".join(f"{c}={getattr(limits, f) or '-'}" for f, c in FIELD_NAMES if getattr(limits, f) is not None)


def read(control: Control3, server: str, ns: str, want: Limits3 | None = None) -> Limits3 | None:
    """The namespace's limits as the daemon holds them; None when it does not list it. A column
    the list lacks is asked with ``namespace get`` for each field ``want`` sets."""
    found = next((n.limits for n in control.namespace_list(server) if n.name == ns), None)
    if found is None or want is None:
        return found
    values = {}
    for f, column in FIELD_NAMES:
        value = getattr(found, f)
        values[f] = control.namespace_get(server, ns, column) if value is None and getattr(want, f) else value
    return Limits3(**values)


def clients_of(control: Control3, server: str, ns: str) -> list[int]:
    """The namespace's clients; never mpsd itself (its socket checks connect for a moment)."""
    return sorted({c.pid for c in control.client_list()
                   if c.namespace == ns and c.server in ("", server) and c.pid != os.getpid()})


def make(control: Control3, server: str, ns: str, want: Limits3, owned: Owned) -> list[str]:
    """The namespace exists with ``want`` read back (see the module's docstring); notes of what was done."""
    notes: list[str] = []
    created = False
    if read(control, server, ns) is None:
        owned.add(server, ns)  # journaled before it exists: a crash after the create leaves it known
        try:
            control.namespace_create(server, ns)
            created = True
        except CommandRejected:
            if read(control, server, ns) is None:  # not made meanwhile by another round
                raise
    try:
        early = clients_of(control, server, ns) if created else []
        control.namespace_set(server, ns, want)
        got = read(control, server, ns, want)
        if got is None:
            raise NotAsWanted(f"namespace {server}/{ns} not listed after its limits were set")
        wrong = differences(want, got)
        if wrong:
            raise NotAsWanted(f"namespace {server}/{ns} reads back {'; '.join(wrong)} after namespace set")
        for pid in early:  # connected before its limits: it runs without them
            control.client_terminate(pid)
            notes.append(f"client pid {pid} of {server}/{ns} connected before its limits were set: terminated")
    except ControlError as exc:
        if created:
            try:
                remove(control, server, ns, owned)
            except ControlError as again:
                log.error("namespace %s/%s left after a failed set: %s", server, ns, again)
        raise exc
    return notes


def remove(control: Control3, server: str, ns: str, owned: Owned) -> str:
    """The namespace gone (see the module's docstring); what was done, one line."""
    if read(control, server, ns) is None:
        owned.discard(server, ns)
        return "not listed (gone already)"
    ended = clients_of(control, server, ns)
    for pid in ended:
        try:
            control.client_terminate(pid)
        except CommandRejected as exc:  # gone meanwhile, or refused: --force below
            log.info("client pid=%d of namespace %s/%s not terminated: %s", pid, server, ns, exc)
    try:
        control.namespace_delete(server, ns)
        how = "deleted"
    except CommandRejected as first:
        try:
            control.namespace_delete(server, ns, force=True)
            how = "deleted with --force"
        except CommandRejected as exc:
            raise CommandRejected(f"namespace {server}/{ns} not deleted: {first}; with --force: {exc}") from exc
    if read(control, server, ns) is not None:
        raise NotAsWanted(f"namespace {server}/{ns} still listed after namespace delete")
    owned.discard(server, ns)
    return f"{how}" + (f" ({len(ended)} client(s) terminated first)" if ended else "")


@dataclass
class Round:
    changes: list[str] = field(default_factory=list)  # put back
    problems: list[str] = field(default_factory=list)  # refused, tried again next round
    unreadable: list[str] = field(default_factory=list)  # answers mpsd cannot read (with the line)


def reconcile(control: Control3, servers: list[Server3], wanted: dict[str, dict[str, Limits3]], defaults: Limits3,
              owned: Owned) -> Round:
    """Every listed server's namespaces made the live slices' (``wanted``); see the module's docstring."""
    result = Round()

    def attempt(note: str, action: Callable[[], object]) -> None:
        try:
            done = action()
            result.changes.append(note if not isinstance(done, list) else "; ".join([note, *done]))
        except UnexpectedOutput as exc:
            result.unreadable.append(str(exc))
        except (ControlTimeout, DaemonNotRunning):
            raise
        except ControlError as exc:
            result.problems.append(f"{note} failed: {exc}")

    for server in servers:
        mine = wanted.get(server.name, {})
        try:
            have = {n.name: n.limits for n in control.namespace_list(server.name)}
        except UnexpectedOutput as exc:
            result.unreadable.append(str(exc))
            continue
        except CommandRejected as exc:
            result.problems.append(f"namespaces of server {server.name} not read: {exc}")
            continue
        def wrong(ns: str, want: Limits3, have: dict = have, server: Server3 = server) -> list[str]:
            got = have[ns]
            if any(getattr(got, f) is None and getattr(want, f) for f, _c in FIELD_NAMES):
                got = read(control, server.name, ns, want) or got  # a column the list lacks: namespace get
            return differences(want, got)

        try:
            if "default" in have and wrong("default", defaults):
                attempt(f"{server.name}/default {'; '.join(wrong('default', defaults))}: restored",
                        partial(control.server_set, server.name, defaults))
            for ns, want in sorted(mine.items()):
                if ns not in have:
                    attempt(f"{server.name}/{ns} missing, created",
                            partial(make, control, server.name, ns, want, owned))
                elif wrong(ns, want):
                    attempt(f"{server.name}/{ns} {'; '.join(wrong(ns, want))}: restored",
                            partial(make, control, server.name, ns, want, owned))
        except UnexpectedOutput as exc:
            result.unreadable.append(str(exc))
        except CommandRejected as exc:
            result.problems.append(f"namespaces of server {server.name} not read back: {exc}")
        for ns in sorted(set(have) - set(mine) - {"default"}):
            if owned.has(server.name, ns):
                attempt(f"{server.name}/{ns} of no live slice",
                        partial(remove, control, server.name, ns, owned))
    for name in sorted(set(wanted) - {s.name for s in servers}):
        result.problems.append(f"server {name} not listed by the daemon: its {len(wanted[name])} namespace(s) wait")
    return result
