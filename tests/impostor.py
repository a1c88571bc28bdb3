"""An impostor MPS control daemon, as a root process in a pod with the pipe dir mounted
read-write could run one: it binds its own SOCK_SEQPACKET sockets, renames them over
``control_privileged`` and ``control``, and answers the real 535 front-end's protocol (seen
with strace): the daemon sends ``OUTBHELL\\0``, the front-end ``OUTBCRED\\0`` and a 4-byte
version, then each command as an 8-byte length and the text (``cmd\\n\\0``); the daemon
answers with messages of a 4-byte kind (0: a line of output) and the text, and a kind-1
message once the front-end sent a length of 0.

This one claims server SERVER in FAULT whose only client is VICTIM, any process.

    python -m tests.impostor PIPE_DIR VICTIM_PID [SOCKET_NAME...]   (default: both)
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

SERVER = 4242


def answer(command: str, victim: int) -> str:
    """The impostor's lies, by command."""
    name, _, args = command.partition(" ")
    answers = {
        "get_server_list": str(SERVER),
        "get_server_status": "FAULT",
        "get_client_list": str(victim),
        "get_device_client_list": f"0 {victim}",
        "terminate_client": "0",
        "get_default_active_thread_percentage": "100.0",
        "set_default_active_thread_percentage": args or "100.0",
        "get_default_client_priority": "0",
        "ps": f"PID ID SERVER DEVICE NAMESPACE COMMAND\n{victim} 1 {SERVER} 0 4026531836 victim",
    }
    if name.startswith(("set_", "get_default_device")):
        return answers.get(name, "")
    return answers.get(name, f'Unknown command "{name}"')


def serve_one(conn: socket.socket, victim: int) -> None:
    with conn:
        conn.sendmsg([b"OUTBHELL\0"])
        conn.recv(64)  # OUTBCRED
        conn.recv(64)  # version
        while True:
            head = conn.recv(8)
            if len(head) < 8 or struct.unpack("<Q", head)[0] == 0:
                conn.sendmsg([struct.pack("<I", 1), b"\0\0\0\0"])
                return
            command = conn.recv(65536).rstrip(b"\0").decode(errors="replace").strip()
            text = answer(command, victim)
            if text:
                conn.sendmsg([struct.pack("<I", 0), text.encode()])


def listen(path: str, victim: int) -> None:
    tmp = f"{path}.impostor"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.lexists(tmp):
        os.unlink(tmp)
    sock.bind(tmp)
    os.chmod(tmp, 0o666)
    sock.listen(16)
    os.rename(tmp, path)  # over the real daemon's socket
    threading.Thread(target=_accept, args=(sock, victim), daemon=True).start()


def _accept(sock: socket.socket, victim: int) -> None:
    while True:
        conn, _ = sock.accept()
        try:
            serve_one(conn, victim)
        except OSError:
            pass


def main(argv: list[str]) -> None:
    pipe_dir, victim = argv[1], int(argv[2])
    for name in argv[3:] or ("control_privileged", "control"):
        listen(os.path.join(pipe_dir, name), victim)
    print("listening", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv)
