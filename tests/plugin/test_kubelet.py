"""Pure rules of the kubelet's side that the plugin checks before it talks to the kubelet."""

from __future__ import annotations

import pytest

from mpsd.errors import PluginError
from mpsd.plugin.kubelet import check_resource_name

from tests.plugin.conftest import gpus


@pytest.mark.parametrize(
    "name", ["mpsd.io/gpu", "example.com/gpu-slice", "a/b", "nvidia.com/gpu.shared", "x.y/A_b.c", "d/" + "n" * 63]
)
def test_extended_resource_names_the_kubelet_takes(name):
    assert check_resource_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "gpu",  # no domain: a native resource name
        "kubernetes.io/gpu",  # the kubelet's own namespace
        "foo.kubernetes.io/gpu",
        "requests.mpsd.io/gpu",  # the quota prefix
        "Mpsd.io/gpu",  # domains are lower case
        "mpsd.io/",
        "/gpu",
        "mpsd.io/-gpu",
        "mpsd.io/gpu/0",
        "mpsd_io/gpu",
        "d/" + "n" * 64,
        "d" * 245 + ".io/gpu",  # "requests." + domain longer than 253
    ],
)
def test_names_the_kubelet_refuses_are_refused_at_start(name):
    with pytest.raises(PluginError, match="bad resourceName") as info:
        check_resource_name(name)
    assert repr(name) in str(info.value) and "e.g. mpsd.io/gpu" in str(info.value)


def test_a_plugin_with_a_bad_resource_name_is_not_built(env):
    from mpsd.plugin import DevicePlugin

    with pytest.raises(PluginError, match="bad resourceName 'gpu'"):
        DevicePlugin(
            gpus=gpus(80), resource_name="gpu", slices_per_gpu=10, kubelet_dir=str(env.kubelet_dir),
            paths=env.paths, state_path=str(env.state_path), board=env.board,
        )
