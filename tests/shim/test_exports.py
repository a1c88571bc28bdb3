"""libmpsshim.so loads into any process: an explicit export list, no Python symbols, nothing
unresolved under LD_BIND_NOW, no driver loaded into processes that do not use CUDA, and a
dlsym override that leaves other interposers and the driver's own lookups alone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.shim.conftest import CSRC, HERE, ShimEnv


def dynamic_symbols(lib: Path, *flags: str) -> list[str]:
    out = subprocess.run(["nm", "-D", *flags, str(lib)], capture_output=True, text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def export_list() -> set[str]:
    text = re.sub(r"/\*.*?\*/", "", (CSRC / "exports.map").read_text(), flags=re.S)
    glob = text.split("global:")[1].split("local:")[0]
    return {name.strip() for name in glob.split(";") if name.strip()}


def test_exports_are_exactly_the_export_list(shim_lib: Path) -> None:
    assert set(dynamic_symbols(shim_lib, "--defined-only")) == export_list()


def test_every_hook_in_the_table_is_exported() -> None:
    hooks = set(re.findall(r"^\s+H\((\w+),", (CSRC / "hooks.h").read_text(), flags=re.M))
    assert hooks and hooks <= export_list()


def test_no_python_symbol_and_only_libc_imports(shim_lib: Path) -> None:
    names = dynamic_symbols(shim_lib)
    assert not [n for n in names if n.startswith(("Py", "_Py"))]
    undefined = dynamic_symbols(shim_lib, "--undefined-only")
    strong = subprocess.run(
        ["nm", "-D", "--undefined-only", str(shim_lib)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for line in strong:
        kind, name = line.split()[-2:]
        assert kind == "w" or "@GLIBC_" in name, line
    assert undefined


def test_loads_into_a_plain_program_with_ld_bind_now(shim_lib: Path) -> None:
    proc = subprocess.run(
        ["/bin/true"],
        env={"LD_BIND_NOW": "1", "LD_PRELOAD": str(shim_lib)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_process_that_does_not_use_cuda_never_loads_the_driver(shim: ShimEnv) -> None:
    # even with a malformed limit, a region that cannot be opened and dlsym calls (python's ctypes)
    env = shim.env("0=junk", {"MPSSHIM_REGION": "/nonexistent/r.region"})
    code = "import ctypes; ctypes.CDLL('libc.so.6').getpid; print('libcuda' in open('/proc/self/maps').read())"
    proc = subprocess.run(["python3", "-c", code], env=env, capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "False", "")


@pytest.fixture(scope="module")
def extra_bins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dlsymtest")
    cc = ["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror"]
    subprocess.run(
        [*cc, "-fPIC", "-shared", "-o", str(out / "libwrapnext.so"), str(HERE / "wrapnext.c"), "-ldl"], check=True
    )
    (out / "driver").mkdir()
    subprocess.run(
        [
            *cc,
            "-fPIC",
            "-shared",
            "-Wl,-soname,libcuda.so.1",
            "-Wl,-Bsymbolic-functions",
            "-o",
            str(out / "driver" / "libcuda.so.1"),
            str(HERE / "selfdriver.c"),
            "-ldl",
        ],
        check=True,
    )
    subprocess.run([*cc, "-o", str(out / "selfmain"), str(HERE / "selfmain.c"), "-ldl"], check=True)
    (out / "hello.c").write_text('#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n')
    subprocess.run([*cc, "-fno-builtin", "-o", str(out / "hello"), str(out / "hello.c")], check=True)
    return out


@pytest.mark.parametrize("order", ["shim-first", "wrapper-first"])
def test_rtld_next_is_resolved_relative_to_the_caller(shim_lib: Path, extra_bins: Path, order: str) -> None:
    libs = [str(shim_lib), str(extra_bins / "libwrapnext.so")]
    if order == "wrapper-first":
        libs.reverse()
    proc = subprocess.run(
        [str(extra_bins / "hello")],
        env={"LD_PRELOAD": " ".join(libs)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (0, "wrapped:hello\n")


def test_the_drivers_own_lookups_are_not_redirected(shim_lib: Path, extra_bins: Path) -> None:
    env = {"LD_PRELOAD": str(shim_lib), "LD_LIBRARY_PATH": str(extra_bins / "driver")}
    proc = subprocess.run(
        [str(extra_bins / "selfmain")], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert (proc.returncode, proc.stdout) == (0, "driver_own=1 program_gets=libmpsshim.so\n"), proc.stderr


@pytest.fixture(scope="module")
def hidden_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hidden")
    cc = ["cc", "-std=gnu11", "-O0", "-Wall", "-Wextra", "-Werror"]
    (out / "driver").mkdir()
    subprocess.run(
        [
            *cc,
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out / "driver" / "libcuda.so.1"),
            str(HERE / "hiddendriver.c"),
        ],
        check=True,
    )
    subprocess.run([*cc, "-o", str(out / "hiddenmain"), str(HERE / "hiddenmain.c"), "-ldl"], check=True)
    return out


def run_hidden(
    shim_lib: Path,
    hidden: Path,
    version: int,
    tmp: Path,
    flags: int = 0,
    base: str = "cuMemAlloc",
    extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {
        "LD_PRELOAD": str(shim_lib),
        "LD_LIBRARY_PATH": str(hidden / "driver"),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G",
        "MPSSHIM_REGION": str(tmp / "r.region"),
        **(extra or {}),
    }
    argv = [str(hidden / "hiddenmain"), str(version), str(flags), base, str(768 << 20), str(512 << 20)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)


def test_a_driver_answering_with_internal_addresses_is_still_capped(
    shim_lib: Path, hidden_driver: Path, tmp_path: Path
) -> None:
    proc = run_hidden(shim_lib, hidden_driver, 3020, tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "init=0 alloc=0,2 calls=1 ptsz=0\n"), proc.stderr
    assert [line for line in proc.stderr.splitlines() if "NOT capped" in line] == []


def test_a_variant_unknown_to_the_shim_passes_through_and_says_so(
    shim_lib: Path, hidden_driver: Path, tmp_path: Path
) -> None:
    proc = run_hidden(shim_lib, hidden_driver, 12000, tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "init=0 alloc=0,0 calls=2 ptsz=0\n"), proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpsshim[")]
    assert len(lines) == 1 and '"cuMemAlloc", 12000' in lines[0] and "NOT capped" in lines[0]


@pytest.mark.parametrize(
    ("flags", "default_per_thread", "ptsz_calls"),
    [(0, False, 0), (1, False, 0), (2, False, 1), (0, True, 1), (1, True, 0)],
)
def test_internal_addresses_keep_their_stream_flavour(
    shim_lib: Path, hidden_driver: Path, tmp_path: Path, flags: int, default_per_thread: bool, ptsz_calls: int
) -> None:
    extra = {"HIDDEN_DEFAULT_PER_THREAD": "1"} if default_per_thread else {}
    proc = run_hidden(shim_lib, hidden_driver, 12000, tmp_path, flags=flags, base="cuMemAllocAsync", extra=extra)
    assert (proc.returncode, proc.stdout) == (0, f"init=0 alloc=0,2 calls=1 ptsz={ptsz_calls}\n"), proc.stderr
