"""The chart's check of a live release (templates/checks.yaml): an upgrade that would change
what the nodes keep (the holder's pod template, holder.enabled, ipcMode, a tmpfs size) is refused
unless holder.acknowledgeReplacement says the holder pods will be replaced; an ordinary upgrade
(mpsd's image, the config, the chart version) passes. The live release is the chart's own
rendering, served by a stand-in API server (tests/deploy/fakeapi.py) to the real `helm template
--dry-run=server`, whose `lookup` reads it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import CHART, NAMESPACE, RELEASE, one, tool
from tests.deploy.fakeapi import FakeAPI, serving


def template(*args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args]
    env = dict(os.environ)
    if kubeconfig is not None:
        cmd += ["--dry-run=server", "--disable-openapi-validation"]
        env["KUBECONFIG"] = str(kubeconfig)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)


def rendered(*args: str) -> list[dict[str, Any]]:
    proc = template(*args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def owned(obj: dict[str, Any]) -> dict[str, Any]:
    """As Helm leaves an object it installed: its release in the annotations."""
    obj["metadata"].setdefault("annotations", {}).update(
        {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE})
    return obj


def upgrade(live: list[str], new: list[str], tmp_path: Path, drop: str | None = None) -> subprocess.CompletedProcess[str]:
    """`helm template --dry-run=server` with values ``new`` against the DaemonSets rendered with
    values ``live`` (``drop``: one of them absent, as after `helm uninstall` kept the holder)."""
    api = FakeAPI()
    for obj in rendered(*live):
        if obj["kind"] == "DaemonSet" and obj["metadata"]["name"] != drop:
            api.put(owned(obj))
    with serving(api, tmp_path) as kubeconfig:
        return template(*new, kubeconfig=kubeconfig)


ORDINARY = [
    sets("image.tag=0.2.0"),
    sets("config.healthInterval=7s", "resources.limits.memory=3Gi"),
    sets("updateStrategy.type=OnDelete"),
]


@pytest.mark.parametrize("new", ORDINARY)
def test_an_ordinary_upgrade_passes(new: list[str], tmp_path: Path) -> None:
    proc = upgrade([], new, tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("live, new, changed", [
    ([], sets("ipcMode=tmpfs"), "ipcMode hostIPC -> tmpfs"),
    ([], sets("holder.image.tag=0.2.0"), "holderPod "),
    ([], sets("holder.enabled=false"), "holderPod "),
    ([], sets("nodeSelectorTerms[0].matchExpressions[0].key=nvidia.com/gpu.presnt",
              "nodeSelectorTerms[0].matchExpressions[0].operator=Exists"), "holderPod "),
    ([], sets("regionTmpfs.size=2Gi"), "regionTmpfs 1Gi/16384 -> 2Gi/16384"),
    (sets("ipcMode=tmpfs"), sets("ipcMode=tmpfs", "shmTmpfs.size=4Gi"), "shmTmpfs 1Gi/16384 -> 4Gi/16384"),
])
def test_a_change_of_what_the_nodes_keep_is_refused_unless_acknowledged(live: list[str], new: list[str],
                                                                        changed: str, tmp_path: Path) -> None:
    proc = upgrade(live, new, tmp_path)
    assert proc.returncode != 0
    (line,) = [x for x in proc.stderr.splitlines() if "this upgrade changes" in x]
    assert changed in line and "holder.acknowledgeReplacement=true" in line
    acknowledged = upgrade(live, [*new, *sets("holder.acknowledgeReplacement=true")], tmp_path)
    assert acknowledged.returncode == 0, acknowledged.stderr


def test_a_kept_holder_alone_is_checked_too(tmp_path: Path) -> None:
    # after `helm uninstall` kept mpsd-holder, a new install is compared with it
    proc = upgrade([], sets("ipcMode=tmpfs"), tmp_path, drop="mpsd")
    assert proc.returncode != 0 and "ipcMode hostIPC -> tmpfs" in proc.stderr


def test_a_release_of_an_older_chart_needs_the_acknowledgement(tmp_path: Path) -> None:
    api = FakeAPI()
    ds = one(rendered(), "DaemonSet", "mpsd")
    del ds["metadata"]["annotations"]["mpsd.io/node-settings"]
    api.put(owned(ds))
    with serving(api, tmp_path) as kubeconfig:
        proc = template(kubeconfig=kubeconfig)
        assert proc.returncode != 0 and "installed by an older chart" in proc.stderr
        assert template(*sets("holder.acknowledgeReplacement=true"), kubeconfig=kubeconfig).returncode == 0


def test_a_fresh_install_passes(tmp_path: Path) -> None:
    with serving(FakeAPI(), tmp_path) as kubeconfig:
        proc = template(*sets("ipcMode=tmpfs"), kubeconfig=kubeconfig)
    assert proc.returncode == 0, proc.stderr
