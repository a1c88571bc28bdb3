"""The shared real-container helper (tests/container.py) does what its callers rely on."""

from __future__ import annotations

import json
import os

from tests.container import Mount


def test_a_container_runs_with_env_and_exit_code(podman):
    result = podman.run(["sh", "-c", 'echo "$GREETING"; exit 7'], env={"GREETING": "hello there"})
    assert result.returncode == 7, result.output
    assert result.stdout == "hello there\n", result.output


def test_read_only_and_read_write_bind_mounts(podman, tmp_path):
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "f").write_text("from host\n")
    script = "cat /ro/f; echo x > /ro/new && echo WROTE-RO; echo from-container > /rw/g"
    result = podman.run(["sh", "-c", script], mounts=[Mount(ro, "/ro"), Mount(rw, "/rw", read_only=False)])
    assert result.returncode == 0, result.output
    assert "from host" in result.stdout
    assert "WROTE-RO" not in result.stdout and "Read-only file system" in result.stderr, result.output
    assert not (ro / "new").exists()
    assert (rw / "g").read_text() == "from-container\n"


def test_a_non_root_user(podman):
    result = podman.run(["id", "-u"], user="1000:1000")
    assert (result.returncode, result.stdout.strip()) == (0, "1000"), result.output


def test_a_cdi_device_from_a_private_spec_dir(podman, tmp_path):
    shared = tmp_path / "claim"
    shared.mkdir()
    (shared / "f").write_text("claimed\n")
    specs = tmp_path / "cdi"
    specs.mkdir()
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "mpsd.io/claim",
        "devices": [{"name": "c1", "containerEdits": {
            "env": ["CLAIM=c1"],
            "mounts": [{"hostPath": str(shared), "containerPath": "/claim", "options": ["ro", "bind"]}],
        }}],
    }
    (specs / "mpsd.json").write_text(json.dumps(spec))
    result = podman.run(["sh", "-c", 'echo "$CLAIM"; cat /claim/f'], devices=["mpsd.io/claim=c1"], cdi_spec_dir=specs)
    assert result.returncode == 0, result.output
    assert result.stdout.split() == ["c1", "claimed"]
    # the host's CDI directory is left as it was: the spec was only visible to that run
    assert not os.path.exists(os.path.join(os.path.realpath("/var/run/cdi"), "mpsd.json"))
    unknown = podman.run(["true"], devices=["mpsd.io/claim=nope"], cdi_spec_dir=specs)
    assert unknown.returncode != 0 and "nope" in unknown.stderr, unknown.output


def test_a_run_past_its_timeout_is_stopped_and_removed(podman):
    result = podman.run(["sleep", "600"], timeout=5)
    assert result.timed_out, result.output
    left = podman.podman("ps", "--all", "--quiet")
    assert left.returncode == 0 and left.stdout.strip() == "", left.output
