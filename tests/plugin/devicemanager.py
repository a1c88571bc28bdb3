"""A stand-in for the kubelet's device manager with several registrations of one resource (a
rolling update of the device plugin with maxSurge), over real gRPC:

- Register (plugin/v1beta1/server.go) connects a client to ``<dir>/<endpoint>``; PluginConnected
  (manager.go) makes it *the* endpoint of the resource, replacing the one before; its
  ListAndWatch stream runs in a thread (client.go Run) and every answer replaces the resource's
  healthy and unhealthy device sets (genericDeviceUpdateCallback);
- when a client's stream ends (its plugin stopped), the client is disconnected and
  PluginDisconnected(resource) marks every device of the resource unhealthy
  (markResourceUnhealthy), whichever endpoint is current: the kubelet does not tell the clients
  of one resource apart there;
- ``allocate`` sends Allocate to the current endpoint for devices that are healthy, and refuses
  otherwise, as pod admission does ("requested number of devices unavailable").
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from pathlib import Path

import grpc

from mpsd.plugin import api_pb2, api_pb2_grpc

OPTIONS = [("grpc.enable_http_proxy", 0)]


class Client:
    def __init__(self, manager: StandInDeviceManager, resource: str, socket: str) -> None:
        self.manager, self.resource, self.socket = manager, resource, socket
        self.channel = grpc.insecure_channel("unix://" + socket, options=OPTIONS)
        self.stub = api_pb2_grpc.DevicePluginStub(self.channel)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        try:
            for response in self.stub.ListAndWatch(api_pb2.Empty()):
                self.manager.devices_updated(self.resource, response)
        except grpc.RpcError:
            pass
        self.manager.disconnected(self)


class StandInDeviceManager(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet_dir: Path) -> None:
        self.dir = str(kubelet_dir)
        self.lock = threading.Lock()
        self.endpoint: dict[str, Client] = {}  # resource -> current client
        self.clients: list[Client] = []
        self.healthy: dict[str, set[str]] = {}
        self.unhealthy: dict[str, set[str]] = {}
        self.registrations: list[str] = []  # endpoints in the order they registered
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.socket = os.path.join(self.dir, "kubelet.sock")
        self.server.add_insecure_port("unix://" + self.socket)
        self.server.start()

    def Register(self, request, context):
        client = Client(self, request.resource_name, os.path.join(self.dir, request.endpoint))
        try:
            client.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {exc.details()}")
        with self.lock:
            self.endpoint[request.resource_name] = client
            self.clients.append(client)
            self.registrations.append(request.endpoint)
        client.thread.start()
        return api_pb2.Empty()

    def devices_updated(self, resource: str, response) -> None:
        with self.lock:
            self.healthy[resource] = {d.ID for d in response.devices if d.health == "Healthy"}
            self.unhealthy[resource] = {d.ID for d in response.devices if d.health != "Healthy"}

    def disconnected(self, client: Client) -> None:
        with self.lock:
            if client in self.clients:
                self.clients.remove(client)
                healthy = self.healthy.pop(client.resource, set())
                self.unhealthy[client.resource] = self.unhealthy.get(client.resource, set()) | healthy
        client.channel.close()

    def allocate(self, resource: str, *containers: list[str]) -> api_pb2.AllocateResponse:
        with self.lock:
            client = self.endpoint.get(resource)
            wanted = {i for c in containers for i in c}
            missing = wanted - self.healthy.get(resource, set())
        if client is None or missing:
            raise AssertionError(f"requested number of devices unavailable for {resource}: {sorted(missing)}")
        request = api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers])
        return client.stub.Allocate(request, timeout=10)

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
        with self.lock:
            clients = list(self.clients)
        for c in clients:
            c.channel.close()
        Path(self.socket).unlink(missing_ok=True)
