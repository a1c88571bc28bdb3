"""``mpsd check-config`` says which sharing backend this node would use and why; mps.protocol 3
where v3 cannot be had is one line and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpsd.sharing.detect import Choice, choose, driver_release, probe_binary
from mpsd.errors import SetupError



GPU = "gpu 0 GPU-00000000-aaaa-bbbb-cccc-000000000000 85899345920 0 9 0 0 Fake H100\n"


def check_config(tmp_path, binary, nvml_lib, driver, protocol="auto"):
    (tmp_path / "nvml.conf").write_text(GPU + f"driver {driver}\n")
    conf = tmp_path / "mpsd.yaml"
    conf.write_text(f"version: v1\ncontrolBinary: {binary}\nnvmlLibrary: {nvml_lib}\nmps:\n  protocol: '{protocol}'\n")
    env = dict(os.environ, FAKE_NVML_CONFIG=str(tmp_path / "nvml.conf"))
    return subprocess.run([sys.executable, "-m", "mpsd", "check-config", str(conf)], capture_output=True, text=True,
                          env=env, timeout=60)


def test_v3_where_the_binary_and_driver_have_it(tmp_path, fake_v3_binary, fake_nvml_lib):
    proc = check_config(tmp_path, fake_v3_binary, fake_nvml_lib, "615.20.01")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[-1]
    assert line.startswith("sharing backend on this node: MPS v3 (") and "615.20.01" in line


def test_v2_below_r615_with_the_reason(tmp_path, fake_v3_binary, fake_nvml_lib):
    proc = check_config(tmp_path, fake_v3_binary, fake_nvml_lib, "580.159.04")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("sharing backend on this node: MPS v2 (mps.protocol auto: driver "
                                            "580.159.04 is below R615)")


def test_protocol_3_where_v3_cannot_be_had_is_one_line(tmp_path, fake_v3_binary, fake_nvml_lib):
    proc = check_config(tmp_path, fake_v3_binary, fake_nvml_lib, "580.159.04", protocol="3")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "mps.protocol 3" in proc.stderr and "below R615" in proc.stderr


@pytest.mark.mps_binary
def test_the_real_v2_binary_does_not_speak_v3():
    from tests.mpsbin import DEFAULT_CACHE, FetchError, ensure_mps_control

    try:
        binary = ensure_mps_control(DEFAULT_CACHE)
    except FetchError as exc:
        pytest.fail(f"cannot fetch the real nvidia-cuda-mps-control: {exc}")
    speaks, said = probe_binary(str(binary))
    assert not speaks and "Cannot find MPS control daemon process" in said


@pytest.mark.parametrize("version, release", [("615.20.01", 615), ("580.159.04", 580), ("0.0.fake", None), (None, None)])
def test_driver_release(version, release):
    assert driver_release(version) == release


def test_choose_table():
    yes, no = (lambda b: (True, "speaks")), (lambda b: (False, "silent"))
    assert choose("2", "x", "615.1", yes) == Choice(2, "mps.protocol 2")
    assert choose("auto", "x", "615.1", yes).protocol == 3
    assert choose("auto", "x", "615.1", no) == Choice(2, "mps.protocol auto: silent")
    assert "unknown" in choose("auto", "x", None, yes).reason
    with pytest.raises(SetupError, match="silent"):
        choose("3", "x", "620.1", no)
