"""The Kubernetes API server, through lightkube: ResourceClaims read, ResourceSlices written.

The only module that talks to the API server. Objects go in and out as plain JSON dicts
(camelCase keys, ``resource.k8s.io/v1``) through lightkube's generic resources, so a field
newer than lightkube's models (``allowMultipleAllocations``, ``capacity`` request policies,
``consumedCapacity`` ...) passes through unchanged. lightkube brings the transport, TLS, auth
and config loading:

- ``KUBECONFIG`` set: that file (its current context: server, CA or
  insecure-skip-tls-verify, bearer token or token file; the first file when it names several);
- else the pod's service account (token, CA and namespace under
  /var/run/secrets/kubernetes.io/serviceaccount, server from KUBERNETES_SERVICE_HOST/PORT).

Every call is bounded in total by ``timeout`` seconds (connect, send, wait and read together,
whatever the server trickles) and its answer by ``max_answer`` bytes, both enforced at the
socket (mpsd/dra/bounded.py). Every failure becomes :class:`mpsd.errors.KubeAPIError` with a
one-line message naming the call, and ``status`` set to the HTTP status of an answer (404, 409 ...).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import msgspec
import yaml
from lightkube import ApiError, Client
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import SERVICE_ACCOUNT, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.resources.core_v1 import Node
from lightkube.types import OnErrorAction, OnErrorResult

from ..errors import KubeAPIError, one_line
from .bounded import AnswerRefused, BoundedTransport, bounded

log = logging.getLogger(__name__)

GROUP, VERSION = "resource.k8s.io", "v1"
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_TIMEOUT = 10.0
# An object is at most ~1.5 MiB in etcd (its request limit), a few MiB as JSON; this node's
# ResourceSlices are a few hundred KiB: 8 MiB leaves room and keeps 8 calls at once far from
# the daemon's memory.
MAX_ANSWER = 8 << 20
WATCH_SECONDS = 240  # the server ends a watch after this (timeoutSeconds); lightkube opens the next
FIELD_MANAGER = "mpsd"
ResourceSlice = create_global_resource(GROUP, VERSION, "ResourceSlice", "resourceslices")
ResourceClaim = create_namespaced_resource(GROUP, VERSION, "ResourceClaim", "resourceclaims")

T = TypeVar("T")


def load_config(environ: Mapping[str, str] = os.environ, service_account: str = SERVICE_ACCOUNT) -> KubeConfig:
    """The API server's address and credentials: ``KUBECONFIG``, else the service account."""
    paths = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    try:
        if paths:
            return KubeConfig.from_file(paths[0])
        if not Path(service_account, "token").is_file():
            raise KubeAPIError(
                f"no API server configuration: KUBECONFIG is not set and there is no service account token "
                f"in {service_account} (set automountServiceAccountToken, or KUBECONFIG)"
            )
        if not environ.get("KUBERNETES_SERVICE_HOST") or not environ.get("KUBERNETES_SERVICE_PORT"):
            raise KubeAPIError("in-cluster configuration needs KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT")
        return _service_account_config(Path(service_account), environ)
    except (LightkubeConfigError, OSError, AttributeError, KeyError, TypeError, ValueError, yaml.YAMLError,
            msgspec.MsgspecError) as e:
        where = f"KUBECONFIG file {paths[0]!r}" if paths else f"service account {service_account!r}"
        raise KubeAPIError(f"bad {where}: {one_line(e) or type(e).__name__}") from e


def _service_account_config(account: Path, environ: Mapping[str, str]) -> KubeConfig:
    """What lightkube's KubeConfig.from_service_account builds, with the address from ``environ``;
    the token is read from its file on every request (kubelet-rotated projected tokens)."""
    host, port = environ["KUBERNETES_SERVICE_HOST"], environ["KUBERNETES_SERVICE_PORT"]
    host = f"[{host}]" if ":" in host else host
    return KubeConfig.from_one(
        cluster=Cluster(server=f"https://{host}:{port}", certificate_auth=str(account / "ca.crt")),
        user=User(token_file=str(account / "token")),
        namespace=(account / "namespace").read_text().strip(),
    )


class KubeAPI:
    """The calls the DRA driver makes. ``close()`` (or ``with``) ends the connection pool."""

    def __init__(self, config: KubeConfig, timeout: float = DEFAULT_TIMEOUT, max_answer: int = MAX_ANSWER) -> None:
        if not timeout > 0:
            raise KubeAPIError(f"bad API server timeout {timeout!r}: expected seconds > 0")
        self.timeout, self.max_answer = timeout, max_answer
        try:
            single = config.get()
            if single is None or single.user is None:
                raise KubeAPIError("bad API server configuration: no current context with a user")
            # the pool of the transport is what bounds each call, so it carries the TLS settings
            # that lightkube would otherwise give httpx
            transport = BoundedTransport(verify_cluster(single.cluster, single.user, single.abs_file))
            self._client = Client(single, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER,
                                  trust_env=True, transport=transport)
            server = self._client.config.cluster.server
        except (LightkubeConfigError, OSError, ValueError, TypeError) as e:
            raise KubeAPIError(f"cannot set up the API server client: {one_line(e)}") from e
        log.info("kube api client server=%s timeout=%s max_answer=%d", server, timeout, max_answer)

    @classmethod
    def from_environment(cls, timeout: float = DEFAULT_TIMEOUT, environ: Mapping[str, str] = os.environ,
                         max_answer: int = MAX_ANSWER) -> KubeAPI:
        return cls(load_config(environ), timeout, max_answer)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> KubeAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        what = f"get ResourceClaim {namespace}/{name}"
        claim = self._call(what, lambda: self._client.get(ResourceClaim, name, namespace=namespace).to_dict())
        if not isinstance(claim, dict):
            raise KubeAPIError(f"{what}: unexpected answer from the API server: not an object")
        return claim

    def get_node_uid(self, name: str) -> str:
        """metadata.uid of the Node ``name`` (the owner of its ResourceSlices)."""
        what = f"get Node {name}"
        uid = self._call(what, lambda: getattr(self._client.get(Node, name).metadata, "uid", None))
        if not isinstance(uid, str) or not uid:
            raise KubeAPIError(f"{what}: unexpected answer from the API server: no metadata.uid")
        return uid

    def list_resource_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        """This node's ResourceSlices of ``driver`` (field selectors on spec.driver and spec.nodeName),
        each with the fields the publisher reads in the shapes it expects (KubeAPIError otherwise)."""
        fields: dict[str, Any] = {"spec.driver": driver, "spec.nodeName": node}
        what = f"list ResourceSlices of driver {driver} on node {node}"
        items = self._call(what, lambda: [o.to_dict() for o in self._client.list(ResourceSlice, fields=fields)])
        for i, item in enumerate(items):
            problem = slice_shape_error(item)
            if problem:
                raise KubeAPIError(f"{what}: unexpected answer from the API server: items[{i}]: {problem}")
        return items

    def create_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        what = f"create ResourceSlice {_name(obj)}"
        return self._call(what, lambda: self._client.create(ResourceSlice.from_dict(obj)).to_dict())

    def update_resource_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace (PUT) the slice; its metadata.resourceVersion makes a stale update a 409."""
        what = f"update ResourceSlice {_name(obj)}"
        return self._call(what, lambda: self._client.replace(ResourceSlice.from_dict(obj)).to_dict())

    def delete_resource_slice(self, name: str) -> None:
        self._call(f"delete ResourceSlice {name}", lambda: self._client.delete(ResourceSlice, name))

    def watch_resource_slices(self, driver: str, node: str,
                              server_timeout: int = WATCH_SECONDS) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, slice) for this node's ResourceSlices of ``driver``: ADDED for each one
        there at the start (a watch without resourceVersion), then ADDED, MODIFIED and DELETED as
        they happen. The server ends each request after ``server_timeout`` seconds and lightkube
        opens the next from the last resourceVersion seen (from scratch after a 410 Gone). A read
        waits at most ``server_timeout`` + the client's timeout (lightkube leaves watch reads
        unbounded: a half-open connection would wait forever). KubeAPIError when it fails; a
        caller stops it by closing this client."""
        what = f"watch ResourceSlices of driver {driver} on node {node}"
        fields: dict[str, Any] = {"spec.driver": driver, "spec.nodeName": node}
        generic = getattr(self._client, "_client", None)
        if generic is not None and hasattr(generic, "_watch_timeout"):
            generic._watch_timeout = httpx2.Timeout(self.timeout, read=server_timeout + self.timeout)
        events: Any = self._call(what, lambda: self._client.watch(  # a generator: close() ends it
            ResourceSlice, fields=fields, server_timeout=server_timeout, on_error=_retry_gone))
        waits = server_timeout + self.timeout  # an event may come at any time before the server ends the watch
        while True:
            try:
                event = self._call(what, lambda: next(events, None), timeout=waits)
            except KubeAPIError:
                events.close()
                raise
            if event is None:
                return
            kind, obj = event
            yield kind, obj.to_dict()

    def _call(self, what: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """``fn()`` under one budget: ``timeout`` (default the client's) seconds in all, at most
        max_answer bytes read; every failure is a one-line KubeAPIError."""
        try:
            with bounded(self.timeout if timeout is None else timeout, self.max_answer):
                return fn()
        except AnswerRefused as e:
            raise KubeAPIError(f"{what}: refused the API server's {e}") from e
        except ApiError as e:
            code = e.response.status_code if e.response is not None else None
            reason = getattr(e.status, "reason", None) or "error"
            raise KubeAPIError(f"{what}: API server answered {code} {reason}: {one_line(e)}", code) from e
        except httpx2.TimeoutException as e:
            raise KubeAPIError(
                f"{what}: no answer from the API server within {self.timeout:g}s (the whole call)") from e
        except httpx2.HTTPError as e:
            raise KubeAPIError(f"{what}: cannot reach the API server: {one_line(e) or type(e).__name__}") from e
        except (LightkubeConfigError, OSError) as e:
            raise KubeAPIError(f"{what}: {one_line(e) or type(e).__name__}") from e
        except (ValueError, msgspec.MsgspecError) as e:  # an answer that is not JSON
            raise KubeAPIError(f"{what}: unreadable answer from the API server: {one_line(e)}") from e
        except (TypeError, AttributeError, KeyError) as e:  # JSON of another shape than lightkube decodes
            raise KubeAPIError(f"{what}: unexpected answer from the API server: {type(e).__name__}: "
                               f"{one_line(e)[:200]}") from e


def slice_shape_error(obj: Any) -> str | None:
    """What is wrong with a listed ResourceSlice where the publisher reads it, or None."""
    if not isinstance(obj, dict):
        return f"not an object but {type(obj).__name__}"
    meta, spec = obj.get("metadata"), obj.get("spec")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        return "metadata.name is not a name"
    if not isinstance(spec, dict) or not isinstance(spec.get("pool"), dict):
        return "spec.pool is not an object"
    pool = spec["pool"]
    if not isinstance(pool.get("name"), str):
        return "spec.pool.name is not a string"
    for key in ("generation", "resourceSliceCount"):
        if not isinstance(pool.get(key), int) or isinstance(pool.get(key), bool):
            return f"spec.pool.{key} is not an integer"
    devices = spec.get("devices")
    if devices is not None and not isinstance(devices, list):
        return "spec.devices is not a list"
    for j, device in enumerate(devices or []):
        if not isinstance(device, dict) or not isinstance(device.get("name"), str):
            return f"spec.devices[{j}] is not a named device"
        if device.get("capacity") is not None and not isinstance(device["capacity"], dict):
            return f"spec.devices[{j}].capacity is not an object"
    return None


def _retry_gone(error: Exception, count: int) -> OnErrorResult:
    """A watch's resourceVersion too old (410 Gone): lightkube starts over without it; anything
    else ends the watch (the caller backs off)."""
    status = getattr(getattr(error, "status", None), "code", None)
    return OnErrorResult(OnErrorAction.RETRY if status == 410 and count < 3 else OnErrorAction.RAISE)


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or (meta.get("generateName", "") + "*"))
