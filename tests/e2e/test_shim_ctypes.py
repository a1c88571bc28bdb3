"""The real shim (LD_PRELOAD=libmpsshim.so) in front of the fake driver, driven by a Python
ctypes client that loads the driver as CuPy and numba do (dlopen "libcuda.so.1" + dlsym of
"_v2" names on that handle), plus cuGetProcAddress from Python."""
from __future__ import annotations

import pytest

G = 1 << 30
M = 1 << 20
UUID1 = "GPU-face0000-0000-0000-0000-000000000001"


def test_cap_refuses_past_the_cap_without_reaching_the_driver(run_py, shim_env):
    r = run_py(
        """
        d = Driver(); d.init()
        a = d.alloc(768 << 20)
        emit(refused=attempt(d.alloc, 512 << 20), used=d.fake_used(0), driver_allocs=d.fake_calls("cuMemAlloc_v2"))
        emit(fits=attempt(d.alloc, 256 << 20) > 0, used=d.fake_used(0))
        """,
        shim_env(limit="0=1G"),
    )
    refused, fits = r.records
    assert refused == {"refused": {"error": 2}, "used": 768 * M, "driver_allocs": 1}
    assert fits == {"fits": True, "used": G}
    assert f"device 0 cap {G} bytes, in use {768 * M}, requested {512 * M}" in r.stderr


def test_free_gives_the_cap_back_and_usage_shows_it(run_py, shim_env, shim_lib, tmp_path):
    region = tmp_path / "region"
    r = run_py(
        f"""
        import shim
        def used():
            return [(u.device, u.cap, u.used) for u in shim.usage({str(region)!r}, library={str(shim_lib)!r})]
        d = Driver(); d.init()
        p = d.alloc(1 << 30)
        emit(full=used(), refused=attempt(d.alloc, 1))
        d.free(p)
        emit(after_free=used(), realloc=attempt(d.alloc, 1 << 30) > 0, fake=d.fake_used(0))
        """,
        shim_env(limit="0=1G", region=region),
    )
    full, after = r.records
    assert full == {"full": [[0, G, G]], "refused": {"error": 2}}
    assert after == {"after_free": [[0, G, 0]], "realloc": True, "fake": G}


def test_memory_queries_report_the_cap_and_the_container_wide_free(run_py, shim_env):
    r = run_py(
        """
        d = Driver(); d.init()
        before = d.mem_info()
        d.alloc(100 << 20)
        emit(before=before, after=d.mem_info(), total=d.total_mem(0))
        """,
        shim_env(limit="0=1G", devices="16G"),
    )
    assert r.one == {"before": [G, G], "after": [G - 100 * M, G], "total": G}


def test_a_cap_above_the_physical_memory_reports_the_physical_memory(run_py, shim_env):
    r = run_py("d = Driver(); d.init(); emit(info=d.mem_info(), total=d.total_mem(0))", shim_env(limit="0=64G", devices="2G"))
    assert r.one == {"info": [2 * G, 2 * G], "total": 2 * G}


@pytest.mark.parametrize("limit", ["0=512M", "GPU-face0000-0000-0000-0000-000000000000=512M"])
def test_uncapped_device_is_untouched(run_py, shim_env, limit):
    r = run_py(
        """
        d = Driver(); d.init(1)
        big = attempt(d.alloc, 3 << 30) > 0
        emit(big=big, info=d.mem_info(), total=d.total_mem(1), capped_total=d.total_mem(0), used=d.fake_used(1))
        d.set_device(0)
        emit(capped=attempt(d.alloc, 513 << 20), info0=d.mem_info())
        """,
        shim_env(limit=limit, devices="1G,4G"),
    )
    uncapped, capped = r.records
    assert uncapped == {"big": True, "info": [G, 4 * G], "total": 4 * G, "capped_total": 512 * M, "used": 3 * G}
    assert capped == {"capped": {"error": 2}, "info0": [512 * M, 512 * M]}


def test_cap_by_uuid_applies_to_that_device_only(run_py, shim_env):
    r = run_py(
        """
        d = Driver(); d.init(1)
        emit(dev1=attempt(d.alloc, 300 << 20), total1=d.total_mem(1), total0=d.total_mem(0))
        """,
        shim_env(limit=f"{UUID1}=256M", devices="1G,1G"),
    )
    assert r.one == {"dev1": {"error": 2}, "total1": 256 * M, "total0": G}


def test_cu_get_proc_address_hands_out_capped_functions(run_py, shim_env):
    r = run_py(
        """
        import ctypes, os
        d = Driver(); d.init()
        ptr, status = d.proc_address("cuMemAlloc", 3020)
        alloc = ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_ulonglong), ctypes.c_size_t)(ptr)
        p = c_ulonglong()
        emit(status=status, lib=os.path.basename(d.library_of(ptr)),
             small=alloc(byref(p), 64 << 20), big=alloc(byref(p), 200 << 20), used=d.fake_used(0))
        launch, _ = d.proc_address("cuLaunchKernel", 4000)
        emit(launch=os.path.basename(d.library_of(launch)))
        """,
        shim_env(limit="0=256M"),
    )
    assert r.records == [
        {"status": 0, "lib": "libmpsshim.so", "small": 0, "big": 2, "used": 64 * M},
        {"launch": "libcuda.so.1"},  # launches are not hooked: the driver's own pointer
    ]


def test_mem_create_is_charged_and_release_gives_it_back(run_py, shim_env):
    r = run_py(
        """
        d = Driver(); d.init()
        h = d.mem_create(200 << 20, 0)
        emit(over=attempt(d.mem_create, 100 << 20, 0), used=d.fake_used(0))
        d.mem_release(h)
        emit(again=attempt(d.mem_create, 256 << 20, 0) > 0)
        """,
        shim_env(limit="0=256M"),
    )
    assert r.records == [{"over": {"error": 2}, "used": 200 * M}, {"again": True}]


def test_v1_allocations_are_capped_with_their_32_bit_abi(run_py, shim_env):
    r = run_py(
        """
        d = Driver(); d.init()
        p = c_uint()
        ok = d.fn("cuMemAlloc")(byref(p), c_uint(200 << 20))
        over = d.fn("cuMemAlloc")(byref(c_uint()), c_uint(100 << 20))
        emit(ok=ok, ptr32=0 < p.value < (1 << 32), over=over, used=d.fake_used(0))
        emit(free=d.fn("cuMemFree")(p), used=d.fake_used(0), again=d.fn("cuMemAlloc")(byref(p), c_uint(256 << 20)))
        """,
        shim_env(limit="0=256M"),
    )
    assert r.records == [{"ok": 0, "ptr32": True, "over": 2, "used": 200 * M}, {"free": 0, "used": 0, "again": 0}]


def test_disable_passes_everything_through(run_py, shim_env):
    r = run_py(
        "d = Driver(); d.init(); emit(big=attempt(d.alloc, 2 << 30) > 0, info=d.mem_info())",
        shim_env(limit="0=1G", devices="4G", MPSSHIM_DISABLE="1"),
    )
    assert r.one == {"big": True, "info": [2 * G, 4 * G]}


def test_no_limit_means_no_cap(run_py, shim_env):
    r = run_py("d = Driver(); d.init(); emit(big=attempt(d.alloc, 3 << 30) > 0, info=d.mem_info())", shim_env(devices="4G"))
    assert r.one == {"big": True, "info": [G, 4 * G]}


@pytest.mark.parametrize("bad", ["0=4Q", "0=1G,0=2G", "0=99999999999T", "x=1G", "0=1G "])
def test_malformed_limit_fails_init_and_refuses_with_one_line(run_py, shim_env, bad):
    r = run_py(
        """
        d = Driver()
        emit(init=d.fn("cuInit")(0), alloc=attempt(d.alloc, 1))
        """,
        shim_env(limit=bad),
    )
    assert r.one["init"] == 1
    assert r.one["alloc"]["error"] != 0
    lines = [line for line in r.stderr.splitlines() if "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in line]
    assert len(lines) == 1 and f'"{bad}" is malformed' in lines[0]


def test_corrupted_region_refuses_with_a_clear_line(run_py, shim_env, tmp_path):
    region = tmp_path / "region"
    region.write_bytes(b"\x00garbage" * 4096)
    r = run_py("d = Driver(); d.init(); emit(alloc=attempt(d.alloc, 1 << 20), used=d.fake_used(0))", shim_env(limit="0=1G", region=region))
    assert r.one == {"alloc": {"error": 2}, "used": 0}
    assert f'accounting region "{region}" is unusable' in r.stderr


@pytest.mark.parametrize(
    ("alloc", "free"),
    [
        ("d.alloc_async(n)", "d.free_async(p)"),
        ("d.alloc_async(n, ptsz=True)", "d.free_async(p, ptsz=True)"),
        ("d.alloc_from_pool(n, d.default_pool(0))", "d.free_async(p)"),
        ("d.alloc_from_pool(n, d.pool_create(0), ptsz=True)", "d.free(p)"),
        ("d.alloc_managed(n)", "d.free(p)"),
        ("d.alloc_pitch(n // 1024, 1024)[0]", "d.free(p)"),
    ],
)
def test_every_allocation_kind_is_capped_and_given_back(run_py, shim_env, alloc, free):
    r = run_py(
        f"""
        d = Driver(); d.init()
        n = 48 << 20
        p = {alloc}
        emit(used=d.fake_used(0), free_info=d.mem_info()[0], over=attempt(lambda: {alloc}))
        {free}
        emit(used=d.fake_used(0), free_info=d.mem_info()[0])
        """,
        shim_env(limit="0=64M"),
    )
    held, after = r.records
    assert held == {"used": 48 * M, "free_info": 16 * M, "over": {"error": 2}}
    assert after == {"used": 0, "free_info": 64 * M}


def test_get_proc_address_per_thread_stream_variant_is_hooked_too(run_py, shim_env):
    r = run_py(
        """
        import ctypes, os
        d = Driver(); d.init()
        ptr, status = d.proc_address("cuMemAllocAsync", 12000, 2)
        f = ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_ulonglong), ctypes.c_size_t, c_void_p)(ptr)
        p = c_ulonglong()
        emit(status=status, lib=os.path.basename(d.library_of(ptr)), ok=f(byref(p), 48 << 20, None),
             over=f(byref(p), 48 << 20, None), calls=d.fake_calls("cuMemAllocAsync_ptsz"))
        """,
        shim_env(limit="0=64M"),
    )
    assert r.one == {"status": 0, "lib": "libmpsshim.so", "ok": 0, "over": 2, "calls": 1}


def test_memory_queries_give_back_what_a_killed_process_of_the_container_held(run_py, shim_env, holder_exe, tmp_path):
    # This process opened the region before the other one charged and died: the dead
    # process's charge must not keep shrinking the free memory it reports.
    region = tmp_path / "region"
    r = run_py(
        f"""
        import subprocess
        d = Driver(); d.init()
        d.alloc(1 << 20)
        h = subprocess.Popen([{str(holder_exe)!r}, {str(region)!r}, "0:{G}:{512 * M}"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert h.stdout.readline().strip() == "ready"
        emit(held=d.mem_info())
        h.kill(); h.wait()
        emit(killed=d.mem_info())
        """,
        shim_env(limit="0=1G", region=region),
    )
    assert r.records == [{"held": [G - 513 * M, G]}, {"killed": [G - M, G]}]


def test_a_region_named_in_mpsshim_region_is_created_for_every_uid_of_the_container(run_py, shim_env, tmp_path):
    """Processes of one container may run under several UIDs: the shared region is 0666 even
    under the usual umask 022 (the per-UID default region keeps the umask)."""
    region = tmp_path / "shared" / "region"
    region.parent.mkdir()
    run_py(
        """
        import os
        os.umask(0o022)
        d = Driver(); d.init()
        emit(ok=d.alloc(1 << 20) > 0)
        """,
        shim_env(limit="0=1G", region=region),
    )
    assert region.stat().st_mode & 0o777 == 0o666
