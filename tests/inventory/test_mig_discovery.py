"""MIG discovery: the pure parts by table, then Inventory.mig_devices through the real pynvml over
the fake NVML (tests/fakes/fake_nvml_mig.c) with a caps file as the driver writes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mpsd.inventory.nvml import Inventory
from mpsd.inventory.mig import MigDevice, by_profile, memory_gb, parse_caps, profile_name
from tests.fakes.nvml_build import mig_line, nvml_config_text

GIB, MIB = 1 << 30, 1 << 20
H100_TOTAL = 81559 * MIB  # what NVML reports for an H100 80GB HBM3
A100_40 = 40960 * MIB


@pytest.mark.parametrize(
    "mib, total, gb",
    [
        (9984, H100_TOTAL, 10),  # 1g.10gb
        (20096, H100_TOTAL, 20),  # 2g.20gb
        (40192, H100_TOTAL, 40),  # 3g.40gb / 4g.40gb
        (80896, H100_TOTAL, 80),  # 7g.80gb
        (4864, A100_40, 5),  # 1g.5gb on an A100 40GB
        (19968, A100_40, 20),  # 3g.20gb
        (4864, 0, 5),  # parent total unknown: whole GiB
    ],
)
def test_memory_gb_is_the_name_nvidia_tools_give(mib, total, gb):
    assert memory_gb(mib, total) == gb


@pytest.mark.parametrize(
    "gip, cs, mib, profile",
    [  # go-nvlib's names (mig_profile.go) from NVML_GPU_INSTANCE_PROFILE_* IDs
        (0x0, 1, 9984, "1g.10gb"),
        (0x7, 1, 9984, "1g.10gb+me"),  # 1_SLICE_REV1
        (0xD, 1, 9984, "1g.10gb-me"),  # 1_SLICE_NO_ME: *without* media extensions
        (0xF, 1, 9984, "1g.10gb+me.all"),  # 1_SLICE_ALL_ME
        (0xA, 1, 9984, "1g.10gb+gfx"),  # 1_SLICE_GFX
        (0x9, 1, 20096, "1g.20gb"),  # 1_SLICE_REV2: twice the memory
        (0x2, 1, 40192, "1c.3g.40gb"),
        (0x2, 3, 40192, "3g.40gb"),
        (0x1, 2, 20096, "2g.20gb"),
        (0x4, 7, 80896, "7g.80gb"),
        (0x11, 3, 40192, None),  # an ID mpsd does not know: no guess
        (None, 1, 9984, None),
    ],
)
def test_profile_name(gip, cs, mib, profile):
    assert profile_name(gip, cs, mib, H100_TOTAL) == profile


def test_caps_file_parsed_and_junk_left_out():
    text = "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu1/gi2/access 21\nbad line\n"
    assert parse_caps(text) == {(0, 1, None): 12, (0, 1, 0): 13, (1, 2, None): 21}


M1, M2, M3, M4 = (f"MIG-aaaaaaaa-0000-0000-0000-00000000000{i}" for i in (1, 2, 3, 4))


def node(*migs: str) -> str:
    return nvml_config_text(gpus=[
        ("GPU-00000000-0000-0000-0000-000000000000", H100_TOTAL, 0, (9, 0), True, "NVIDIA H100 80GB HBM3"),
        ("GPU-11111111-1111-1111-1111-111111111111", H100_TOTAL, 0, (9, 0), False, "NVIDIA H100 80GB HBM3"),
        ("GPU-22222222-2222-2222-2222-222222222222", H100_TOTAL, 0, (9, 0), True, "NVIDIA H100 80GB HBM3"),
    ]) + "minor 2 5\n" + "".join(migs)


@pytest.fixture
def inventory(fake_nvml_lib: Path, nvml_config, tmp_path: Path):
    opened = []

    def open_(text: str) -> Inventory:
        nvml_config(text)
        inv = Inventory(library_path=str(fake_nvml_lib))
        opened.append(inv)
        return inv

    yield open_
    for inv in opened:
        inv.close()


def test_instances_of_every_gpu_in_mig_mode_with_their_caps_minors(inventory, tmp_path: Path):
    caps = tmp_path / "mig-minors"
    caps.write_text("gpu0/gi9/access 84\ngpu0/gi9/ci0/access 85\ngpu5/gi2/access 60\ngpu5/gi2/ci0/access 61\n")
    inv = inventory(node(
        mig_line(0, 0, M1, 9, 0, 1, 1, 16, 9984 * MIB, MIB, "1g.10gb"),
        mig_line(0, 3, M2, 2, 1, 3, 1, 16, 40192 * MIB, 0, "1c.3g.40gb"),
        mig_line(0, 4, M4, 2, 2, 3, 2, 32, 40192 * MIB, 0, "2c.3g.40gb"),
        mig_line(2, 1, M3, 2, 0, 3, 3, 60, 40192 * MIB, 0, "3g.40gb"),
    ))
    found = {d.uuid: d for d in inv.mig_devices(caps_file=str(caps))}
    assert set(found) == {M1, M2, M3, M4}
    one = found[M1]
    assert (one.parent_index, one.mig_index, one.gpu_instance, one.compute_instance) == (0, 0, 9, 0)
    assert (one.profile, one.memory_total, one.memory_used, one.sm_count) == ("1g.10gb", 9984 * MIB, MIB, 16)
    assert one.parent_uuid == "GPU-00000000-0000-0000-0000-000000000000" and one.compute_capability == (9, 0)
    assert one.caps_minors == (84, 85) and one.device_nodes == (
        "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap84", "/dev/nvidia-caps/nvidia-cap85")
    assert found[M2].profile == "1c.3g.40gb" and found[M2].caps_minors is None  # not in the caps file
    # two compute instances of one 40 GB GPU instance: NVML says 40 GB of each; they are sold 1/3 and 2/3
    assert (found[M2].gi_memory, found[M4].gi_memory) == (40192 * MIB, 40192 * MIB)
    assert (found[M2].memory_total, found[M4].memory_total) == (13397 * MIB, 26794 * MIB)
    assert found[M2].memory_total + found[M4].memory_total <= 40192 * MIB
    assert found[M3].parent_minor == 5 and found[M3].caps_minors == (60, 61)
    assert [d.uuid for d in by_profile(found.values())["3g.40gb"]] == [M3]


def test_mig_enabled_without_instances_and_no_mig_gpus_give_nothing(inventory, tmp_path: Path):
    inv = inventory(node())
    assert inv.mig_devices(caps_file=str(tmp_path / "absent")) == []
    assert [g.mig_enabled for g in inv.gpus()] == [True, False, True]


def test_a_layout_change_is_read_in_the_next_call(inventory, nvml_config, tmp_path: Path):
    first = node(mig_line(0, 0, M1, 9, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb"))
    inv = inventory(first)
    assert [d.uuid for d in inv.mig_devices(caps_file="/nonexistent")] == [M1]
    path = Path(os.environ["FAKE_NVML_CONFIG"])
    mtime = path.stat().st_mtime_ns + 10**9
    path.write_text(node(mig_line(0, 1, M2, 1, 0, 2, 2, 32, 20096 * MIB, 0, "2g.20gb")))
    os.utime(path, ns=(mtime, mtime))
    again = inv.mig_devices(caps_file="/nonexistent")
    assert [(d.uuid, d.profile) for d in again] == [(M2, "2g.20gb")]
    assert isinstance(again[0], MigDevice)
