"""The fake libcuda.so.1 itself (no shim): the bookkeeping and lookup semantics the shim's tests
rely on. Each test runs a ctypes client in a child process against the built fake."""
from __future__ import annotations

import pytest

G = 1 << 30
M = 1 << 20


def test_alloc_and_free_are_booked_exactly(run_py, fake_env):
    r = run_py(
        """
        d = Driver(); d.init()
        a = d.alloc(1 << 30); b = d.alloc(3 << 20)
        emit(step="allocated", used=d.fake_used(0), info=d.mem_info(), distinct=a != b and 0 not in (a, b))
        d.free(a)
        emit(step="freed a", used=d.fake_used(0), info=d.mem_info())
        d.free(b)
        emit(step="freed b", used=d.fake_used(0), info=d.mem_info(),
             double_free=attempt(d.free, b), unknown=attempt(d.free, 12345))
        """,
        fake_env(devices="4G"),
    )
    allocated, freed_a, freed_b = r.records
    assert allocated == {"step": "allocated", "used": G + 3 * M, "info": [4 * G - G - 3 * M, 4 * G], "distinct": True}
    assert freed_a["used"] == 3 * M and freed_a["info"] == [4 * G - 3 * M, 4 * G]
    assert freed_b["used"] == 0 and freed_b["info"] == [4 * G, 4 * G]
    assert freed_b["double_free"] == {"error": 1}
    assert freed_b["unknown"] == {"error": 1}


def test_allocation_past_total_is_out_of_memory_and_books_nothing(run_py, fake_env):
    r = run_py(
        """
        d = Driver(); d.init()
        a = d.alloc(3 << 30)
        emit(over=attempt(d.alloc, 1 << 30 | 1), used=d.fake_used(0))
        emit(exact=attempt(d.alloc, 1 << 30) > 0, used=d.fake_used(0), full=d.mem_info()[0])
        emit(zero=attempt(d.alloc, 0))
        """,
        fake_env(devices="4G"),
    )
    over, exact, zero = r.records
    assert over == {"over": {"error": 2}, "used": 3 * G}
    assert exact == {"exact": True, "used": 4 * G, "full": 0}
    assert zero == {"zero": {"error": 1}}


def test_calls_before_init_or_without_context_fail_like_the_real_driver(run_py, fake_env):
    r = run_py(
        """
        d = Driver()
        before = attempt(d.alloc, 1024)
        d.call("cuInit", 0)
        emit(before_init=before, no_context=attempt(d.alloc, 1024), info_no_context=attempt(d.mem_info),
             count=d.device_count())
        """,
        fake_env(),
    )
    assert r.one == {"before_init": {"error": 3}, "no_context": {"error": 201}, "info_no_context": {"error": 201}, "count": 1}


def test_devices_are_separate_with_their_own_totals_uuids_and_handles(run_py, fake_env):
    r = run_py(
        """
        import ctypes
        d = Driver(); d.init(1)
        p = d.alloc(1 << 20)
        h = d.mem_create(5 << 20, 0)
        uuid = (ctypes.c_ubyte * 16)()
        d.call("cuDeviceGetUuid_v2", uuid, 1)
        emit(count=d.device_count(), totals=[d.total_mem(0), d.total_mem(1)], info=d.mem_info(),
             used=[d.fake_used(0), d.fake_used(1)], uuid=bytes(uuid).hex(),
             release_as_ptr=attempt(d.free, h), bad_device=attempt(d.mem_create, 1024, 2))
        d.mem_release(h); d.free(p)
        emit(used=[d.fake_used(0), d.fake_used(1)])
        """,
        fake_env(devices="1G,2G"),
    )
    first, after = r.records
    assert first["count"] == 2
    assert first["totals"] == [G, 2 * G]
    assert first["info"] == [2 * G - M, 2 * G]
    assert first["used"] == [5 * M, M]
    assert first["uuid"] == "face" + "00" * 13 + "01"
    assert first["release_as_ptr"] == {"error": 1}
    assert first["bad_device"] == {"error": 101}
    assert after["used"] == [0, 0]


def test_v1_entry_points_keep_the_32_bit_abi(run_py, fake_env):
    r = run_py(
        """
        d = Driver(); d.init()
        p, free, total, tm = c_uint(), c_uint(), c_uint(), c_uint()
        d.call("cuMemAlloc", byref(p), c_uint(1 << 20))
        d.call("cuMemGetInfo", byref(free), byref(total))
        d.call("cuDeviceTotalMem", byref(tm), 0)
        used = d.fake_used(0)
        d.call("cuMemFree", p)
        emit(ptr=p.value, used=used, after=d.fake_used(0), info=[free.value, total.value], total=tm.value)
        """,
        fake_env(devices="16G"),
    )
    out = r.one
    assert 0 < out["ptr"] < 1 << 32
    assert out["used"] == M and out["after"] == 0
    assert out["info"] == [(1 << 32) - 1, (1 << 32) - 1]  # clamped, as a 32-bit ABI must
    assert out["total"] == (1 << 32) - 1


# (symbol, cudaVersion, flags) -> exported name handed out, or None, and the symbolStatus.
PROC_TABLE = [
    ("cuMemAlloc", 2000, 0, "cuMemAlloc", 0),
    ("cuMemAlloc", 3020, 0, "cuMemAlloc_v2", 0),
    ("cuMemAlloc", 12000, 0, "cuMemAlloc_v2", 0),
    ("cuMemAlloc", 12000, 2, "cuMemAlloc_v2", 0),
    ("cuMemAlloc", 1000, 0, None, 2),
    ("cuMemFree", 3020, 0, "cuMemFree_v2", 0),
    ("cuMemGetInfo", 2000, 0, "cuMemGetInfo", 0),
    ("cuMemGetInfo", 11000, 0, "cuMemGetInfo_v2", 0),
    ("cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2", 0),
    ("cuMemAllocPitch", 3000, 0, None, 2),
    ("cuMemAllocPitch", 3020, 0, "cuMemAllocPitch_v2", 0),
    ("cuMemAllocAsync", 11020, 0, "cuMemAllocAsync", 0),
    ("cuMemAllocAsync", 11020, 1, "cuMemAllocAsync", 0),
    ("cuMemAllocAsync", 11020, 2, "cuMemAllocAsync_ptsz", 0),
    ("cuMemAllocAsync", 11010, 2, None, 2),
    ("cuMemFreeAsync", 12000, 2, "cuMemFreeAsync_ptsz", 0),
    ("cuMemAllocFromPoolAsync", 13000, 2, "cuMemAllocFromPoolAsync_ptsz", 0),
    ("cuLaunchKernel", 4000, 2, "cuLaunchKernel", 0),  # _ptsz needs 7000: legacy it is
    ("cuLaunchKernel", 7000, 2, "cuLaunchKernel_ptsz", 0),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress", 0),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", 0),
    ("cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2", 0),
    ("cuDeviceGetUuid", 11000, 0, "cuDeviceGetUuid", 0),
    ("cuMemCreate", 10020, 0, "cuMemCreate", 0),
    ("cuMemAlloc_v2", 12000, 0, None, 1),  # versioned names are not base names
    ("cuNoSuchThing", 12000, 0, None, 1),
]


def test_get_proc_address_picks_the_variant_the_version_and_flags_ask_for(run_py, fake_env):
    r = run_py(
        f"""
        d = Driver()
        for symbol, version, flags, name, _ in {PROC_TABLE!r}:
            ptr, status = d.proc_address(symbol, version, flags)
            emit(symbol=symbol, version=version, flags=flags, status=status,
                 got=ptr, want=d.address_of(name) if name else None)
        """,
        fake_env(),
    )
    assert len(r.records) == len(PROC_TABLE)
    for rec, (_, _, _, _, status) in zip(r.records, PROC_TABLE, strict=True):
        assert rec["got"] == rec["want"], rec
        assert rec["status"] == status, rec


def test_get_proc_address_rejects_versions_newer_than_the_driver_and_has_a_4_arg_form(run_py, fake_env):
    r = run_py(
        """
        import ctypes
        d = Driver()
        emit(newer=attempt(d.proc_address, "cuMemAlloc", 13010))
        pfn = c_void_p()
        f = d.fn("cuGetProcAddress")
        f.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, c_ulonglong]
        emit(rc=f(b"cuMemAlloc", byref(pfn), 3020, 0), got=pfn.value, want=d.address_of("cuMemAlloc_v2"))
        """,
        fake_env(),
    )
    newer, four = r.records
    assert newer == {"newer": {"error": 1}}
    assert four["rc"] == 0 and four["got"] == four["want"]


def test_call_counters_count_every_call_including_refused_ones(run_py, fake_env):
    r = run_py(
        """
        d = Driver(); d.init()
        d.alloc(1 << 30); attempt(d.alloc, 1 << 30)
        emit(allocs=d.fake_calls("cuMemAlloc_v2"), frees=d.fake_calls("cuMemFree_v2"), unknown=d.fake_calls("nope"))
        d.fn("fakecuda_reset_counts")()
        emit(allocs=d.fake_calls("cuMemAlloc_v2"))
        """,
        fake_env(devices="1G"),
    )
    assert r.records == [{"allocs": 2, "frees": 0, "unknown": 0}, {"allocs": 0}]


@pytest.mark.parametrize("spec", ["16Q", "G", "1G,,x", "99999999999999999999", "1G;2G"])
def test_malformed_device_spec_fails_init_with_one_line(run_py, fake_env, spec):
    r = run_py("emit(rc=Driver().fn('cuInit')(0))", fake_env(devices=spec))
    assert r.one == {"rc": 1}
    assert f"FAKE_CUDA_DEVICES={spec} is malformed" in r.stderr


def test_concurrent_allocations_never_overbook_and_balance_to_zero(run_py, fake_env):
    """16 threads race for a 64 MiB device with random sizes; the fake must never hand out more
    than it has, and every byte comes back."""
    r = run_py(
        """
        import random, threading
        d = Driver(); d.call("cuInit", 0)
        ctx = c_void_p(); d.call("cuDevicePrimaryCtxRetain", byref(ctx), 0)
        peak, errors, lock = [0], [], threading.Lock()
        def work(seed):
            d.call("cuCtxSetCurrent", ctx)
            rng, held = random.Random(seed), []
            for _ in range(400):
                if held and rng.random() < 0.5:
                    d.free(held.pop(rng.randrange(len(held))))
                else:
                    got = attempt(d.alloc, rng.randint(1, 8 << 20))
                    if isinstance(got, dict):
                        if got["error"] != 2: errors.append(got)
                    else:
                        held.append(got)
                used = d.fake_used(0)
                with lock: peak[0] = max(peak[0], used)
            for p in held: d.free(p)
        ts = [threading.Thread(target=work, args=(i,)) for i in range(16)]
        [t.start() for t in ts]; [t.join() for t in ts]
        emit(peak=peak[0], used=d.fake_used(0), errors=errors)
        """,
        fake_env(devices="64M"),
    )
    out = r.one
    assert out["errors"] == []
    assert 0 < out["peak"] <= 64 * M
    assert out["used"] == 0


def test_build_fakes_builds_every_fake_the_makefile_lists(tmp_path):
    from tests.fakes import FAKES_DIR, build_fakes

    out = build_fakes(tmp_path / "fakes")
    assert (out / "libcuda.so.1").is_file() and (out / "libcuda.so").resolve() == (out / "libcuda.so.1").resolve()
    if (FAKES_DIR / "nvml.mk").exists():
        assert (out / "libnvidia-ml.so.1").is_file()


def test_streams_pools_pitch_and_managed_are_booked_on_the_right_device(run_py, fake_env):
    r = run_py(
        """
        d = Driver(); d.init(1)
        s1 = d.stream_create()                      # a stream of device 1
        d.set_device(0)
        a = d.alloc_async(1 << 20, s1)              # stream's device, not the current one
        b = d.alloc_async(2 << 20, 0, ptsz=True)    # NULL stream: current context (device 0)
        pool1 = d.pool_create(1)
        c = d.alloc_from_pool(4 << 20, pool1)       # pool's device
        e = d.alloc_from_pool(8 << 20, d.default_pool(0), ptsz=True)
        p, pitch = d.alloc_pitch(1000, 3)
        m = d.alloc_managed(16 << 20)
        emit(used=[d.fake_used(0), d.fake_used(1)], pitch=pitch, bad_elem=attempt(d.alloc_pitch, 1000, 3, 3))
        for x in (a, c):
            d.free_async(x, s1)
        d.free_async(b, ptsz=True); d.free(e); d.free(p); d.free(m)
        emit(used=[d.fake_used(0), d.fake_used(1)])
        """,
        fake_env(devices="1G,1G"),
    )
    first, after = r.records
    assert first["pitch"] == 1024
    assert first["used"] == [2 * M + 8 * M + 1024 * 3 + 16 * M, M + 4 * M]
    assert first["bad_elem"] == {"error": 1}
    assert after["used"] == [0, 0]
