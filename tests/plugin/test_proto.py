"""The protos speak the kubelet's wire format, and the committed generated code matches them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpsd.plugin import api_pb2, podresources_pb2

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module, service, methods",
    [
        (api_pb2, "v1beta1.Registration", ["Register"]),
        (
            api_pb2,
            "v1beta1.DevicePlugin",
            ["GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"],
        ),
        (podresources_pb2, "v1.PodResourcesLister", ["List", "GetAllocatableResources", "Get"]),
    ],
)
def test_services_have_the_kubelets_names(module, service, methods):
    desc = module.DESCRIPTOR.services_by_name[service.rpartition(".")[2]]
    assert desc.full_name == service
    assert [m.name for m in desc.methods] == methods


# (message, field, number) from k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto and
# podresources/v1/api.proto
FIELDS = [
    (api_pb2.RegisterRequest, "version", 1),
    (api_pb2.RegisterRequest, "endpoint", 2),
    (api_pb2.RegisterRequest, "resource_name", 3),
    (api_pb2.RegisterRequest, "options", 4),
    (api_pb2.DevicePluginOptions, "pre_start_required", 1),
    (api_pb2.DevicePluginOptions, "get_preferred_allocation_available", 2),
    (api_pb2.Device, "ID", 1),
    (api_pb2.Device, "health", 2),
    (api_pb2.Device, "topology", 3),
    (api_pb2.ContainerPreferredAllocationRequest, "available_deviceIDs", 1),
    (api_pb2.ContainerPreferredAllocationRequest, "must_include_deviceIDs", 2),
    (api_pb2.ContainerPreferredAllocationRequest, "allocation_size", 3),
    (api_pb2.ContainerPreferredAllocationResponse, "deviceIDs", 1),
    (api_pb2.ContainerAllocateRequest, "devices_ids", 1),
    (api_pb2.ContainerAllocateResponse, "envs", 1),
    (api_pb2.ContainerAllocateResponse, "mounts", 2),
    (api_pb2.ContainerAllocateResponse, "devices", 3),
    (api_pb2.ContainerAllocateResponse, "annotations", 4),
    (api_pb2.ContainerAllocateResponse, "cdi_devices", 5),
    (api_pb2.Mount, "container_path", 1),
    (api_pb2.Mount, "host_path", 2),
    (api_pb2.Mount, "read_only", 3),
    (podresources_pb2.PodResources, "name", 1),
    (podresources_pb2.PodResources, "namespace", 2),
    (podresources_pb2.PodResources, "containers", 3),
    (podresources_pb2.ContainerResources, "name", 1),
    (podresources_pb2.ContainerResources, "devices", 2),
    (podresources_pb2.ContainerDevices, "resource_name", 1),
    (podresources_pb2.ContainerDevices, "device_ids", 2),
]


@pytest.mark.parametrize("message, field, number", FIELDS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_field_numbers(message, field, number):
    assert message.DESCRIPTOR.fields_by_name[field].number == number


def test_a_register_request_encodes_as_the_kubelet_expects():
    req = api_pb2.RegisterRequest(version="v1beta1", endpoint="a.sock", resource_name="x/y")
    assert req.SerializeToString() == b"\n\x07v1beta1\x12\x06a.sock\x1a\x03x/y"


def test_generated_code_is_up_to_date(tmp_path):
    for proto in ("api", "podresources"):
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO), f"--python_out={tmp_path}",
             f"--grpc_python_out={tmp_path}", f"mpsd/plugin/{proto}.proto"],
            check=True,
            cwd=REPO,
        )
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            fresh = (tmp_path / "mpsd" / "plugin" / f"{proto}{suffix}").read_text()
            committed = (REPO / "mpsd" / "plugin" / f"{proto}{suffix}").read_text()
            assert fresh == committed, f"mpsd/plugin/{proto}{suffix} is stale: run scripts/gen-proto.sh"
