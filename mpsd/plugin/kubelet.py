"""The kubelet's side of the conversation: Registration and the pod-resources API.

Both are gRPC services the kubelet serves on unix sockets. gRPC errors are translated to
PluginError here, with the socket and the call named.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import grpc

from ..alloc.served import socket_identity
from ..errors import PluginError
from . import api_pb2, api_pb2_grpc, podresources_pb2, podresources_pb2_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def check_resource_name(name: str) -> str:
    """``name`` if the kubelet takes it as an extended resource (``<domain>/<name>``, not in
    kubernetes.io, e.g. ``mpsd.io/gpu``: the kubelet's IsExtendedResourceName); PluginError
    otherwise, so a bad name fails at start instead of every registration."""
    domain, slash, short = name.partition("/")
    quota_domain = "requests." + domain  # the kubelet checks "requests.<name>" as a qualified name
    ok = (
        bool(slash)
        and "kubernetes.io/" not in name
        and not name.startswith("requests.")
        and len(quota_domain) <= 253
        and _DNS_SUBDOMAIN.fullmatch(quota_domain) is not None
        and len(short) <= 63
        and _NAME.fullmatch(short) is not None
    )
    if not ok:
        raise PluginError(
            f"bad resourceName {name!r}: expected <domain>/<name> as the kubelet takes for an extended "
            "resource (lower-case DNS domain outside kubernetes.io, name of at most 63 letters, digits, "
            "'-', '_' or '.'), e.g. mpsd.io/gpu"
        )
    return name


def unix_target(path: str) -> str:
    return "unix://" + os.path.abspath(path)


def register(kubelet_socket: str, *, endpoint: str, resource_name: str, timeout: float = 5.0) -> None:
    """Registration.Register(version v1beta1, endpoint, resource name, preferred allocation on)."""
    request = api_pb2.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
    )
    try:
        with grpc.insecure_channel(unix_target(kubelet_socket), options=CHANNEL_OPTIONS) as channel:
            api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=timeout, wait_for_ready=False)
    except grpc.RpcError as exc:
        raise PluginError(
            f"kubelet registration failed socket={kubelet_socket} resource={resource_name}: "
            f"{exc.code().name} {exc.details()}"
        ) from exc


@dataclass(frozen=True)
class Holder:
    pod: str
    namespace: str
    container: str


def list_holders(socket_path: str, resource_name: str, timeout: float = 5.0) -> dict[frozenset[str], Holder] | None:
    """Which container holds which set of our device IDs, from PodResourcesLister.List.

    None when the socket does not exist (no pod-resources API on this node); PluginError if
    it exists and the call fails."""
    if socket_identity(socket_path) is None:
        return None
    try:
        with grpc.insecure_channel(unix_target(socket_path), options=CHANNEL_OPTIONS) as channel:
            reply = podresources_pb2_grpc.PodResourcesListerStub(channel).List(
                podresources_pb2.ListPodResourcesRequest(), timeout=timeout
            )
    except grpc.RpcError as exc:
        raise PluginError(f"pod-resources List failed socket={socket_path}: {exc.code().name} {exc.details()}") from exc
    return holders_from_list(reply, resource_name)


def holders_from_list(
    reply: podresources_pb2.ListPodResourcesResponse, resource_name: str
) -> dict[frozenset[str], Holder]:
    holders: dict[frozenset[str], Holder] = {}
    for pod in reply.pod_resources:
        for container in pod.containers:
            ids = frozenset(
                d for dev in container.devices if dev.resource_name == resource_name for d in dev.device_ids
            )
            if ids:
                holders[ids] = Holder(pod.name, pod.namespace, container.name)
    return holders
