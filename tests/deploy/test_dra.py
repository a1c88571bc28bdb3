"""deploy/overlays/dra and examples/dra: mpsd as a DRA driver. Every object passes the schema
(kubernetes-validate, strict, newest version: test_render.py and below); these are the
invariants between the DaemonSet, its config, the DeviceClass, RBAC, the admission policy,
the claims of the examples and the driver's naming contract (mpsd/dra/devices.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from lightkube.utils.quantity import parse_quantity

from mpsd.dra import devices
from mpsd.dra.values import MIB, MIN_MEMORY_MIB
from tests.deploy.conftest import REPO, config_text, one, loadable, rendered

DRA = "deploy/overlays/dra"
EXAMPLES = REPO / "examples/dra"


def ds_spec() -> dict[str, Any]:
    return one(rendered(DRA), "DaemonSet", "mpsd")["spec"]["template"]["spec"]


def mpsd_container() -> dict[str, Any]:
    return next(c for c in ds_spec()["containers"] if c["name"] == "mpsd")


def config() -> dict[str, Any]:
    return yaml.safe_load(config_text(rendered(DRA)))


def mounts() -> dict[str, str]:
    """mountPath -> host path of the mpsd container's hostPath mounts."""
    volumes = {v["name"]: v for v in ds_spec()["volumes"]}
    return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
            for m in mpsd_container()["volumeMounts"] if "hostPath" in volumes[m["name"]]}


def test_the_driver_is_on_and_the_device_plugin_off() -> None:
    cfg = config()
    assert cfg["dra"]["enabled"] is True and cfg["devicePlugin"]["enabled"] is False
    assert cfg["dra"]["driverName"] == devices.DEFAULT_DRIVER_NAME
    assert cfg["dra"]["mode"] in devices.MODES


def test_the_config_is_the_tmpfs_one_plus_dra() -> None:
    ours = config()
    tmpfs = yaml.safe_load(config_text(rendered("deploy/overlays/tmpfs")))
    ours.pop("dra")
    ours["devicePlugin"]["enabled"] = True
    assert ours == tmpfs


def test_every_host_path_the_driver_uses_is_mounted_at_the_same_path() -> None:
    cfg, seen = config(), mounts()
    paths = [cfg["pipeDir"], cfg["logDir"], cfg["stateDir"], cfg["dra"]["pluginsDir"], cfg["dra"]["registryDir"],
             cfg["dra"]["cdiDir"]]
    for path in paths:
        assert seen.get(path) == path, path
    assert seen["/dev/shm"] == cfg["devicePlugin"]["shmDir"]  # ipcMode tmpfs: CDI mounts it into pods


def test_the_device_plugin_sockets_are_not_mounted() -> None:
    cfg, seen = config(), mounts()
    assert cfg["devicePlugin"]["kubeletDir"] not in seen.values()
    assert str(Path(cfg["devicePlugin"]["podResourcesSocket"]).parent) not in seen.values()


def test_node_name_from_the_downward_api_and_a_token_for_the_api_server() -> None:
    env = {e["name"]: e for e in mpsd_container()["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert ds_spec()["automountServiceAccountToken"] is True


def test_the_device_class_selects_the_configured_driver() -> None:
    (selector,) = one(rendered(DRA), "DeviceClass", "gpu.mpsd.io")["spec"]["selectors"]
    assert selector["cel"]["expression"] == f'device.driver == "{config()["dra"]["driverName"]}"'


def test_rbac_grants_slices_claim_and_node_reads_to_the_daemonsets_account_only() -> None:
    objects = rendered(DRA)
    role = one(objects, "ClusterRole", "mpsd-dra")
    assert {(tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]} == {
        (("resourceslices",), ("create", "delete", "get", "list", "update", "watch")),
        (("resourceclaims",), ("get", "list", "watch")),
        (("nodes",), ("get",)),
    }
    assert [r["apiGroups"] for r in role["rules"]] == [["resource.k8s.io"], ["resource.k8s.io"], [""]]
    binding = one(objects, "ClusterRoleBinding", "mpsd-dra")
    account = one(objects, "ServiceAccount", ds_spec()["serviceAccountName"])
    assert binding["roleRef"]["name"] == "mpsd-dra"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert len([o for o in objects if o["kind"] in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}]) == 2


def test_the_admission_policy_binds_slice_writes_to_the_writers_node() -> None:
    objects = rendered(DRA)
    policy = one(objects, "ValidatingAdmissionPolicy", "mpsd-dra-resourceslices")["spec"]
    binding = one(objects, "ValidatingAdmissionPolicyBinding", "mpsd-dra-resourceslices")["spec"]
    account = one(objects, "ServiceAccount", "mpsd")["metadata"]
    assert binding == {"policyName": "mpsd-dra-resourceslices", "validationActions": ["Deny"]}
    assert policy["failurePolicy"] == "Fail"
    (rule,) = policy["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"] and set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = policy["matchConditions"]
    user = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "spec.?nodeName" in variables["objectNodeName"] and "oldObject" in variables["objectNodeName"]
    assert [v["expression"] for v in policy["validations"]] == [
        'variables.userNodeName != ""', "variables.userNodeName == variables.objectNodeName"]


# --- examples/dra -------------------------------------------------------------------------

def example_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, obj in example_objects():
        if obj["kind"] == "Pod":
            out.append((f"{name}:{obj['metadata']['name']}", obj["spec"]))
        elif obj["kind"] == "Deployment":
            out.append((f"{name}:{obj['metadata']['name']}", obj["spec"]["template"]["spec"]))
    return out


def claim_templates() -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for _, o in example_objects() if o["kind"] == "ResourceClaimTemplate"}


@pytest.mark.parametrize("name, obj", example_objects(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_every_example_passes_the_schema(name: str, obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_the_examples_the_issue_asks_for_are_there() -> None:
    assert {"claim-template.yaml", "two-deployments.yaml", "shared-claim.yaml", "vllm.yaml"} <= \
        {p.name for p in EXAMPLES.glob("*.yaml")}
    requests = claim_templates()["gpu-4gi-25"]["spec"]["spec"]["devices"]["requests"]
    assert requests[0]["exactly"]["capacity"]["requests"] == {"memory": "4Gi", "compute": "25"}
    assert len([n for n, o in example_objects() if n == "two-deployments.yaml" and o["kind"] == "Deployment"]) == 2


def capacity_templates() -> list[str]:
    """The templates for capacity mode: they ask for amounts (capacity.requests)."""
    return sorted(n for n, t in claim_templates().items()
                  if any("capacity" in r["exactly"] for r in t["spec"]["spec"]["devices"]["requests"]))


@pytest.mark.parametrize("template", capacity_templates())
def test_claims_ask_the_driver_for_what_its_request_policy_accepts(template: str) -> None:
    device_class = one(rendered(DRA), "DeviceClass")["metadata"]["name"]
    for request in claim_templates()[template]["spec"]["spec"]["devices"]["requests"]:
        exactly = request["exactly"]
        assert exactly["deviceClassName"] == device_class
        asked = exactly["capacity"]["requests"]
        assert set(asked) <= {devices.MEMORY, devices.COMPUTE}
        memory, compute = parse_quantity(asked[devices.MEMORY]), parse_quantity(asked[devices.COMPUTE])
        assert memory >= MIN_MEMORY_MIB * MIB and memory % MIB == 0  # what the policy takes as asked
        assert 1 <= compute <= 100 and compute == int(compute)


@pytest.mark.parametrize("name, spec", pod_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_pods_use_claims_from_the_examples_and_no_host_ipc(name: str, spec: dict[str, Any]) -> None:
    claims = {c["name"]: c for c in spec["resourceClaims"]}
    assert all(c["resourceClaimTemplateName"] in claim_templates() for c in claims.values())
    for container in spec["containers"]:
        assert {c["name"] for c in container["resources"]["claims"]} <= set(claims)
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert not spec.get("hostIPC")  # the DRA install is tmpfs mode: the CDI spec mounts /dev/shm


def test_every_client_runs_as_one_uid() -> None:
    # MPS starts one server per UID: a client of a second UID waits for the first one's to end.
    uids = {c["securityContext"]["runAsUser"] for _, spec in pod_specs() for c in spec["containers"]}
    assert uids == {1000}


def test_the_shared_claim_is_named_by_both_containers() -> None:
    (spec,) = [s for n, s in pod_specs() if n.startswith("shared-claim.yaml")]
    assert len(spec["containers"]) == 2
    assert [[c["name"] for c in x["resources"]["claims"]] for x in spec["containers"]] == [["gpu"], ["gpu"]]


def test_vllm_sizes_its_cache_from_a_fraction_of_the_claim() -> None:
    (spec,) = [s for n, s in pod_specs() if n.startswith("vllm.yaml")]
    args = spec["containers"][0]["args"]
    (flag,) = [a for a in args if a.startswith("--gpu-memory-utilization=")]
    assert 0 < float(flag.split("=")[1]) < 1
    text = (EXAMPLES / "vllm.yaml").read_text()
    assert "cudaMemGetInfo" in text and "--gpu-memory-utilization" in text


def test_the_config_loads_with_mpsd_config(tmp_path: Path) -> None:
    from mpsd import config as mpsd_config
    from mpsd.errors import ConfigError

    path = tmp_path / "config.yaml"
    path.write_text(loadable(config_text(rendered(DRA))))
    try:
        cfg = mpsd_config.load(str(path), {}, {})
    except ConfigError as e:
        if "dra: unknown key" in str(e):
            pytest.skip("this mpsd.config has no dra.* keys yet (they come with the DRA kubelet plugin)")
        raise
    raw = config()["dra"]
    dra = cfg.dra
    assert (dra.enabled, dra.driver_name, dra.mode) == (raw["enabled"], raw["driverName"], raw["mode"])
    assert (dra.plugins_dir, dra.registry_dir, dra.cdi_dir) == (raw["pluginsDir"], raw["registryDir"], raw["cdiDir"])
    assert cfg.device_plugin.enabled is False


def test_the_driver_runs_in_the_selinux_domain_of_the_reference_drivers_and_no_more() -> None:
    """The kubelet plugin writes sockets under /var/lib/kubelet/plugins{,_registry} and specs in
    /var/run/cdi: on an SELinux-enforcing node the default container_t domain may not. The
    reference drivers (kubernetes-sigs/dra-example-driver, NVIDIA/k8s-dra-driver-gpu) run their
    plugin container privileged, which runs it as spc_t; mpsd takes that domain alone and keeps
    the base's restrictions: not privileged, no privilege escalation, all capabilities dropped
    but the base's six (docs/security.md, "Privileges of the DRA driver")."""
    base = next(c for c in one(rendered("deploy/base"), "DaemonSet", "mpsd")["spec"]["template"]["spec"]["containers"]
                if c["name"] == "mpsd")["securityContext"]
    ours = mpsd_container()["securityContext"]
    assert ours["seLinuxOptions"] == {"type": "spc_t"}
    assert {k: v for k, v in ours.items() if k != "seLinuxOptions"} == base
    assert ours["privileged"] is False and ours["allowPrivilegeEscalation"] is False
    assert ours["capabilities"]["drop"] == ["ALL"]


def test_nvidias_cdi_specs_are_readable_and_only_readable() -> None:
    """NVIDIA's specs (nvidia-ctk cdi generate writes /etc/cdi/nvidia.yaml) are read to answer their
    device IDs beside mpsd's (mpsd/dra/nvidiacdi.py); mpsd writes only in cdiDir."""
    volumes = {v["name"]: v for v in ds_spec()["volumes"]}
    (etc,) = [m for m in mpsd_container()["volumeMounts"] if m["mountPath"] == "/etc/cdi"]
    assert etc.get("readOnly") is True and volumes[etc["name"]]["hostPath"]["path"] == "/etc/cdi"
    assert mounts()["/var/run/cdi"] == config()["dra"]["cdiDir"] == "/var/run/cdi"


def test_the_slices_mode_example_selects_by_size_without_the_gate() -> None:
    """Without DRAConsumableCapacity (1.34 and 1.35 by default) the API server drops a request's
    ``capacity`` (it is gated), so in slices mode ``capacity.requests`` filters nothing and any
    slice would do. A CEL selector on the slice's capacity is not gated: the slices example picks
    by size with one, naming the driver's capacities, and asks for no capacity."""
    (template,) = [t for n, t in claim_templates().items() if n not in capacity_templates()]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    exactly = request["exactly"]
    assert "capacity" not in exactly and exactly.get("count", 1) >= 1
    expressions = [s["cel"]["expression"] for s in exactly["selectors"]]
    domain = devices.DEFAULT_DRIVER_NAME
    assert any(f'device.capacity["{domain}"].{devices.MEMORY}.compareTo(quantity(' in e for e in expressions)
    text = (EXAMPLES / "slices-claim-template.yaml").read_text()
    assert "DRAConsumableCapacity" in text and "dra.mode: slices" in text
    doc = (REPO / "docs/dra.md").read_text()
    assert "drops" in doc and "slices-claim-template.yaml" in doc


def test_what_the_node_needs_for_the_driver_libraries_is_shipped() -> None:
    """mpsd's CDI spec has no driver libraries: docs/dra.md names the two ways a node provides
    them (NVIDIA's CDI specs, or the NVIDIA runtime with the RuntimeClass shipped here)."""
    (rc,) = [o for _, o in example_objects() if o["kind"] == "RuntimeClass"]
    assert (rc["metadata"]["name"], rc["handler"]) == ("nvidia", "nvidia")
    doc = (REPO / "docs/dra.md").read_text()
    assert "nvidia-ctk cdi generate" in doc and "examples/dra/runtimeclass.yaml" in doc
    assert "runtimeClassName: nvidia" in doc
