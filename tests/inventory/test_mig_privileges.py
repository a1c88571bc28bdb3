"""MIG as NVIDIA's own tools see it, through the real pynvml over the fake NVML: an unprivileged
caller refused the aggregate queries of a GPU in MIG mode (nvml.h) still gets every GPU and every
instance; profiles come from GPU instance profile IDs as go-nvlib derives them, never from the tail of
NVML's device name; compute instances of one GPU instance share its memory; indices compact and a
created instance has a new UUID."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from mpsd.inventory.nvml import Inventory, use_library
from tests.fakes.nvml_build import mig_line, nvml_config_text

GIB, MIB = 1 << 30, 1 << 20
H100, TOTAL = "NVIDIA H100 80GB HBM3", 81559 * MIB
P0, P1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
M = [f"MIG-bbbbbbbb-0000-0000-0000-00000000000{i}" for i in range(8)]
FULL = "giprofile 0 4 7 80896 132 7 7 0 7 1\n"  # the H100's 7g.80gb: go-nvlib's rounding without the parent's memory


def node(*migs: str, privileged: bool = False) -> str:
    return nvml_config_text(
        gpus=[(P0, TOTAL, 0, (9, 0), True, H100), (P1, TOTAL, GIB, (9, 0), False, H100)],
        mps_clients=[(0, 100, GIB), (1, 200, GIB)], privileged=privileged) + FULL + "".join(migs)


@pytest.fixture
def inventory(fake_nvml_lib: Path, nvml_config):
    opened: list[Inventory] = []

    def open_(text: str) -> Inventory:
        nvml_config(text)
        opened.append(Inventory(library_path=str(fake_nvml_lib)))
        return opened[-1]

    yield open_
    for inv in opened:
        inv.close()


ONE = mig_line(0, 0, M[0], 9, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb", dec=1, jpg=1)


def test_unprivileged_the_mig_parent_is_refused_as_nvml_h_says_and_privileged_it_answers(fake_nvml_lib, nvml_config):
    nvml_config(node(ONE))
    use_library(str(fake_nvml_lib))
    pynvml.nvmlInit()
    try:
        parent, whole = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
        for query in (pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3,
                      lambda h: pynvml.nvmlDeviceGetGpuInstanceById(h, 9)):
            with pytest.raises(pynvml.NVMLError_NoPermission):
                query(parent)
        assert pynvml.nvmlDeviceGetMemoryInfo(whole).total == TOTAL  # a GPU not in MIG mode answers everyone
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
        assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == 9984 * MIB  # per instance: its own handle
        assert pynvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, 4, 1).memorySizeMB == 80896  # not privileged
    finally:
        pynvml.nvmlShutdown()
    nvml_config(node(ONE, privileged=True))
    pynvml.nvmlInit()
    try:
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetMemoryInfo(parent).total == TOTAL
        info = pynvml.nvmlGpuInstanceGetInfo(pynvml.nvmlDeviceGetGpuInstanceById(parent, 9))
        assert (info.id, info.profileId, info.placement.start, info.placement.size) == (9, 0, 9, 1)
    finally:
        pynvml.nvmlShutdown()


def test_a_refused_mig_parent_degrades_to_its_instances_and_hides_no_other_gpu(inventory, caplog):
    inv = inventory(node(ONE))
    gpus = inv.gpus()
    assert [(g.uuid, g.mig_enabled) for g in gpus] == [(P0, True), (P1, False)]
    assert gpus[1].memory_total == TOTAL and gpus[0].memory_total == 0  # unknown whole; read per instance
    assert [(c.gpu_index, c.pid) for c in inv.mps_clients()] == [(1, 200)]
    (one,) = inv.mig_devices(gpus, caps_file="/nonexistent")
    assert (one.uuid, one.profile, one.memory_total, one.gi_profile_id, one.placement_start) == (
        M[0], "1g.10gb", 9984 * MIB, 0, None)  # no placement without privileges
    assert sum("Insufficient Permissions" in r.getMessage() for r in caplog.records) == 3  # memory, process, GI
    inv.gpus(), inv.mps_clients(), inv.mig_devices(caps_file="/nonexistent")
    assert sum("Insufficient Permissions" in r.getMessage() for r in caplog.records) == 3  # said once each


# Each profile's line says in its name tail what NVML's name would (or nonsense): the IDs decide.
PROFILES = [
    (mig_line(0, 0, M[0], 1, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb+me", gip=7, dec=1, jpg=1, ofa=1), "1g.10gb+me"),
    (mig_line(0, 1, M[1], 2, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb-me", gip=0xD), "1g.10gb-me"),
    (mig_line(0, 2, M[2], 3, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb+me.all", gip=0xF, dec=7, jpg=7, ofa=1),
     "1g.10gb+me.all"),
    (mig_line(0, 3, M[3], 4, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb+gfx", gip=0xA, ce=2, dec=1, jpg=1),
     "1g.10gb+gfx"),
    (mig_line(0, 4, M[4], 5, 0, 1, 1, 16, 9984 * MIB, 0, "nonsense", dec=1, jpg=1), "1g.10gb"),
    (mig_line(0, 5, M[5], 6, 0, 2, 2, 32, 20096 * MIB, 0, "2g.20gb", dec=2, jpg=2), "2g.20gb"),
]


@pytest.mark.parametrize("privileged", [True, False])
def test_profiles_come_from_gpu_instance_profile_ids_as_go_nvlib_names_them(inventory, privileged):
    inv = inventory(node(*(line for line, _ in PROFILES), privileged=privileged))
    found = {d.uuid: d for d in inv.mig_devices(caps_file="/nonexistent")}
    assert [found[M[i]].profile for i in range(len(PROFILES))] == [p for _, p in PROFILES]
    assert all(d.problem == "" for d in found.values())
    assert found[M[2]].engines == (0, 7, 0, 7, 1)


def test_an_instance_whose_profile_cannot_be_told_apart_is_not_offered_under_another_name(inventory):
    """Without privileges, two GPU instance profiles with the same slices, memory and engines cannot be
    told apart: the instance gets no profile (and a problem) rather than one of theirs."""
    twins = "giprofile 0 13 1 9984 16 0 1 0 1 0\n"  # a 1_SLICE_NO_ME that looks like the plain 1g.10gb
    inv = inventory(node(mig_line(0, 0, M[0], 1, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb", dec=1, jpg=1)) + twins)
    (one,) = inv.mig_devices(caps_file="/nonexistent")
    assert one.profile == "" and "not one mpsd knows" in one.problem


def test_compute_instances_of_one_gpu_instance_share_its_memory(inventory, fake_nvml_lib, nvml_config, capfd):
    cis = [mig_line(0, i, M[i], 1, i, 3, 1, 20, 40192 * MIB, 0, "1c.3g.40gb") for i in range(3)]
    inv = inventory(node(*cis, privileged=True))
    found = inv.mig_devices(caps_file="/nonexistent")
    inv.close()
    assert [d.profile for d in found] == ["1c.3g.40gb"] * 3  # each is named by the GPU instance's 40 GB
    assert {d.gi_memory for d in found} == {40192 * MIB}
    assert sum(d.memory_total for d in found) <= 40192 * MIB  # sold once, not three times
    assert [d.memory_total for d in found] == [13397 * MIB] * 3
    nvml_config(node(cis[0], mig_line(0, 1, M[1], 1, 1, 3, 1, 20, 20 * GIB, 0, "1c.3g.20gb")))
    use_library(str(fake_nvml_lib))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    assert "share its memory" in capfd.readouterr().err


def test_indices_compact_and_a_created_instance_has_a_new_uuid(fake_nvml_lib, nvml_config, capfd):
    path = nvml_config(node(ONE, mig_line(0, 1, M[1], 2, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb")))
    use_library(str(fake_nvml_lib))
    pynvml.nvmlInit()
    try:
        parent = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)) == M[1]

        def rewrite(text: str) -> None:
            before = path.stat().st_mtime_ns
            path.write_text(text)
            os.utime(path, ns=(before + 10**9, before + 10**9))

        rewrite(node(mig_line(0, 1, M[1], 2, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb")))  # the first destroyed
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)) == M[1]
        rewrite(node(ONE, mig_line(0, 1, M[1], 2, 0, 1, 1, 16, 9984 * MIB, 0, "1g.10gb")))  # created again?
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)  # the layout was kept
        assert "UUID is not given again" in capfd.readouterr().err
    finally:
        pynvml.nvmlShutdown()
