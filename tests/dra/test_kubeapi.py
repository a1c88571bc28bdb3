"""mpsd/dra/kubeapi.py against the stand-in API server: config from KUBECONFIG or the service
account, the calls the driver makes, and every failure as one KubeAPIError line."""
from __future__ import annotations

import copy
import json
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from mpsd.dra.kubeapi import KubeAPI, load_config
from mpsd.errors import KubeAPIError
from tests.dra.apiserver import StandInAPIServer, write_kubeconfig

CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
    "metadata": {"namespace": "team-a", "name": "llm-gpu", "uid": "0b6d6a6e-1111-4d5c-9a43-3a9e4f1c2d01"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": "gpu.mpsd.io", "capacity": {"requests": {"memory": "4Gi", "compute": "25"}}}}]}},
    "status": {"allocation": {"devices": {"results": [{
        "request": "gpu", "driver": "gpu.mpsd.io", "pool": "node-a", "device": "gpu-0",
        "shareID": "5d3c0e0a-8a38-4a8e-9c1f-2b7f0b1e9a10",
        "consumedCapacity": {"memory": "4Gi", "compute": "25"}}]}},
        "reservedFor": [{"resource": "pods", "name": "llm-0", "uid": "7f3e0c1a-2222-4b7e-8d55-6a1b2c3d4e5f"}]},
}


def slice_obj(node: str = "node-a", driver: str = "gpu.mpsd.io", **device: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"{node}-{driver}-"},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0", **device}]}}


def one_line_error(excinfo: pytest.ExceptionInfo[KubeAPIError]) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


def test_get_resource_claim_returns_the_object_as_sent(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    apiserver.put_claim(CLAIM)
    with KubeAPI.from_environment(timeout=30) as api:
        # camelCase keys, and fields newer than the client's models (shareID, consumedCapacity) kept
        assert api.get_resource_claim("team-a", "llm-gpu") == CLAIM
    assert apiserver.requests == [("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/llm-gpu")]


def test_a_missing_claim_is_one_line_with_its_name(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    with KubeAPI.from_environment(timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.get_resource_claim("team-a", "gone")
    assert "ResourceClaim team-a/gone" in one_line_error(excinfo) and "404" in str(excinfo.value)
    assert excinfo.value.status == 404


def test_a_wrong_token_is_refused_in_one_line(apiserver: StandInAPIServer, tmp_path: Path) -> None:
    config = load_config({"KUBECONFIG": str(write_kubeconfig(tmp_path / "kc", apiserver, token="wrong"))})
    with KubeAPI(config, timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.get_resource_claim("team-a", "llm-gpu")
    assert "401" in one_line_error(excinfo) and excinfo.value.status == 401


def test_slices_are_listed_by_driver_and_node_on_the_server(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    with KubeAPI.from_environment(timeout=30) as api:
        mine = api.create_resource_slice(slice_obj())
        api.create_resource_slice(slice_obj(node="node-b"))
        api.create_resource_slice(slice_obj(driver="gpu.example.com"))
        assert api.list_resource_slices("gpu.mpsd.io", "node-a") == [mine]
    listed = [url for method, url in apiserver.requests if method == "GET"]
    assert listed == ["/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.driver%3Dgpu.mpsd.io%2C"
                      "spec.nodeName%3Dnode-a"]


def test_update_and_delete_and_a_stale_update_is_a_409(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    with KubeAPI.from_environment(timeout=30) as api:
        created = api.create_resource_slice(slice_obj())
        changed = copy.deepcopy(created)
        changed["spec"]["pool"]["generation"] = 2
        updated = api.update_resource_slice(changed)
        assert updated["spec"]["pool"]["generation"] == 2
        with pytest.raises(KubeAPIError) as excinfo:
            api.update_resource_slice(changed)  # the resourceVersion it carries is gone
        assert excinfo.value.status == 409 and "update ResourceSlice" in one_line_error(excinfo)
        api.delete_resource_slice(created["metadata"]["name"])
        assert api.list_resource_slices("gpu.mpsd.io", "node-a") == []
        with pytest.raises(KubeAPIError) as excinfo:
            api.delete_resource_slice(created["metadata"]["name"])
        assert excinfo.value.status == 404


def test_the_stand_in_refuses_a_field_the_schema_does_not_know(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    # the guarantee every publisher test leans on: an unknown field fails, it is not dropped
    with KubeAPI.from_environment(timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.create_resource_slice(slice_obj(sharedMemory=True))
    assert excinfo.value.status == 422 and apiserver.slices == {}
    assert any("sharedMemory" in e for e in apiserver.invalid)
    apiserver.invalid.clear()


def test_the_stand_in_refuses_a_request_policy_the_api_refuses(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    policy = {"default": "300Mi", "validRange": {"min": "256Mi", "step": "100Mi", "max": "1Gi"}}
    bad = slice_obj(allowMultipleAllocations=True, capacity={"memory": {"value": "1Gi", "requestPolicy": policy}})
    with KubeAPI.from_environment(timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.create_resource_slice(bad)
    assert excinfo.value.status == 422 and any("min + n*step" in e for e in apiserver.invalid)
    apiserver.invalid.clear()


def test_a_slow_server_is_given_up_on_after_the_timeout(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    apiserver.delay = 60
    start = time.monotonic()
    with KubeAPI.from_environment(timeout=0.5) as api, pytest.raises(KubeAPIError) as excinfo:
        api.get_resource_claim("team-a", "llm-gpu")
    assert "no answer from the API server within 0.5s" in one_line_error(excinfo)
    assert time.monotonic() - start < 30  # not the server's 60 s
    assert excinfo.value.status is None


@pytest.mark.parametrize("fault", ["stopped", "refusing"])
def test_a_server_that_is_down_is_one_line(apiserver: StandInAPIServer, kubeconfig: Path, fault: str) -> None:
    if fault == "stopped":
        apiserver.stop()
    else:
        apiserver.refuse = True
    with KubeAPI.from_environment(timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.list_resource_slices("gpu.mpsd.io", "node-a")
    assert "cannot reach the API server" in one_line_error(excinfo)


@pytest.fixture
def tls_server(tmp_path: Path) -> Any:
    server = StandInAPIServer(tls_dir=tmp_path)
    server.start()
    server.put_claim(CLAIM)
    yield server
    server.stop()


@pytest.mark.parametrize("insecure", [False, True], ids=["ca-file", "insecure-skip-tls-verify"])
def test_https_with_the_ca_or_insecure(tls_server: StandInAPIServer, tmp_path: Path, insecure: bool) -> None:
    config = load_config({"KUBECONFIG": str(write_kubeconfig(tmp_path / "kc", tls_server, insecure=insecure))})
    with KubeAPI(config, timeout=30) as api:
        assert api.get_resource_claim("team-a", "llm-gpu")["metadata"]["uid"] == CLAIM["metadata"]["uid"]


def test_https_with_an_unknown_certificate_is_refused(tls_server: StandInAPIServer, tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "kc", tls_server, trust=False)
    with KubeAPI(load_config({"KUBECONFIG": str(path)}), timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.get_resource_claim("team-a", "llm-gpu")
    assert "cannot reach the API server" in one_line_error(excinfo)
    assert "CERTIFICATE_VERIFY_FAILED" in str(excinfo.value)


def service_account(server: StandInAPIServer, account: Path) -> Any:
    """What the kubelet mounts in a pod (token, namespace, CA) and the service address."""
    account.mkdir()
    (account / "token").write_text(server.token)
    (account / "namespace").write_text("mpsd-system")
    (account / "ca.crt").write_bytes(server.ca_file.read_bytes())
    host, port = server.url.removeprefix("https://").split(":")
    return load_config({"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}, str(account))


def test_the_service_account_in_a_pod(tls_server: StandInAPIServer, tmp_path: Path) -> None:
    with KubeAPI(service_account(tls_server, tmp_path / "serviceaccount"), timeout=30) as api:
        assert api.get_resource_claim("team-a", "llm-gpu") == CLAIM


@pytest.mark.parametrize("environ, expected", [
    ({}, "no API server configuration: KUBECONFIG is not set"),
    ({"KUBECONFIG": "/nonexistent/kubeconfig"}, "bad KUBECONFIG file '/nonexistent/kubeconfig'"),
])
def test_no_or_a_missing_configuration_is_one_line(tmp_path: Path, environ: dict[str, str], expected: str) -> None:
    with pytest.raises(KubeAPIError) as excinfo:
        load_config(environ, str(tmp_path / "no-serviceaccount"))
    assert expected in one_line_error(excinfo)


@pytest.mark.parametrize("text", ["{not yaml: [", "- a list\n", "apiVersion: v1\nkind: Config\nclusters: 7\n"])
def test_a_malformed_kubeconfig_is_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(KubeAPIError) as excinfo:
        KubeAPI(load_config({"KUBECONFIG": str(path)}), timeout=30)
    assert str(path) in one_line_error(excinfo) or "API server client" in str(excinfo.value)


def test_a_service_account_without_the_service_address_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("t")
    with pytest.raises(KubeAPIError) as excinfo:
        load_config({}, str(tmp_path))
    assert "KUBERNETES_SERVICE_HOST" in one_line_error(excinfo)


def test_a_rotated_service_account_token_is_read_again(tls_server: StandInAPIServer, tmp_path: Path) -> None:
    # the kubelet rotates projected tokens in place: each request reads the file
    account = tmp_path / "serviceaccount"
    with KubeAPI(service_account(tls_server, account), timeout=30) as api:
        api.get_resource_claim("team-a", "llm-gpu")
        tls_server.token = "rotated-token"
        with pytest.raises(KubeAPIError) as excinfo:
            api.get_resource_claim("team-a", "llm-gpu")
        assert excinfo.value.status == 401
        (account / "token").write_text("rotated-token\n")
        assert api.get_resource_claim("team-a", "llm-gpu") == CLAIM


def _call_in_thread(fn: Any, limit: float) -> tuple[BaseException | None, float]:
    """(what ``fn`` raised, seconds it took); fails the test if it is still running after
    ``limit`` s (the server stops at the fixture's end, which ends the call)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            outcome.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"the call was still running after {limit} s"
    return outcome[0], time.monotonic() - start


@pytest.mark.parametrize("fault", ["trickle", "trickle-headers", "hang-after-headers"])
def test_a_trickling_or_hanging_answer_ends_at_the_calls_deadline(apiserver: StandInAPIServer, kubeconfig: Path,
                                                                  fault: str) -> None:
    # httpx's timeouts are per read: a byte every 50 ms kept a call going forever
    apiserver.fault = fault
    with KubeAPI.from_environment(timeout=1.0) as api:
        error, took = _call_in_thread(lambda: api.get_resource_claim("team-a", "llm-gpu"), limit=30)
    assert isinstance(error, KubeAPIError), error
    assert "no answer from the API server within 1s (the whole call)" in str(error) and "\n" not in str(error)
    assert took < 15  # 1 s and a busy machine's slack; without the bound it never ends
    assert apiserver.requests  # the server was asked


@pytest.mark.parametrize("fault", ["huge", "huge-chunked", "gzip"])
def test_a_huge_answer_is_refused_without_being_read_whole(apiserver: StandInAPIServer, kubeconfig: Path,
                                                           fault: str) -> None:
    apiserver.fault = fault  # 64 MiB (a gzip of a few hundred KiB unpacking to 64 MiB)
    tracemalloc.start()
    try:
        with KubeAPI.from_environment(timeout=30) as api:
            error, _ = _call_in_thread(lambda: api.get_resource_claim("team-a", "llm-gpu"), limit=60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error, KubeAPIError), error
    assert "get ResourceClaim team-a/llm-gpu: refused the API server's answer" in str(error)
    assert "\n" not in str(error) and error.status is None
    assert peak < 32 << 20, f"{peak >> 20} MiB allocated for a refused answer"  # the cap is 8 MiB


def test_the_answer_cap_and_the_deadline_cover_a_whole_call(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    apiserver.put_claim(CLAIM)
    with KubeAPI.from_environment(timeout=30, max_answer=200) as api, pytest.raises(KubeAPIError) as excinfo:
        api.get_resource_claim("team-a", "llm-gpu")  # a small claim, but above 200 bytes
    assert "larger than 200 bytes" in one_line_error(excinfo)
    with KubeAPI.from_environment(timeout=30) as api:  # a fresh budget for each call
        for _ in range(3):
            assert api.get_resource_claim("team-a", "llm-gpu") == CLAIM


GOOD_SLICE = {"metadata": {"name": "node-a-gpu.mpsd.io-x"},
              "spec": {"pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1}, "devices": []}}
MALFORMED_LISTS = [
    b"[]", b'"text"', b"null", b"7", b'{"kind": "ResourceSliceList"}', b'{"items": 5}', b'{"items": [5]}',
    b'{"items": [{}]}', b'{"items": [{"metadata": {"name": 7}, "spec": {}}]}',
    b'{"items": [{"metadata": {"name": "a"}}]}', b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": 1}}]}',
    b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": {"name": "node-a", "generation": "1", '
    b'"resourceSliceCount": 1}}}]}',
    b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": {"name": "node-a", "generation": 1}}}]}',
    b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": {"name": "node-a", "generation": 1, '
    b'"resourceSliceCount": 1}, "devices": {"gpu-0": {}}}}]}',
    b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": {"name": "node-a", "generation": 1, '
    b'"resourceSliceCount": 1}, "devices": [7]}}]}',
    b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": {"name": "node-a", "generation": 1, '
    b'"resourceSliceCount": 1}, "devices": [{"name": "gpu-0", "capacity": []}]}}]}',
    b'{"items": [{"metadata": {"name": "a"}, "spec": {"pool": {"name": "node-a", "generation": 1, '
    b'"resourceSliceCount": 1}, "devices": [{"capacity": {}}]}}]}',
    b'{"items": [', b"",
]


@pytest.mark.parametrize("body", MALFORMED_LISTS, ids=range(len(MALFORMED_LISTS)))
def test_a_malformed_slice_list_is_one_line(apiserver: StandInAPIServer, kubeconfig: Path, body: bytes) -> None:
    apiserver.raw["GET"] = [body]
    with KubeAPI.from_environment(timeout=30) as api, pytest.raises(KubeAPIError) as excinfo:
        api.list_resource_slices("gpu.mpsd.io", "node-a")
    assert "list ResourceSlices of driver gpu.mpsd.io on node node-a" in one_line_error(excinfo)
    assert "unexpected answer from the API server" in str(excinfo.value) or "unreadable" in str(excinfo.value)


def test_a_slice_list_of_the_expected_shape_passes(apiserver: StandInAPIServer, kubeconfig: Path) -> None:
    apiserver.raw["GET"] = [json.dumps({"items": [GOOD_SLICE]}).encode()]
    with KubeAPI.from_environment(timeout=30) as api:
        assert api.list_resource_slices("gpu.mpsd.io", "node-a") == [GOOD_SLICE]


@pytest.mark.parametrize("body", [b"[]", b'{"metadata": 5}', b'{"metadata": {"uid": 5}}', b"null"])
def test_a_malformed_node_or_claim_is_one_line(apiserver: StandInAPIServer, kubeconfig: Path, body: bytes) -> None:
    with KubeAPI.from_environment(timeout=30) as api:
        apiserver.raw["GET"] = [body]
        with pytest.raises(KubeAPIError) as excinfo:
            api.get_node_uid("node-a")
        assert "get Node node-a" in one_line_error(excinfo)
        apiserver.raw["GET"] = [body]
        try:
            got = api.get_resource_claim("team-a", "llm-gpu")
        except KubeAPIError as e:
            assert "get ResourceClaim team-a/llm-gpu" in str(e) and "\n" not in str(e)
        else:
            assert isinstance(got, dict)  # claims.plan_claim checks every field it reads
def test_a_watch_that_stalls_ends_within_its_bound(apiserver, kubeconfig):
    """lightkube leaves a watch's reads unbounded: a connection that stays open and silent (half
    open) would hold the watch for ever. It ends after server_timeout + the client's timeout."""
    import time

    from mpsd.dra.kubeapi import KubeAPI
    from mpsd.errors import KubeAPIError

    apiserver.stall_watches = True
    with KubeAPI.from_environment(timeout=1) as api:
        t0 = time.monotonic()
        with pytest.raises(KubeAPIError, match="^watch ResourceSlices of driver gpu.mpsd.io on node node-a: no answer"):
            next(api.watch_resource_slices("gpu.mpsd.io", "node-a", server_timeout=1))
        assert time.monotonic() - t0 < 10
