"""The shim caps and reports on all three ways a program reaches the driver: symbols bound
at link time, dlopen + dlsym, and cuGetProcAddress / cuGetProcAddress_v2."""

from __future__ import annotations

import pytest

from tests.shim.conftest import G, M, ShimEnv

MODES = ["link", "dlsym", "gpa", "gpa2"]


@pytest.mark.parametrize("mode", MODES)
def test_over_cap_is_refused_before_the_driver_and_free_gives_it_back(shim: ShimEnv, mode: str) -> None:
    r = shim.run(
        mode,
        [
            "init",
            "ctx",
            0,
            "alloc",
            768 * M,
            "used",
            0,
            "calls",
            "cuMemAlloc_v2",
            "alloc",
            512 * M,
            "used",
            0,
            "calls",
            "cuMemAlloc_v2",
            "free",
            "used",
            0,
            "alloc",
            512 * M,
        ],
        limit="0=1G",
    )
    assert r.rcs("alloc") == [0, 2, 0]
    used = [line["bytes"] for line in r.of("used")]
    calls = [line["n"] for line in r.of("calls")]
    assert used == [768 * M, 768 * M, 0]  # the refused request never reached the fake driver
    assert calls == [1, 1]
    assert r.rcs("free") == [0]
    assert len(r.stderr_lines) == 1
    line = r.stderr_lines[0]
    for text in ("device 0", f"cap {G}", f"in use {768 * M}", f"requested {512 * M}", "cuMemAlloc_v2"):
        assert text in line


@pytest.mark.parametrize("mode", MODES)
def test_memory_queries_report_the_cap_and_usage(shim: ShimEnv, mode: str) -> None:
    r = shim.run(
        mode,
        ["init", "ctx", 0, "info", "alloc", 256 * M, "info", "total", 0, "total", 1, "ctx", 1, "info", "alloc", 6 * G],
        limit="0=1G",
    )
    info = r.of("info")
    assert (info[0]["total"], info[0]["free"]) == (G, G)
    assert (info[1]["total"], info[1]["free"]) == (G, 768 * M)
    assert [line["total"] for line in r.of("total")] == [G, 8 * G]
    assert (info[2]["total"], info[2]["free"]) == (8 * G, 8 * G)  # device 1 is not capped
    assert r.rcs("alloc") == [0, 0]


KINDS = {
    # command, its arguments for a size, the exported function that must not be reached
    "alloc": (lambda n: ["alloc", n], "cuMemAlloc_v2"),
    "managed": (lambda n: ["managed", n], "cuMemAllocManaged"),
    "async": (lambda n: ["async", n], "cuMemAllocAsync"),
    "pool": (lambda n: ["pool", n], "cuMemAllocFromPoolAsync"),
    "create": (lambda n: ["create", 0, n], "cuMemCreate"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_allocation_kind_is_capped_and_uncharged_by_its_free(shim: ShimEnv, mode: str, kind: str) -> None:
    make, fn = KINDS[kind]
    r = shim.run(
        mode,
        [
            "init",
            "ctx",
            0,
            *make(768 * M),
            "used",
            0,
            "calls",
            fn,
            *make(512 * M),
            "used",
            0,
            "calls",
            fn,
            "free",
            "used",
            0,
            *make(G),
        ],
        limit="0=1G",
    )
    assert r.rcs(kind) == [0, 2, 0]
    assert [line["bytes"] for line in r.of("used")] == [768 * M, 768 * M, 0]
    assert [line["n"] for line in r.of("calls")] == [1, 1]
    assert r.rcs("free") == [0]


def test_cuMemCreate_charges_the_device_named_in_its_properties(shim: ShimEnv) -> None:
    # the current context is device 1 (uncapped); the allocation is on capped device 0
    r = shim.run("gpa2", ["init", "ctx", 1, "create", 0, 2 * G, "create", 1, 4 * G, "create", 0, 512 * M], limit="0=1G")
    assert r.rcs("create") == [2, 0, 0]


def test_pitch_is_charged_as_pitch_times_height(shim: ShimEnv) -> None:
    # The fake rounds the pitch of a 1000-byte row up to 1024. 512Ki rows: 500 MiB asked,
    # 512 MiB handed out; with 512 MiB charged, another 512 MiB + 1 byte is over a 1 GiB cap.
    r = shim.run(
        "gpa2",
        ["init", "ctx", 0, "pitch", 1000, 512 * 1024, "used", 0, "alloc", 512 * M + 1, "alloc", 512 * M],
        limit="0=1G",
    )
    assert r.of("pitch")[0]["pitch"] == 1024
    assert r.of("used")[0]["bytes"] == 512 * M
    assert r.rcs("alloc") == [2, 0]


def test_pitch_past_the_cap_only_after_rounding_is_given_back(shim: ShimEnv) -> None:
    rows = 1024 * 1024 + 1  # 1000 * rows < 1 GiB, 1024 * rows > 1 GiB
    r = shim.run("gpa2", ["init", "ctx", 0, "pitch", 1000, rows, "used", 0, "usage", 0], limit="0=1G")
    assert r.rcs("pitch") == [2]
    assert r.of("used")[0]["bytes"] == 0  # the driver's allocation was freed again
    assert r.of("usage")[0]["used"] == 0


@pytest.mark.parametrize("mode", ["link", "dlsym", "gpa", "gpa2"])
def test_2000_era_abi_is_capped_with_its_32_bit_signatures(shim: ShimEnv, mode: str) -> None:
    r = shim.run(
        mode,
        [
            "init",
            "ctx",
            0,
            "where",
            "cuMemAlloc",
            "alloc",
            768 * M,
            "alloc",
            512 * M,
            "info",
            "total",
            0,
            "free",
            "used",
            0,
        ],
        limit="0=1G",
        version=2000,
    )
    where = r.of("where")[0]
    assert (where["file"], where["sym"]) == ("libmpsshim.so", "cuMemAlloc")
    assert r.rcs("alloc") == [0, 2]
    assert (r.of("info")[0]["total"], r.of("info")[0]["free"]) == (G, 256 * M)
    assert r.of("total")[0]["total"] == G
    assert r.rcs("free") == [0]
    assert r.of("used")[0]["bytes"] == 0


@pytest.mark.parametrize("mode", ["gpa", "gpa2"])
def test_per_thread_stream_variants_get_their_own_hooks(shim: ShimEnv, mode: str) -> None:
    r = shim.run(
        mode,
        [
            "init",
            "ctx",
            0,
            "where",
            "cuMemAllocAsync",
            "async",
            768 * M,
            "async",
            512 * M,
            "calls",
            "cuMemAllocAsync_ptsz",
            "calls",
            "cuMemAllocAsync",
            "free",
            "calls",
            "cuMemFreeAsync_ptsz",
            "used",
            0,
        ],
        limit="0=1G",
        flags=2,
    )
    where = r.of("where")[0]
    assert (where["file"], where["sym"]) == ("libmpsshim.so", "cuMemAllocAsync_ptsz")
    assert r.rcs("async") == [0, 2]
    assert [line["n"] for line in r.of("calls")] == [1, 0, 1]
    assert r.of("used")[0]["bytes"] == 0


# The variant the driver picks for (base, version, per-thread stream), from the fake's table.
VARIANTS = {
    "cuInit": [(2000, False, "cuInit")],
    "cuMemAlloc": [(2000, False, "cuMemAlloc"), (3020, False, "cuMemAlloc_v2")],
    "cuMemFree": [(2000, False, "cuMemFree"), (3020, False, "cuMemFree_v2")],
    "cuMemGetInfo": [(2000, False, "cuMemGetInfo"), (3020, False, "cuMemGetInfo_v2")],
    "cuDeviceTotalMem": [(2000, False, "cuDeviceTotalMem"), (3020, False, "cuDeviceTotalMem_v2")],
    "cuMemAllocPitch": [(3020, False, "cuMemAllocPitch_v2")],
    "cuMemAllocManaged": [(6000, False, "cuMemAllocManaged")],
    "cuMemAllocAsync": [(11020, False, "cuMemAllocAsync"), (11020, True, "cuMemAllocAsync_ptsz")],
    "cuMemAllocFromPoolAsync": [
        (11020, False, "cuMemAllocFromPoolAsync"),
        (11020, True, "cuMemAllocFromPoolAsync_ptsz"),
    ],
    "cuMemFreeAsync": [(11020, False, "cuMemFreeAsync"), (11020, True, "cuMemFreeAsync_ptsz")],
    "cuMemCreate": [(10020, False, "cuMemCreate")],
    "cuMemRelease": [(10020, False, "cuMemRelease")],
    "cuMemMap": [(10020, False, "cuMemMap")],
    "cuMemUnmap": [(10020, False, "cuMemUnmap")],
    "cuMemRetainAllocationHandle": [(11000, False, "cuMemRetainAllocationHandle")],
    "cuLaunchKernel": [(4000, False, "cuLaunchKernel"), (7000, True, "cuLaunchKernel_ptsz")],
    "cuDevicePrimaryCtxRetain": [(7000, False, "cuDevicePrimaryCtxRetain")],
}
HOOKED = {
    "cuInit",
    "cuMemAlloc",
    "cuMemAlloc_v2",
    "cuMemFree",
    "cuMemFree_v2",
    "cuMemGetInfo",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem",
    "cuDeviceTotalMem_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemRetainAllocationHandle",
}


def expected_variant(base: str, version: int, flags: int) -> str | None:
    best: dict[bool, tuple[int, str]] = {}
    for ver, ptsz, name in VARIANTS[base]:
        if ver <= version and (ptsz not in best or ver > best[ptsz][0]):
            best[ptsz] = (ver, name)
    if flags & 2 and True in best:
        return best[True][1]
    return best[False][1] if False in best else None


@pytest.mark.parametrize("mode", ["gpa", "gpa2"])
@pytest.mark.parametrize("version", [2000, 3020, 11020, 12000])
@pytest.mark.parametrize("flags", [0, 1, 2])
def test_cuGetProcAddress_hands_out_the_hook_of_exactly_the_variant_asked_for(
    shim: ShimEnv, mode: str, version: int, flags: int
) -> None:
    cmds: list[object] = []
    for base in VARIANTS:
        cmds += ["where", base]
    r = shim.run(mode, cmds, limit="0=1G", version=version, flags=flags)
    assert r.returncode == 0, r.stderr
    got = {line["base"]: line for line in r.of("where")}
    for base in VARIANTS:
        want = expected_variant(base, version, flags)
        line = got[base]
        if want is None:
            assert line["rc"] == "nosym", (base, line)
            continue
        file = "libmpsshim.so" if want in HOOKED else "libcuda.so.1"
        assert (line["file"], line["sym"], line["exact"]) == (file, want, 1), (base, version, flags)


@pytest.mark.parametrize("mode", MODES)
def test_cuLaunchKernel_is_the_drivers_own_pointer(shim: ShimEnv, mode: str) -> None:
    r = shim.run(mode, ["where", "cuLaunchKernel"], limit="0=1G")
    line = r.of("where")[0]
    assert (line["file"], line["sym"], line["exact"]) == ("libcuda.so.1", "cuLaunchKernel", 1)


@pytest.mark.parametrize(
    ("mode", "version", "want"),
    [("gpa", 11030, "cuGetProcAddress"), ("gpa2", 12000, "cuGetProcAddress_v2"), ("gpa", 12000, "cuGetProcAddress_v2")],
)
def test_asking_cuGetProcAddress_for_itself_returns_the_wrapper(
    shim: ShimEnv, mode: str, version: int, want: str
) -> None:
    r = shim.run(mode, ["where", "cuGetProcAddress"], version=version)
    line = r.of("where")[0]
    assert (line["file"], line["sym"]) == ("libmpsshim.so", want)


def test_without_a_current_context_a_capped_process_refuses_with_the_context_error(shim: ShimEnv) -> None:
    capped = shim.run("gpa2", ["init", "alloc", M, "calls", "cuMemAlloc_v2"], limit="0=1G")
    assert capped.rcs("alloc") == [201]  # CUDA_ERROR_INVALID_CONTEXT, as the driver would say
    assert capped.of("calls")[0]["n"] == 0
    uncapped = shim.run("gpa2", ["init", "alloc", M, "calls", "cuMemAlloc_v2"], limit=None)
    assert uncapped.rcs("alloc") == [201]
    assert uncapped.of("calls")[0]["n"] == 1  # no caps: forwarded untouched


def test_limit_by_uuid_caps_only_that_device(shim: ShimEnv) -> None:
    r = shim.run(
        "gpa2",
        ["init", "ctx", 0, "alloc", 2 * G, "ctx", 1, "alloc", 2 * G, "total", 0, "total", 1],
        limit="GPU-face0000-0000-0000-0000-000000000001=1G",
    )
    assert r.rcs("alloc") == [0, 2]
    assert [line["total"] for line in r.of("total")] == [16 * G, G]


def test_driver_failure_rolls_the_charge_back(shim: ShimEnv) -> None:
    # cap 12G on an 8G device: the fake refuses 6G after 4G, and the shim must not keep it
    r = shim.run(
        "gpa2", ["init", "ctx", 1, "alloc", 4 * G, "alloc", 6 * G, "calls", "cuMemAlloc_v2", "usage", 1], limit="1=12G"
    )
    assert r.rcs("alloc") == [0, 2]
    assert r.of("calls")[0]["n"] == 2  # this refusal came from the driver
    assert r.of("usage")[0] == {"cmd": "usage", "rc": 0, "used": 4 * G, "cap": 12 * G}
    assert r.stderr_lines == []  # the shim did not refuse anything


def test_free_of_an_uncharged_pointer_is_forwarded_without_uncharging(shim: ShimEnv) -> None:
    r = shim.run(
        "gpa2",
        [
            "init",
            "ctx",
            0,
            "alloc",
            256 * M,
            "ctx",
            1,
            "alloc",
            G,
            "free",
            "calls",
            "cuMemFree_v2",
            "usage",
            0,
            "usage",
            1,
        ],
        limit="0=1G",
    )
    assert r.rcs("free") == [0]
    assert r.of("calls")[0]["n"] == 1
    assert [line["used"] for line in r.of("usage")] == [256 * M, 0]


def test_the_cap_is_shared_by_the_processes_of_one_region(shim: ShimEnv) -> None:
    import subprocess

    env = shim.env("0=1G")
    with subprocess.Popen(
        shim.argv("gpa2", ["init", "ctx", 0, "alloc", 768 * M, "pause", "free"]),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as first:
        assert first.stdout is not None and first.stdin is not None
        seen = [first.stdout.readline().strip() for _ in range(4)]
        assert seen[2:] == ["alloc rc=0", "pause rc=0"]
        second = shim.run("gpa2", ["init", "ctx", 0, "alloc", 512 * M, "info", "alloc", 256 * M], limit="0=1G")
        assert second.rcs("alloc") == [2, 0]
        assert second.of("info")[0]["free"] == 256 * M
        first.stdin.write("go\n")
        first.stdin.flush()
        assert first.wait(timeout=30) == 0


def test_the_fake_as_its_makefile_builds_it_is_capped_too(shim: ShimEnv, plain_fake_dir) -> None:
    shim.fake = plain_fake_dir
    r = shim.run("gpa2", ["init", "ctx", 0, "alloc", 768 * M, "alloc", 512 * M, "calls", "cuMemAlloc_v2"], limit="0=1G")
    assert r.rcs("alloc") == [0, 2]
    assert r.of("calls")[0]["n"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_threads_racing_for_the_cap_never_pass_it_and_leave_nothing_charged(shim: ShimEnv, mode: str) -> None:
    # 8 threads each wanting 256 MiB under a 1 GiB cap: at most 4 can hold memory at a time
    r = shim.run(
        mode,
        ["init", "ctx", 0, "hammer", 8, 2000, 256 * M, G, "used", 0, "usage", 0, "info"],
        limit="0=1G",
        extra={"MPSSHIM_LOG": "0"},
    )
    h = r.of("hammer")[0]
    assert (h["over"], h["errors"]) == (0, 0)
    assert h["ok"] + h["refused"] == 8 * 2000 and h["ok"] > 0
    assert r.of("used")[0]["bytes"] == 0
    assert r.of("usage")[0]["used"] == 0
    assert r.of("info")[0]["free"] == G


def test_usage_above_a_smaller_cap_reports_zero_free_without_wrapping(shim: ShimEnv) -> None:
    import subprocess

    # two processes of one region with different caps: the first uses 1.5 GiB under 2 GiB
    with subprocess.Popen(
        shim.argv("gpa2", ["init", "ctx", 0, "alloc", 1536 * M, "pause"]),
        env=shim.env("0=2G"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as first:
        assert first.stdout is not None and first.stdin is not None
        assert [first.stdout.readline().strip() for _ in range(4)][2:] == ["alloc rc=0", "pause rc=0"]
        second = shim.run("gpa2", ["init", "ctx", 0, "info", "alloc", M, "nvmem", 0], limit="0=1G")
        info = second.of("info")[0]
        assert (info["total"], info["free"]) == (G, 0)
        assert second.rcs("alloc") == [2]
        nv = second.of("nvmem")[0]
        assert (nv["total"], nv["used"], nv["free"]) == (G, G, 0)
        first.stdin.write("go\n")
        first.stdin.flush()
        assert first.wait(timeout=30) == 0


def test_cuGetProcAddress_never_makes_the_loader_search_for_nvml(shim: ShimEnv) -> None:
    # The runtime asks for every driver entry point at start-up (thousands of queries with
    # cuBLAS, cuDNN and NCCL each carrying a runtime). Telling whether an answer is hooked must
    # not look for libnvidia-ml, which this process never loads: a file system search per query.
    cmds: list[object] = []
    for base in ("cuLaunchKernel", "cuMemAlloc", "cuMemCreate", "cuDevicePrimaryCtxRetain"):
        cmds += ["where", base]
    r = shim.run("gpa2", cmds, limit="0=1G", extra={"LD_DEBUG": "libs"})
    assert r.returncode == 0, r.stderr
    files = [line["file"] for line in r.of("where")]
    assert files == ["libcuda.so.1", "libmpsshim.so", "libmpsshim.so", "libcuda.so.1"]
    assert "libnvidia-ml" not in r.stderr


# --- where the region is (issue 7): a relative MPSSHIM_REGION, and the per-UID default in a /tmp
# that other local users can write ---


def _run_env(shim: ShimEnv, env: dict[str, str], cmds: list[object], wrap: list[str] | None = None, cwd=None):
    import subprocess

    from tests.shim.conftest import Result, parse_line, shim_lines

    proc = subprocess.run(
        [*(wrap or []), *shim.argv("gpa2", cmds)], env=env, capture_output=True, text=True, timeout=60, cwd=cwd,
        check=False,
    )
    return Result([parse_line(t) for t in proc.stdout.splitlines() if t.strip()], proc.stderr, proc.returncode,
                  shim_lines(proc.stderr))


def test_a_relative_region_path_fails_cuda_init_and_every_allocation_with_one_line(shim: ShimEnv, tmp_path) -> None:
    """Each working directory would get a region, so a cap, of its own."""
    cmds: list[object] = ["init", "ctx", 0, "alloc", M, "ctx", 1, "alloc", M, "calls", "cuMemAlloc_v2"]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = _run_env(shim, shim.env("0=1G", {"MPSSHIM_REGION": "slice/region"}), cmds, cwd=cwd)
    assert r.rcs("init") == [1]  # CUDA_ERROR_INVALID_VALUE, as for a malformed limit
    assert r.rcs("alloc") == [2, 2]
    assert r.of("calls")[0]["n"] == 0
    assert len(r.stderr_lines) == 1, r.stderr
    assert 'MPSSHIM_REGION="slice/region"' in r.stderr_lines[0] and "absolute" in r.stderr_lines[0]
    assert list(cwd.iterdir()) == []


UNSHARE_TMP = """set -e
mount --bind /tmp "$PRIVATE_TMP/old"
mount --rbind "$PRIVATE_TMP" /tmp
exec "$@"
"""


def _with_private_tmp(shim: ShimEnv, tmp_path, plant) -> tuple[object, object]:
    """Runs a capped client without MPSSHIM_REGION in a mount namespace whose /tmp is a fresh
    directory, after `plant(path)` put something at the default region path there. Needs root."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /tmp needs root and unshare(1)")
    private = tmp_path / "private-tmp"
    (private / "old").mkdir(parents=True)
    for top in {p.relative_to("/tmp").parts[0] for p in (shim.shim, shim.fake, shim.clients["gpa2"]) if
                str(p).startswith("/tmp/")}:
        (private / top).symlink_to(f"old/{top}")  # the test's own files, through the real /tmp
    default = private / f"mpsshim-{os.getuid()}.region"
    plant(default)
    env = shim.env("0=1G")
    del env["MPSSHIM_REGION"]
    env["PRIVATE_TMP"] = str(private)
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", UNSHARE_TMP, "sh"]
    probe = subprocess.run([*wrap, "true"], env=env, capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private /tmp here: {probe.stderr.strip()}")
    cmds: list[object] = ["init", "ctx", 0, "alloc", M, "alloc", G, "ctx", 1, "alloc", M, "usage", 0]
    return _run_env(shim, env, cmds, wrap=wrap), default


def test_the_default_region_is_made_and_used_when_missing(shim: ShimEnv, tmp_path) -> None:
    r, default = _with_private_tmp(shim, tmp_path, lambda path: None)
    assert r.returncode == 0, r.stderr
    assert r.rcs("alloc") == [0, 2, 0]  # capped: 1 MiB fits, 1 GiB more does not
    assert r.of("usage")[0] == {"cmd": "usage", "rc": 0, "used": M, "cap": G}  # mpsshim_usage(NULL): the same file
    assert default.stat().st_uid == __import__("os").getuid()


@pytest.mark.parametrize("what", ["another user's file", "symlink", "fifo", "directory"])
def test_a_default_region_planted_by_someone_else_is_refused_with_one_line(shim: ShimEnv, tmp_path, what: str) -> None:
    """Another local user can create /tmp/mpsshim-<uid>.region first: the victim must neither
    hang (a FIFO, a poisoned file) nor run uncapped; it refuses capped allocations, in one line."""
    import os
    import time

    target = tmp_path / "host-file"
    target.write_bytes(b"host data")

    def plant(path) -> None:
        if what == "another user's file":  # a real region of this shim's layout, owned by someone else
            made = shim.run("gpa2", ["init", "ctx", 0, "alloc", M], limit="0=1G", extra={"MPSSHIM_REGION": str(path)})
            assert made.rcs("alloc") == [0]
            os.chown(path, 4242, 4242)
        elif what == "symlink":
            path.symlink_to(target)
        elif what == "fifo":
            os.mkfifo(path, 0o666)
        else:
            path.mkdir()

    t0 = time.monotonic()
    r, default = _with_private_tmp(shim, tmp_path, plant)
    assert time.monotonic() - t0 < 30
    assert r.rcs("alloc") == [2, 2, 0]  # capped device refused, never uncapped; device 1 is not capped
    assert r.rcs("usage") == [-1]  # a tool reading the default region refuses it too
    assert len(r.stderr_lines) == 1, r.stderr
    assert str(default.name) in r.stderr_lines[0]
    assert {"another user's file": "uid 4242", "symlink": "symbolic link", "fifo": "not a regular file",
            "directory": "Is a directory"}[what] in r.stderr_lines[0]
    assert target.read_bytes() == b"host data"


def test_a_co_tenant_stopped_in_a_tight_alloc_free_loop_never_blocks_another_client(shim: ShimEnv) -> None:
    """Four threads of one client allocate and free 4 KiB through the shim as fast as they can;
    it is SIGSTOPped at random moments, twenty times. Every time, another client of the same
    region initialises, allocates and frees at once (no cross-process lock on the way)."""
    import os
    import random
    import signal
    import subprocess
    import time

    env = shim.env("0=1G", {"MPSSHIM_LOG": "0"})
    loop = subprocess.Popen(shim.argv("gpa2", ["init", "ctx", 0, "hammer", 4, 10**12, 4096, G]), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = random.Random(11)
    try:
        time.sleep(0.2)
        for _ in range(20):
            time.sleep(rng.uniform(0.001, 0.03))
            os.kill(loop.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                other = subprocess.run(shim.argv("gpa2", ["init", "ctx", 0, "alloc", M, "free", "alloc", M]), env=env,
                                       capture_output=True, text=True, timeout=20, check=False)
                assert other.returncode == 0 and "alloc rc=0" in other.stdout, other.stdout + other.stderr
                assert time.monotonic() - t0 < 10
            finally:
                os.kill(loop.pid, signal.SIGCONT)
            assert loop.poll() is None
    finally:
        loop.kill()
        loop.wait()
    after = shim.run("gpa2", ["init", "ctx", 0, "info"], limit="0=1G")
    assert after.of("info")[0]["free"] == G  # the killed looper's charges came back
