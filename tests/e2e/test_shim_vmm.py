"""cuMemCreate memory stays charged for as long as the driver keeps it: until the handle is
released AND unmapped, in either order, with retained copies counted (the fake driver frees
it by the same rule, so the shim's usage is compared with what the fake really holds)."""

from __future__ import annotations

G = 1 << 30
M = 1 << 20
VA = 0x7F0000000000

USED = """
import shim
def used():
    (d,) = shim.usage({region!r}, library={lib!r})
    return [d.used, sum(p.used for p in d.processes)]
"""


def run_vmm(run_py, shim_env, shim_lib, tmp_path, code):
    """Run `code` (VA stands for a virtual address) with a 1G cap on device 0."""
    region = tmp_path / "region"
    code = USED.format(region=str(region), lib=str(shim_lib)) + code.replace("VA", str(VA))
    return run_py(code, shim_env(limit="0=1G", region=region))


def test_release_right_after_map_keeps_the_charge_until_unmap(run_py, shim_env, shim_lib, tmp_path):
    code = """
d = Driver(); d.init()
h = d.mem_create(768 << 20, 0)
d.mem_map(VA, 768 << 20, h)
d.mem_release(h)  # the CUDA samples' idiom: the mapping keeps the memory alive
emit(released=used(), fake=d.fake_used(0), more=attempt(d.mem_create, 512 << 20, 0))
d.mem_unmap(VA, 768 << 20)
emit(unmapped=used(), fake=d.fake_used(0), whole=attempt(d.mem_create, 1 << 30, 0) > 0)
"""
    r = run_vmm(run_py, shim_env, shim_lib, tmp_path, code)
    released, unmapped = r.records
    assert released == {"released": [768 * M, 768 * M], "fake": 768 * M, "more": {"error": 2}}
    assert unmapped == {"unmapped": [0, 0], "fake": 0, "whole": True}


def test_unmap_then_release_uncharges_at_the_release(run_py, shim_env, shim_lib, tmp_path):
    code = """
d = Driver(); d.init()
h = d.mem_create(512 << 20, 0)
d.mem_map(VA, 512 << 20, h)
d.mem_unmap(VA, 512 << 20)
emit(unmapped=used(), fake=d.fake_used(0))
d.mem_release(h)
emit(released=used(), fake=d.fake_used(0))
"""
    r = run_vmm(run_py, shim_env, shim_lib, tmp_path, code)
    assert r.records == [{"unmapped": [512 * M, 512 * M], "fake": 512 * M}, {"released": [0, 0], "fake": 0}]


def test_a_retained_handle_released_while_mapped_keeps_the_charge(run_py, shim_env, shim_lib, tmp_path):
    # NCCL's pattern: retain the handle of a live buffer, use it, release it; the buffer lives on
    code = """
d = Driver(); d.init()
h = d.mem_create(768 << 20, 0)
d.mem_map(VA, 768 << 20, h)
same = d.mem_retain(VA) == h
d.mem_release(h)
emit(same=same, after=used(), fake=d.fake_used(0), more=attempt(d.mem_create, 512 << 20, 0))
d.mem_unmap(VA, 768 << 20)
emit(mapped_ref_left=used(), fake=d.fake_used(0))
d.mem_release(h)
emit(gone=used(), fake=d.fake_used(0))
"""
    r = run_vmm(run_py, shim_env, shim_lib, tmp_path, code)
    first, second, third = r.records
    assert first == {"same": True, "after": [768 * M, 768 * M], "fake": 768 * M, "more": {"error": 2}}
    assert second == {"mapped_ref_left": [768 * M, 768 * M], "fake": 768 * M}
    assert third == {"gone": [0, 0], "fake": 0}


def test_one_unmap_of_adjacent_mappings_gives_each_back(run_py, shim_env, shim_lib, tmp_path):
    code = """
d = Driver(); d.init()
a = d.mem_create(512 << 20, 0)
b = d.mem_create(256 << 20, 0)
d.mem_map(VA, 512 << 20, a)
d.mem_map(VA + (512 << 20), 256 << 20, b)
d.mem_release(a); d.mem_release(b)
emit(partial=attempt(d.mem_unmap, VA, 600 << 20), used=used(), fake=d.fake_used(0))
d.mem_unmap(VA, 768 << 20)
emit(unmapped=used(), fake=d.fake_used(0))
"""
    r = run_vmm(run_py, shim_env, shim_lib, tmp_path, code)
    partial, unmapped = r.records
    assert partial == {"partial": {"error": 1}, "used": [768 * M, 768 * M], "fake": 768 * M}
    assert unmapped == {"unmapped": [0, 0], "fake": 0}


def test_a_failed_release_keeps_the_charge(run_py, shim_env, shim_lib, tmp_path):
    code = """
d = Driver(); d.init()
h = d.mem_create(512 << 20, 0)
d.mem_release(h)
emit(twice=attempt(d.mem_release, h), used=used(), fake=d.fake_used(0))
"""
    r = run_vmm(run_py, shim_env, shim_lib, tmp_path, code)
    assert r.one == {"twice": {"error": 1}, "used": [0, 0], "fake": 0}
