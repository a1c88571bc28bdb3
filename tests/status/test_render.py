"""`mpsd status` as a table (mpsd.status.render_status), for nodes with and without clients."""

from __future__ import annotations

from mpsd.status import render_status

HEADER = "     PID   SERVER DEVICE                       MEMORY  COMMAND"


def node(servers: list, clients: list) -> dict:
    return {
        "pipeDir": "/run/mps",
        "daemon": "up",
        "error": "",
        "settings": {"activeThreadPercentage": 100.0, "pinnedMemLimit": {}, "clientPriority": 0},
        "servers": servers,
        "gpus": [],
        "clients": clients,
    }


def test_no_servers_and_no_clients_prints_no_table_header():
    assert render_status(node([], [])).splitlines() == [
        "daemon: up  pipe dir: /run/mps",
        "defaults: active threads 100.0%  pinned limit none  client priority 0",
        "servers: none",
        "clients: none",
    ]


def test_a_server_without_clients_yet_says_so_without_a_header():
    lines = render_status(node([{"pid": 900, "clients": []}], [])).splitlines()
    assert lines[-2:] == ["servers: 900", "clients: none"]
    assert HEADER not in lines


def test_clients_come_under_the_header():
    client = {"pid": 901, "client_id": 0, "server": 900, "device": "GPU-1", "namespace": "1", "command": "python x.py"}
    lines = render_status(node([{"pid": 900, "clients": [901]}], [client])).splitlines()
    assert lines[-3:] == ["servers: 900", HEADER, "     901      900 GPU-1                             -  python x.py"]
