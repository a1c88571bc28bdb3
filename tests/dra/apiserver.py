"""A stand-in Kubernetes API server for the DRA driver's tests: an HTTP(S) server in the test
process, as small as the driver needs, speaking the API's paths, status objects and selectors.

- ResourceClaims: tests put them in (``put_claim``, validated as every write is); GET one. Nodes (``nodes``): GET one.
- ResourceSlices: list (``fieldSelector`` on spec.driver, spec.nodeName, spec.pool.name,
  metadata.name; ``labelSelector`` k=v), get, create (``generateName`` honoured), replace
  (``resourceVersion`` checked: a stale one is 409 Conflict), delete.
- Every object mpsd writes is validated with kubernetes-validate, strict (a field the schema
  does not know fails), at the newest Kubernetes version it knows, plus the API server's own
  rules the schema cannot say (device count, unique names, request policies ...). A failure
  is answered 422 Invalid *and* kept in ``invalid``: the ``apiserver`` fixture fails the test.
- Watches of ResourceSlices (``?watch=true``, chunked JSON lines as the real server streams
  them): ADDED for every matching slice first when no ``resourceVersion`` is given, else the
  events after it; then each change as it happens, until ``timeoutSeconds`` or ``stop()``.
- Feature gates: ``gates_off`` (e.g. {"DRAConsumableCapacity", "DRADeviceTaints"}) drops the
  fields those gates govern from every ResourceSlice written, unless the stored slice being
  updated uses them already: what the real registry strategy does (dropDisabledFields in
  pkg/registry/resource/resourceslice/strategy.go). A taint written without ``timeAdded`` gets
  the time of the write ("Added automatically during create or update if not set": the field's
  description in the 1.37 schema).
- Faults: ``delay`` (seconds before each answer), ``refuse`` (close the connection without
  an answer), ``stop()``/``start()`` (nothing listens on the port), ``fail`` (answer the next
  requests of a method with these status codes; None serves one normally).
- ``raw``: method -> bodies of its next answers, sent as they are with status 200 (any shape).
- Misbehaving answers (``fault``, for every request while set): ``trickle`` (headers, then a
  space every ``fault_interval`` s, forever: JSON allows leading whitespace, so the answer is
  never complete and never wrong), ``trickle-headers`` (the status line, then a header byte at
  a time, forever), ``hang-after-headers`` (a Content-Length, half the body, then nothing),
  ``huge`` (a valid object of ``fault_bytes`` bytes, as fast as the client reads),
  ``huge-chunked`` (the same without a length), ``gzip`` (the same gzip-encoded: a few hundred
  KiB on the wire); ``fault_sent`` counts the bytes handed to the socket. ``hits`` (and
  ``arrived``, the same count) counts every request that reached the server, refused ones included.
- Bearer token required; ``tls=True`` serves HTTPS with a fresh self-signed certificate
  (openssl) whose CA file a KUBECONFIG can name.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.dra.apirules import default_taint_times, drop_disabled_fields, resource_claim_errors, resource_slice_errors

BASE = "/apis/resource.k8s.io/v1"
TOKEN = "mpsd-test-token"
_CLAIM = re.compile(rf"{BASE}/namespaces/([^/]+)/resourceclaims/([^/]+)")
_SLICES = re.compile(rf"{BASE}/resourceslices(?:/([^/]+))?")
_NODE = re.compile(r"/api/v1/nodes/([^/]+)")
SLICE_FIELDS = {"spec.driver", "spec.nodeName", "spec.pool.name", "metadata.name"}

Obj = dict[str, Any]


def validate(obj: Obj) -> list[str]:
    """Errors of ``obj`` under kubernetes-validate (strict, newest version) and the API rules."""
    try:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        return [f"schema {kubernetes_validate.latest_version()}: {path}: {e.message}"]
    rules = {"ResourceSlice": resource_slice_errors, "ResourceClaim": resource_claim_errors}.get(obj.get("kind"))
    return rules(obj) if rules else []


def status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _field(obj: Obj, dotted: str) -> str:
    node: Any = obj
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def _selector(text: str, allowed: set[str] | None) -> list[tuple[str, str, bool]]:
    """``a=b,c!=d`` -> [(a, b, True), (c, d, False)]; ValueError for what the API refuses."""
    terms = []
    for term in filter(None, text.split(",")):
        match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", term)
        if match is None:
            raise ValueError(f"unsupported selector term {term!r}")
        key, op, value = match.groups()
        if allowed is not None and key not in allowed:
            raise ValueError(f'field label not supported: "{key}"')
        terms.append((key, value, op != "!="))
    return terms


def _matches(obj: Obj, fields: list[tuple[str, str, bool]], labels: list[tuple[str, str, bool]]) -> bool:
    obj_labels = (obj.get("metadata") or {}).get("labels") or {}
    return all((_field(obj, k) == v) is eq for k, v, eq in fields) and \
        all((obj_labels.get(k) == v) is eq for k, v, eq in labels)


class StandInAPIServer:
    """Start with ``start()``; ``url`` is its address. Thread-safe."""

    def __init__(self, token: str = TOKEN, tls_dir: Path | None = None) -> None:
        self.token = token
        self.claims: dict[tuple[str, str], Obj] = {}
        self.slices: dict[str, Obj] = {}
        self.nodes: dict[str, Obj] = {}  # name -> Node (tests put them in; GET only)
        self.requests: list[tuple[str, str]] = []  # (method, path?query) of every request
        self.arrived = 0  # requests received, counted before any delay or fault
        self.invalid: list[str] = []
        self.gates_off: set[str] = set()
        self.events: list[tuple[int, str, Obj]] = []  # (resourceVersion, type, slice) of every change
        self.hits = 0
        self.stall_watches = False  # a watch answers its headers, then nothing, ever (a half-open connection)
        self.delay = 0.0
        self.refuse = False
        self.fail: dict[str, list[int | None]] = {}  # method -> status codes of its next requests (None: serve)
        self.raw: dict[str, list[bytes]] = {}  # method -> bodies of its next answers (200), as they are
        self.fault: str | None = None  # see the module docstring
        self.fault_interval = 0.05
        self.fault_bytes = 64 << 20
        self.fault_sent = 0
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._version = 0
        self._stopping = threading.Event()
        self._port = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.ca_file: Path | None = None
        self._tls: ssl.SSLContext | None = None
        if tls_dir is not None:
            self.ca_file, self._tls = _self_signed(tls_dir)

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://127.0.0.1:{self._port}"

    def start(self) -> None:
        self._stopping.clear()
        httpd = ThreadingHTTPServer(("127.0.0.1", self._port), _handler(self))
        httpd.daemon_threads = True
        if self._tls is not None:
            httpd.socket = self._tls.wrap_socket(httpd.socket, server_side=True)
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Nothing listens on the port afterwards (connection refused) until ``start()``."""
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=10)
            self._httpd = None

    def put_claim(self, claim: Obj) -> None:
        """Store a claim as the API server would hold it; one it would refuse fails the test."""
        errors = validate(claim)
        assert not errors, f"the API server would refuse this claim: {errors}"
        meta = claim["metadata"]
        with self.lock:
            self.claims[(meta["namespace"], meta["name"])] = json.loads(json.dumps(claim))

    def writes(self) -> list[tuple[str, str]]:
        with self.lock:
            return [r for r in self.requests if r[0] in ("POST", "PUT", "DELETE")]

    def pool_slices(self, driver: str, node: str) -> list[Obj]:
        with self.lock:
            return [json.loads(json.dumps(s)) for s in self.slices.values()
                    if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == node]

    # the API: each returns (status, body)

    def answer(self, method: str, url: str, body: Obj | None) -> tuple[int, Obj]:
        parts = urlsplit(url)
        with self.lock:
            self.requests.append((method, url))
            code = self.fail[method].pop(0) if self.fail.get(method) else None
            if code is not None:
                return code, status(code, "InternalError" if code >= 500 else "Injected", f"injected {code}")
            if m := _CLAIM.fullmatch(parts.path):
                if method != "GET":
                    return 405, status(405, "MethodNotAllowed", f"{method} on resourceclaims is not served here")
                claim = self.claims.get(m.groups())
                if claim is None:
                    return 404, status(404, "NotFound", f'resourceclaims.resource.k8s.io "{m.group(2)}" not found')
                return 200, claim
            if (m := _NODE.fullmatch(parts.path)) and method == "GET":
                node = self.nodes.get(m.group(1))
                return (200, node) if node else (404, status(404, "NotFound", f'nodes "{m.group(1)}" not found'))
            if m := _SLICES.fullmatch(parts.path):
                return self._slices(method, m.group(1), parse_qs(parts.query), body)
        return 404, status(404, "NotFound", f"the server could not find the requested resource {parts.path}")

    def _slices(self, method: str, name: str | None, query: dict[str, list[str]], body: Obj | None) -> tuple[int, Obj]:
        if name is None and method == "GET" and query.get("watch", [""])[0] in ("true", "1"):
            return 400, status(400, "BadRequest", "a watch is streamed: StandInAPIServer.watch")
        if name is None and method == "GET":
            try:
                fields = _selector(query.get("fieldSelector", [""])[0], SLICE_FIELDS)
                labels = _selector(query.get("labelSelector", [""])[0], None)
            except ValueError as e:
                return 400, status(400, "BadRequest", str(e))
            items = [s for s in self.slices.values() if _matches(s, fields, labels)]
            return 200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                         "metadata": {"resourceVersion": str(self._version)}, "items": items}
        if name is None and method == "POST":
            return self._write(None, body)
        if name is not None and method == "GET":
            return (200, self.slices[name]) if name in self.slices else self._not_found(name)
        if name is not None and method == "PUT":
            return self._write(name, body)
        if name is not None and method == "DELETE":
            gone = self.slices.pop(name, None)
            if gone is None:
                return self._not_found(name)
            self._version += 1
            gone["metadata"]["resourceVersion"] = str(self._version)  # a DELETED event carries the delete's version
            self._event("DELETED", gone)
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        return 405, status(405, "MethodNotAllowed", f"{method} is not served here")

    @staticmethod
    def _not_found(name: str) -> tuple[int, Obj]:
        return 404, status(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')

    def _write(self, name: str | None, obj: Obj | None) -> tuple[int, Obj]:
        if not isinstance(obj, dict):
            return 400, status(400, "BadRequest", "body is not a JSON object")
        drop_disabled_fields(obj, self.slices.get(name) if name else None, self.gates_off)
        default_taint_times(obj)
        errors = validate(obj)
        if errors:
            self.invalid.extend(errors)
            return 422, status(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(errors))
        meta = obj.setdefault("metadata", {})
        if name is None:
            return self._create(obj, meta)
        old = self.slices.get(name)
        if old is None:
            return self._not_found(name)
        if meta.get("name") != name:
            return 400, status(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match {name}")
        if meta.get("resourceVersion") != old["metadata"]["resourceVersion"]:
            return 409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices "{name}": '
                                                "the object has been modified; please apply your changes to the "
                                                "latest version and try again")
        for field in ("spec.driver", "spec.pool.name", "spec.nodeName"):
            if _field(obj, field) != _field(old, field):
                self.invalid.append(f"{field} changed on update of {name}: the field is immutable")
                return 422, status(422, "Invalid", f"{field}: field is immutable")
        meta.update(uid=old["metadata"]["uid"], creationTimestamp=old["metadata"]["creationTimestamp"])
        return self._store(obj, 200)

    def _create(self, obj: Obj, meta: Obj) -> tuple[int, Obj]:
        if "resourceVersion" in meta:
            return 400, status(400, "BadRequest", "resourceVersion should not be set on objects to be created")
        if not meta.get("name"):
            if not meta.get("generateName"):
                return 422, status(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if meta["name"] in self.slices:
            return 409, status(409, "AlreadyExists", f'resourceslices.resource.k8s.io "{meta["name"]}" already exists')
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        return self._store(obj, 201)

    def _store(self, obj: Obj, code: int) -> tuple[int, Obj]:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        created = obj["metadata"]["name"] not in self.slices
        self.slices[obj["metadata"]["name"]] = obj
        self._event("ADDED" if created else "MODIFIED", obj)
        return code, obj

    def _event(self, kind: str, obj: Obj) -> None:
        self.events.append((self._version, kind, json.loads(json.dumps(obj))))
        self.changed.notify_all()

    def watch(self, url: str) -> Iterator[Obj | None]:
        """The events of a watch request, then None each time nothing happened for a moment
        (the handler checks that the server still runs); ends at timeoutSeconds."""
        query = parse_qs(urlsplit(url).query)
        fields = _selector(query.get("fieldSelector", [""])[0], SLICE_FIELDS)
        labels = _selector(query.get("labelSelector", [""])[0], None)
        deadline = time.monotonic() + float(query.get("timeoutSeconds", ["1800"])[0])
        with self.lock:
            since = query.get("resourceVersion", [""])[0]
            if since in ("", "0"):
                first = [{"type": "ADDED", "object": json.loads(json.dumps(s))} for s in self.slices.values()
                         if _matches(s, fields, labels)]
                seen = self._version
            else:
                first, seen = [], int(since)
        yield from first
        while time.monotonic() < deadline and not self._stopping.is_set():
            with self.changed:
                self.changed.wait_for(lambda since=seen: self.events and self.events[-1][0] > since
                                      or self._stopping.is_set(),
                                      timeout=min(0.1, max(0.0, deadline - time.monotonic())))
                new = [(v, k, o) for v, k, o in self.events if v > seen]
            for version, kind, obj in new:
                seen = version
                if _matches(obj, fields, labels):
                    yield {"type": kind, "object": obj}
            if not new:
                yield None

    def wait_delay(self) -> None:
        if self.delay:
            self._stopping.wait(self.delay)


def _handler(server: StandInAPIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            with server.lock:
                server.arrived += 1
                server.hits += 1
            server.wait_delay()
            if server.refuse or server._stopping.is_set():  # stopped: a kept-alive connection is dropped too
                self.close_connection = True
                return
            if server.fault:
                with server.lock:
                    server.requests.append((self.command, self.path))
                self.close_connection = True
                try:
                    _misbehave(server, self)
                except OSError:  # the client went away
                    pass
                return
            query = parse_qs(urlsplit(self.path).query)
            if self.command == "GET" and query.get("watch", [""])[0] in ("true", "1") and \
                    self.headers.get("Authorization") == f"Bearer {server.token}" and \
                    _SLICES.fullmatch(urlsplit(self.path).path) and not server.fail.get("GET"):
                self._stream()
                return
            if self.headers.get("Authorization") != f"Bearer {server.token}":
                code, body = 401, status(401, "Unauthorized", "Unauthorized")
            else:
                try:
                    obj = json.loads(raw) if raw else None
                except ValueError:
                    code, body = 400, status(400, "BadRequest", "body is not JSON")
                else:
                    code, body = server.answer(self.command, self.path, obj)
            with server.lock:
                planted = server.raw[self.command].pop(0) if server.raw.get(self.command) else None
            data = json.dumps(body).encode() if planted is None else planted
            code = code if planted is None else 200
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self) -> None:
            """A watch, as the real server streams it: chunked, one JSON event per line."""
            with server.lock:
                server.requests.append(("WATCH", self.path))
            try:
                events = server.watch(self.path)
            except ValueError as e:
                data = json.dumps(status(400, "BadRequest", str(e))).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if server.stall_watches:
                self.wfile.flush()
                server._stopping.wait()
                self.close_connection = True
                return
            try:
                for event in events:
                    if server._stopping.is_set():  # the server went away: the connection breaks
                        self.close_connection = True
                        return
                    if event is not None:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

    return Handler


def _huge_parts(size: int) -> Iterator[bytes]:
    """A valid JSON object of about ``size`` bytes, in 64 KiB pieces."""
    yield b'{"kind":"ResourceClaim","apiVersion":"resource.k8s.io/v1","metadata":{},"pad":"'
    piece = b"a" * (64 << 10)
    for _ in range(size // len(piece)):
        yield piece
    yield b'"}'


def _misbehave(server: StandInAPIServer, handler: BaseHTTPRequestHandler) -> None:
    out, fault, wait = handler.wfile, server.fault, server._stopping.wait

    def send(data: bytes) -> None:
        out.write(data)
        out.flush()
        with server.lock:
            server.fault_sent += len(data)

    if fault == "trickle-headers":
        send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: ")
        while not wait(server.fault_interval):
            send(b"a")
        return
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    if fault == "trickle":
        send(head + b"Transfer-Encoding: chunked\r\n\r\n")
        while not wait(server.fault_interval):
            send(b"1\r\n \r\n")
    elif fault == "hang-after-headers":
        body = json.dumps(status(200, "", "")).encode()
        send(head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
        wait(3600)
    elif fault == "huge":
        length = sum(len(p) for p in _huge_parts(server.fault_bytes))
        send(head + f"Content-Length: {length}\r\n\r\n".encode())
        for part in _huge_parts(server.fault_bytes):
            send(part)
    elif fault == "huge-chunked":
        send(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for part in _huge_parts(server.fault_bytes):
            send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        send(b"0\r\n\r\n")
    elif fault == "gzip":
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
        body = b"".join(packer.compress(p) for p in _huge_parts(server.fault_bytes)) + packer.flush()
        send(head + f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    else:
        raise AssertionError(f"unknown fault {fault!r}")


def _self_signed(directory: Path) -> tuple[Path, ssl.SSLContext]:
    """A certificate for 127.0.0.1 (its own CA) and a server context using it."""
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return cert, context


def write_kubeconfig(path: Path, server: StandInAPIServer, *, token: str | None = None,
                     insecure: bool = False, trust: bool = True) -> Path:
    """A KUBECONFIG for ``server``: its CA file when it serves TLS (unless ``insecure``, or
    ``trust`` is False: then the system's CAs, which do not know it)."""
    cluster: Obj = {"server": server.url}
    if insecure:
        cluster["insecure-skip-tls-verify"] = True
    elif server.ca_file is not None and trust:
        cluster["certificate-authority"] = str(server.ca_file)
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
        "clusters": [{"name": "stand-in", "cluster": cluster}],
        "users": [{"name": "mpsd", "user": {"token": token or server.token}}],
        "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "mpsd"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def apiserver() -> Iterator[StandInAPIServer]:
    """A running stand-in API server (HTTP); the test fails if mpsd wrote an invalid object."""
    server = StandInAPIServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.invalid, f"mpsd wrote invalid objects: {server.invalid}"


@pytest.fixture
def kubeconfig(apiserver: StandInAPIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """KUBECONFIG (environment variable and file) pointing at the ``apiserver`` fixture."""
    path = write_kubeconfig(tmp_path / "kubeconfig", apiserver)
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path
