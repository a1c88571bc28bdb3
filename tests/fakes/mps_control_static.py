"""A stand-in ``nvidia-cuda-mps-control`` with static SM partitioning (CUDA 13.1+), for tests: no
binary reachable here has it (Debian ships 535 .. 555), so this one follows what NVIDIA's MPS
documentation says of it and leaves the rest to the real 535 binary:

- ``-f -S`` (``--static-partitioning``: "Start daemon with static partitioning mode enabled",
  Legacy MPS v2 Interface page): a daemon serving ``control`` and ``control_privileged`` in the
  pipe dir with the real front-end's protocol (tests/impostor.py's serve_one, seen with strace),
  holding a write lock on ``control_lock`` as the real daemon does, printing its log on stdout;
- the commands mpsd sends a v2 daemon (defaults, server list; no servers start here: there is
  no GPU) and ``sm_partition add <device UUID> <chunks>`` / ``sm_partition rm <device UUID>
  <partition>`` / ``lspart``. The answers' shapes are not in NVIDIA's pages; these follow what
  users' scripts parse from R590+ daemons: ``Partition <UUID>/<id> created`` for add, and the
  refusal ``Failed to fulfill the requested SM partition of N chunks, error
  CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION`` when too few chunks are free (inferred);
- without ``-f`` (the front-end), it runs the real binary named by ``MPSD_TEST_REAL_CONTROL``,
  which carries each command line to the daemon unchanged.

Devices and their chunks: ``STANDIN_CHUNKS="<uuid>=<n>,..."`` in the daemon's environment.
The words sm_partition and --static-partitioning are in this file, which is what mpsd's
detection looks for in a control binary (mpsd/daemon/smpartition.py).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.impostor import serve_one  # noqa: E402  (the front-end protocol)


class Daemon:
    def __init__(self, pipe: str, chunks: dict[str, int]) -> None:
        self.pipe = pipe
        self.free = dict(chunks)
        self.parts: dict[str, tuple[str, int]] = {}  # id -> (uuid, chunks)
        self.defaults = {"active_thread_percentage": "100.0", "client_priority": "0"}
        self.limits: dict[str, str] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}.000 Control {os.getpid()}] {text}", flush=True)

    def answer(self, command: str, _victim: int = 0) -> str:
        self.log(f"Cmd:{command}")
        words = command.split()
        name, args = (words[0], words[1:]) if words else ("", [])
        with self.lock:
            if name == "get_server_list":
                return ""
            if name == "get_default_active_thread_percentage":
                return self.defaults["active_thread_percentage"]
            if name == "set_default_active_thread_percentage" and args:
                self.defaults["active_thread_percentage"] = f"{float(args[0]):.1f}"
                return self.defaults["active_thread_percentage"]
            if name == "get_default_client_priority":
                return self.defaults["client_priority"]
            if name == "set_default_client_priority" and args:
                self.defaults["client_priority"] = args[0]
                return ""
            if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
                # 0 unsets it: the real 535 daemon then answers the get with nothing (tried)
                if args[1] == "0":
                    self.limits.pop(args[0], None)
                else:
                    self.limits[args[0]] = args[1]
                return ""
            if name == "get_default_device_pinned_mem_limit" and args:
                return self.limits.get(args[0], "")
            if name == "sm_partition" and len(args) == 3 and args[0] == "add":
                return self._add(args[1], args[2])
            if name == "sm_partition" and len(args) == 3 and args[0] == "rm":
                return self._rm(args[1], args[2])
            if name == "lspart":
                return "\n".join([f"{u} free chunks {n}" for u, n in self.free.items()]
                                 + [f"{p} {u} {n} chunks" for p, (u, n) in self.parts.items()])
            if name == "quit":
                self.stop.set()
                return ""
        return f'Unknown command "{name}"'

    def _add(self, uuid: str, chunks: str) -> str:
        n = int(chunks) if chunks.isdigit() else 0
        if uuid not in self.free:
            return f"Device {uuid} not found"
        if n < 1 or n > self.free[uuid]:
            return f"Failed to fulfill the requested SM partition of {chunks} chunks, error " \
                   "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"
        self.free[uuid] -= n
        pid = f"{uuid}/{secrets.token_urlsafe(12)}"
        self.parts[pid] = (uuid, n)
        return f"Partition {pid} created"

    def _rm(self, uuid: str, part: str) -> str:
        found = self.parts.pop(part, None)
        if found is None or found[0] != uuid:
            return f"Partition {part} not found"
        self.free[uuid] += found[1]
        return ""

    def serve(self) -> None:
        import tests.impostor as protocol

        protocol.answer = self.answer  # serve_one asks it for each command's answer
        os.makedirs(self.pipe, exist_ok=True)
        lock = os.open(os.path.join(self.pipe, "control_lock"), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for name in ("control_privileged", "control"):
            path = os.path.join(self.pipe, name)
            if os.path.lexists(path):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.bind(path)
            os.chmod(path, 0o666 if name == "control" else 0o600)
            sock.listen(16)
            threading.Thread(target=self._accept, args=(sock,), daemon=True).start()
        self.log(f"Starting control daemon using socket {self.pipe}/control (static partitioning)")
        self.stop.wait()
        self.log("Control daemon exiting")

    def _accept(self, sock: socket.socket) -> None:
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        try:
            serve_one(conn, 0)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    if "-f" not in argv:
        real = os.environ["MPSD_TEST_REAL_CONTROL"]
        os.execv(real, [real, *argv])
    if "-S" not in argv and "--static-partitioning" not in argv:
        print("stand-in: only -f -S is implemented here", file=sys.stderr)
        return 1
    chunks = {}
    for item in filter(None, os.environ.get("STANDIN_CHUNKS", "").split(",")):
        uuid, _, n = item.partition("=")
        chunks[uuid] = int(n)
    Daemon(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), chunks).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
