"""EXCLUSIVE_PROCESS handling through a fake nvidia-smi that records its arguments."""

from __future__ import annotations

import pytest

from mpsd.daemon.computemode import ComputeMode, parse_modes
from mpsd.errors import SetupError

FAKE = """#!/bin/sh
echo "$@" >> {log}
case "$1" in
  --query-gpu=*) printf '{modes}' ;;
esac
{extra}
"""


def fake_smi(tmp_path, modes="0, Default\\n1, Exclusive_Process\\n", extra=""):
    log = tmp_path / "smi.log"
    script = tmp_path / "nvidia-smi"
    script.write_text(FAKE.format(log=log, modes=modes, extra=extra))
    script.chmod(0o755)
    return str(script), log


def calls(log) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(
    "output,modes",
    [
        ("0, Default\n1, Exclusive_Process\n", {"0": "DEFAULT", "1": "EXCLUSIVE_PROCESS"}),
        ("0, Prohibited\n", {"0": "PROHIBITED"}),
        ("", {}),
    ],
)
def test_parse_modes(output, modes):
    assert parse_modes(output) == modes


@pytest.mark.parametrize("output", ["0 Default\n", "0, Sometimes\n"])
def test_parse_modes_rejects(output):
    with pytest.raises(SetupError):
        parse_modes(output)


def test_sets_only_gpus_not_already_exclusive_and_restores_them(tmp_path):
    smi, log = fake_smi(tmp_path)
    mode = ComputeMode(smi)
    mode.set_exclusive()
    assert calls(log) == ["--query-gpu=index,compute_mode --format=csv,noheader", "-i 0 -c EXCLUSIVE_PROCESS"]
    mode.restore()
    assert calls(log)[2:] == ["-i 0 -c DEFAULT"]
    mode.restore()  # a second restore does nothing
    assert len(calls(log)) == 3


def test_managed_devices_are_passed_to_the_query(tmp_path):
    smi, log = fake_smi(tmp_path, modes="1, Default\\n")
    ComputeMode(smi, ["1", "GPU-abc"]).set_exclusive()
    assert calls(log)[0] == "--query-gpu=index,compute_mode --format=csv,noheader -i 1,GPU-abc"


def test_failure_is_setup_error_with_output(tmp_path):
    smi, _ = fake_smi(tmp_path, extra='echo "Insufficient Permissions" >&2; exit 4')
    with pytest.raises(SetupError, match="exited 4: .*Insufficient Permissions"):
        ComputeMode(smi).set_exclusive()


def test_a_gpu_that_fails_puts_back_the_ones_already_changed(tmp_path):
    extra = '[ "$*" = "-i 1 -c EXCLUSIVE_PROCESS" ] && { echo "GPU 1 is busy" >&2; exit 3; }; exit 0'
    smi, log = fake_smi(tmp_path, modes="0, Default\\n1, Prohibited\\n2, Default\\n", extra=extra)
    mode = ComputeMode(smi)
    with pytest.raises(SetupError, match="exited 3: GPU 1 is busy"):
        mode.set_exclusive()
    assert calls(log)[1:] == ["-i 0 -c EXCLUSIVE_PROCESS", "-i 1 -c EXCLUSIVE_PROCESS", "-i 0 -c DEFAULT"]
    mode.restore()  # nothing left to put back
    assert len(calls(log)) == 4


def test_missing_binary(tmp_path):
    with pytest.raises(SetupError, match="cannot run"):
        ComputeMode(str(tmp_path / "none")).current()
