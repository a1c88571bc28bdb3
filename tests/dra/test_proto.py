"""The DRA protos speak the kubelet's wire format (names, packages, field numbers as published in
k8s.io/kubelet/pkg/apis/dra/{v1,v1beta1}/api.proto and pluginregistration/v1/api.proto), and
the committed generated code matches them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpsd.dra import dra_health_v1_pb2, dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

REPO = Path(__file__).resolve().parents[2]
DRA = [(dra_v1_pb2, "v1"), (dra_v1beta1_pb2, "v1beta1")]


@pytest.mark.parametrize("module, version", DRA)
def test_dra_service_has_the_kubelets_full_name(module, version):
    desc = module.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert desc.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
    assert [m.name for m in desc.methods] == ["NodePrepareResources", "NodeUnprepareResources"]


def test_registration_service_has_the_kubelets_full_name():
    desc = pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert desc.full_name == "pluginregistration.Registration"
    assert [m.name for m in desc.methods] == ["GetInfo", "NotifyRegistrationStatus"]


# (message, field, number, repeated) as published
DRA_FIELDS = [
    ("NodePrepareResourcesRequest", "claims", 1, True),
    ("NodePrepareResourcesResponse", "claims", 1, True),  # map<string, NodePrepareResourceResponse>
    ("NodePrepareResourceResponse", "devices", 1, True),
    ("NodePrepareResourceResponse", "error", 2, False),
    ("Device", "request_names", 1, True),
    ("Device", "pool_name", 2, False),
    ("Device", "device_name", 3, False),
    ("Device", "cdi_device_ids", 4, True),
    ("NodeUnprepareResourcesRequest", "claims", 1, True),
    ("NodeUnprepareResourcesResponse", "claims", 1, True),
    ("NodeUnprepareResourceResponse", "error", 1, False),
    ("Claim", "namespace", 1, False),
    ("Claim", "uid", 2, False),
    ("Claim", "name", 3, False),
]


@pytest.mark.parametrize("module, version", DRA)
@pytest.mark.parametrize("message, field, number, repeated", DRA_FIELDS)
def test_dra_field_numbers(module, version, message, field, number, repeated):
    desc = module.DESCRIPTOR.message_types_by_name[message].fields_by_name[field]
    assert (desc.number, desc.is_repeated) == (number, repeated)


def test_v1_devices_carry_the_optional_share_id_of_1_35():
    """k8s.io/kubelet/pkg/apis/dra/v1/api.proto (1.35): ``optional string share_id = 5`` in Device,
    the allocation result's shareID of a device that allows several allocations. Wire-compatible:
    a kubelet that does not know it skips it; field presence tells "none" from ""."""
    desc = dra_v1_pb2.DESCRIPTOR.message_types_by_name["Device"].fields_by_name["share_id"]
    assert (desc.number, desc.type, desc.has_presence) == (5, desc.TYPE_STRING, True)
    assert not dra_v1_pb2.Device().HasField("share_id")
    device = dra_v1_pb2.Device(device_name="gpu-0", share_id="5d3c0e0a")
    assert dra_v1beta1_pb2.Device.FromString(device.SerializeToString()).device_name == "gpu-0"
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name  # not in v1beta1


@pytest.mark.parametrize("module, version", DRA)
def test_response_claims_are_maps_keyed_by_uid(module, version):
    for message, value in (("NodePrepareResourcesResponse", "NodePrepareResourceResponse"),
                           ("NodeUnprepareResourcesResponse", "NodeUnprepareResourceResponse")):
        entry = module.DESCRIPTOR.message_types_by_name[message].fields_by_name["claims"].message_type
        assert entry.GetOptions().map_entry
        assert entry.fields_by_name["key"].type == entry.fields_by_name["key"].TYPE_STRING
        assert entry.fields_by_name["value"].message_type.name == value


REGISTRATION_FIELDS = [
    ("PluginInfo", "type", 1),
    ("PluginInfo", "name", 2),
    ("PluginInfo", "endpoint", 3),
    ("PluginInfo", "supported_versions", 4),
    ("RegistrationStatus", "plugin_registered", 1),
    ("RegistrationStatus", "error", 2),
]


@pytest.mark.parametrize("message, field, number", REGISTRATION_FIELDS)
def test_registration_field_numbers(message, field, number):
    assert pluginregistration_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_a_claim_encodes_as_the_kubelet_sends_it():
    claim = dra_v1_pb2.Claim(namespace="ns", uid="u-1", name="c")
    assert claim.SerializeToString() == b"\n\x02ns\x12\x03u-1\x1a\x01c"
    info = pluginregistration_pb2.PluginInfo(
        type="DRAPlugin", name="d", endpoint="/e", supported_versions=["v1.DRAPlugin"]
    )
    assert info.SerializeToString() == b"\n\tDRAPlugin\x12\x01d\x1a\x02/e\"\x0cv1.DRAPlugin"


def test_v1beta1_bytes_read_as_v1():
    """Same messages, different package: the bytes of one are the bytes of the other."""
    beta = dra_v1beta1_pb2.NodePrepareResourcesResponse()
    beta.claims["u"].devices.add(request_names=["r"], pool_name="p", device_name="gpu-0", cdi_device_ids=["a/b=c"])
    v1 = dra_v1_pb2.NodePrepareResourcesResponse.FromString(beta.SerializeToString())
    assert v1.claims["u"].devices[0].cdi_device_ids == ["a/b=c"]


HEALTH = [(dra_health_v1_pb2, "v1"), (dra_health_v1alpha1_pb2, "v1alpha1")]
# (message, field, number) of k8s.io/kubelet/pkg/apis/dra-health/{v1,v1alpha1}/api.proto
HEALTH_FIELDS = [
    ("DeviceIdentifier", "pool_name", 1), ("DeviceIdentifier", "device_name", 2),
    ("DeviceHealth", "device", 1), ("DeviceHealth", "health", 2), ("DeviceHealth", "last_updated_time", 3),
    ("DeviceHealth", "health_check_timeout_seconds", 4), ("DeviceHealth", "message", 5),
    ("NodeWatchResourcesResponse", "devices", 1),
]


@pytest.mark.parametrize("module, package", HEALTH)
def test_health_service_has_the_kubelets_name_and_a_server_stream(module, package):
    """The kubelet matches ``<package>.DRAResourceHealth`` in the registration's supported
    versions against the service's full name (TestServiceNameConstants in k8s.io/kubelet)."""
    desc = module.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert desc.full_name == f"{package}.DRAResourceHealth"
    (method,) = desc.methods
    assert (method.name, method.server_streaming, method.client_streaming) == ("NodeWatchResources", True, False)
    assert {v.name: v.number for v in module.DESCRIPTOR.enum_types_by_name["HealthStatus"].values} == {
        "UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


@pytest.mark.parametrize("module, package", HEALTH)
@pytest.mark.parametrize("message, field, number", HEALTH_FIELDS)
def test_health_field_numbers(module, package, message, field, number):
    assert module.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_v1alpha1_health_bytes_read_as_v1():
    alpha = dra_health_v1alpha1_pb2.NodeWatchResourcesResponse(devices=[dra_health_v1alpha1_pb2.DeviceHealth(
        device=dra_health_v1alpha1_pb2.DeviceIdentifier(pool_name="p", device_name="gpu-0"),
        health=dra_health_v1alpha1_pb2.UNHEALTHY, health_check_timeout_seconds=30, message="down")])
    v1 = dra_health_v1_pb2.NodeWatchResourcesResponse.FromString(alpha.SerializeToString())
    assert (v1.devices[0].health, v1.devices[0].message) == (dra_health_v1_pb2.UNHEALTHY, "down")


@pytest.mark.parametrize("proto", ["dra_v1", "dra_v1beta1", "pluginregistration", "dra_health_v1",
                                   "dra_health_v1alpha1"])
def test_generated_code_is_up_to_date(tmp_path, proto):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO), f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"mpsd/dra/{proto}.proto"],
        check=True,
        cwd=REPO,
    )
    for suffix in ("_pb2.py", "_pb2_grpc.py"):
        fresh = (tmp_path / "mpsd" / "dra" / f"{proto}{suffix}").read_text()
        committed = (REPO / "mpsd" / "dra" / f"{proto}{suffix}").read_text()
        assert fresh == committed, f"mpsd/dra/{proto}{suffix} is stale: run scripts/gen-proto.sh"
