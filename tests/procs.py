"""Finding the MPS control daemon among a process's children.

``mpsd run`` has two kinds of ``nvidia-cuda-mps-control`` children: the daemon it supervises
(``nvidia-cuda-mps-control -f``) and the short-lived front-ends it runs for each command (a
health check's ``get_server_list``). A test that takes the first child by name sometimes gets a
front-end that is gone a moment later (CI saw it), so tests look for ``-f``.
"""

from __future__ import annotations

import os

import psutil

BINARY = "nvidia-cuda-mps-control"


def control_daemons(pid: int) -> list[psutil.Process]:
    """PID's descendants running ``nvidia-cuda-mps-control -f`` (with options such as
    ``-multiuser-server``, not a front-end); none if PID is gone."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            argv = child.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # a front-end that just ended
        if argv and os.path.basename(argv[0]) == BINARY and argv[1:2] == ["-f"]:
            found.append(child)
    return found


def control_daemon(pid: int) -> psutil.Process | None:
    """The one daemon under PID, or None while there is none (or, briefly, two)."""
    found = control_daemons(pid)
    return found[0] if len(found) == 1 else None
