"""mpsd.metrics.http HTTP endpoints and address parsing."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsd.errors import ConfigError, SetupError
from mpsd.registry import Metrics
from mpsd.config import parse_address
from mpsd.metrics.http import serve


def get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_probes_follow_the_callables() -> None:
    state = {"live": True, "ready": (False, "daemon not configured yet")}
    with serve("127.0.0.1:0", Metrics(), lambda: state["live"], lambda: state["ready"]) as server:
        assert server.port > 0
        assert get(server.port, "/healthz") == (200, "ok\n")
        assert get(server.port, "/readyz") == (503, "daemon not configured yet\n")
        state["ready"] = (True, "")
        assert get(server.port, "/readyz") == (200, "ok\n")
        state["live"] = False
        state["ready"] = (False, "")
        assert get(server.port, "/healthz") == (503, "not live\n")
        assert get(server.port, "/readyz") == (503, "not ready\n")
        assert get(server.port, "/nope")[0] == 404


def test_probes_may_return_a_plain_bool() -> None:
    state = {"ready": False}
    with serve("127.0.0.1:0", Metrics(), lambda: True, lambda: state["ready"]) as server:
        assert get(server.port, "/readyz") == (503, "not ready\n")
        state["ready"] = True
        assert get(server.port, "/readyz") == (200, "ok\n")


def test_a_probe_that_raises_answers_503() -> None:
    def broken() -> bool:
        raise RuntimeError("board gone")

    with serve("127.0.0.1:0", Metrics(), broken, lambda: (True, "")) as server:
        assert get(server.port, "/healthz") == (503, "probe failed: board gone\n")
        assert get(server.port, "/readyz") == (200, "ok\n")


def test_close_frees_the_port_and_is_idempotent() -> None:
    server = serve("127.0.0.1:0", Metrics(), lambda: True, lambda: (True, ""))
    port = server.port
    assert get(port, "/healthz")[0] == 200
    server.close()
    server.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    again = serve(f"127.0.0.1:{port}", Metrics(), lambda: True, lambda: (True, ""))
    try:
        assert again.port == port and get(port, "/healthz")[0] == 200
    finally:
        again.close()


def test_port_in_use_is_a_setup_error() -> None:
    with serve("127.0.0.1:0", Metrics(), lambda: True, lambda: (True, "")) as server:
        with pytest.raises(SetupError, match=f"cannot listen on '127.0.0.1:{server.port}'"):
            serve(f"127.0.0.1:{server.port}", Metrics(), lambda: True, lambda: (True, ""))


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        server = serve("[::1]:0", Metrics(), lambda: True, lambda: (True, ""))
    except SetupError as e:
        pytest.skip(f"IPv6 loopback unavailable: {e}")
    with server:
        assert get(server.port, "/healthz", host="[::1]") == (200, "ok\n")


@pytest.mark.parametrize(
    "address, expected",
    [
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        (":9400", ("0.0.0.0", 9400)),
        ("localhost:65535", ("localhost", 65535)),
        ("metrics.node-1.example:80", ("metrics.node-1.example", 80)),
        ("[::1]:9400", ("::1", 9400)),
        ("[::]:1", ("::", 1)),
    ],
)
def test_parse_address_accepts(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    "address",
    [
        "",
        "9400",
        "0.0.0.0",
        "0.0.0.0:",
        "0.0.0.0:65536",
        "0.0.0.0:-1",
        "0.0.0.0:94a0",
        "host:٩٤",
        "::1:9400",
        "[::g]:9400",
        "[::1:9400",
        "bad host:9400",
        "a..b:1",
        "-:",
        "http://x:80",
        "0.0.0.0:+80",
    ],
)
def test_parse_address_rejects_with_one_line(address: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_address(address)
    message = str(exc.value)
    assert message.startswith("metricsAddress: expected host:port") and repr(address) in message
    assert "\n" not in message


@given(
    host=st.one_of(st.ip_addresses(v=4).map(str), st.from_regex(r"\A[a-z][a-z0-9-]{0,20}(\.[a-z0-9]{1,10}){0,3}\Z")),
    port=st.integers(0, 65535),
)
def test_parse_address_round_trips(host: str, port: int) -> None:
    assert parse_address(f"{host}:{port}") == (host, port)


@given(st.text(max_size=30))
def test_parse_address_returns_a_valid_pair_or_raises_config_error(text: str) -> None:
    try:
        host, port = parse_address(text)
    except ConfigError:
        return
    assert host and 0 <= port <= 65535
    assert int(text.rpartition(":")[2]) == port
