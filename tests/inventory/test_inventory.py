"""mpsd.inventory.nvml on the real pynvml, loading the fake libnvidia-ml.so.1 by path."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpsd.errors import InventoryError
from mpsd.inventory.nvml import Client, Gpu, Inventory, use_library
from tests.fakes.nvml_build import nvml_config_text

GIB = 1 << 30
A100 = ("GPU-5f1c0d3e-8a4b-4c2d-9e0f-112233445566", 80 * GIB, 5 * GIB, (8, 0), True, "NVIDIA A100-SXM4-80GB")
T4 = ("GPU-0a0b0c0d-1111-2222-3333-444444444444", 15 * GIB, 0, (7, 5), False, "Tesla T4")
CONFIG = nvml_config_text(
    gpus=[A100, T4],
    mps_clients=[(0, 3001, 2 * GIB), (0, 3002, GIB), (1, 4001, 512 << 20)],
    compute_procs=[(0, 2999, 3 * GIB), (1, 2999, 512 << 20)],
    driver="550.163.01",
    privileged=True,
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def open_inventory(fake_nvml_lib: Path, nvml_config) -> Iterator:
    opened: list[Inventory] = []

    def make(text: str = CONFIG) -> Inventory:
        nvml_config(text)
        inv = Inventory(library_path=str(fake_nvml_lib))
        opened.append(inv)
        return inv

    yield make
    for inv in opened:
        inv.close()


def test_gpus_have_every_field(open_inventory) -> None:
    inv = open_inventory(CONFIG + "nomig 1\n")
    assert inv.gpus() == [
        Gpu(0, A100[0], "NVIDIA A100-SXM4-80GB", 80 * GIB, 5 * GIB, (8, 0), True, 0),
        Gpu(1, T4[0], "Tesla T4", 15 * GIB, 0, (7, 5), False, 1),
    ]
    assert inv.driver_version() == "550.163.01"


def test_mps_clients_come_from_the_mps_query(open_inventory) -> None:
    assert open_inventory().mps_clients() == [
        Client(0, 3001, 2 * GIB),
        Client(0, 3002, GIB),
        Client(1, 4001, 512 << 20),
    ]


def test_no_gpus_and_no_clients(open_inventory) -> None:
    inv = open_inventory("driver 1.0\n")
    assert (inv.gpus(), inv.mps_clients()) == ([], [])


def test_missing_mps_call_falls_back_to_compute_processes_logged_once(open_inventory, caplog) -> None:
    inv = open_inventory(CONFIG + "fail nvmlDeviceGetMPSComputeRunningProcesses_v3 13\n")
    with caplog.at_level(logging.WARNING, logger="mpsd.inventory.nvml"):
        first, second = inv.mps_clients(), inv.mps_clients()
    assert first == second == [Client(0, 2999, 3 * GIB), Client(1, 2999, 512 << 20)]
    warnings = [r.getMessage() for r in caplog.records if "MPS process query unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "Function Not Found" in warnings[0]


def test_pynvml_without_the_mps_wrapper_falls_back(open_inventory, monkeypatch) -> None:
    monkeypatch.delattr(pynvml, "nvmlDeviceGetMPSComputeRunningProcesses_v3")
    assert open_inventory().mps_clients()[0] == Client(0, 2999, 3 * GIB)


def test_memory_falls_back_to_v1_when_v2_is_missing(open_inventory) -> None:
    inv = open_inventory(CONFIG + "fail nvmlDeviceGetMemoryInfo_v2 13\n")
    assert [(g.memory_total, g.memory_used) for g in inv.gpus()] == [(80 * GIB, 5 * GIB), (15 * GIB, 0)]


@pytest.mark.parametrize(
    "function, message",
    [
        ("nvmlDeviceGetUUID", "NVML nvmlDeviceGetUUID(gpu 0) failed: GPU is lost"),
        ("nvmlDeviceGetMemoryInfo_v2", "NVML nvmlDeviceGetMemoryInfo_v2(gpu 0) failed: GPU is lost"),
        ("nvmlDeviceGetMigMode", "NVML nvmlDeviceGetMigMode(gpu 0) failed: GPU is lost"),
        ("nvmlDeviceGetCount_v2", "NVML nvmlDeviceGetCount failed: GPU is lost"),
    ],
)
def test_nvml_errors_name_the_call_and_nvml_message(open_inventory, function: str, message: str) -> None:
    inv = open_inventory(CONFIG + f"fail {function} 15\n")
    with pytest.raises(InventoryError) as exc:
        inv.gpus()
    assert str(exc.value) == message
    assert isinstance(exc.value.__cause__, pynvml.NVMLError)


def test_mps_query_error_is_not_a_fallback(open_inventory) -> None:
    """Refused on a whole GPU (1) it is an error; on a GPU in MIG mode (0) it is NVML's rule for
    unprivileged callers, and that GPU's clients are left out (test_mig_privileges.py)."""
    inv = open_inventory(CONFIG + "fail nvmlDeviceGetMPSComputeRunningProcesses_v3 4\n")
    with pytest.raises(
        InventoryError, match=r"MPSComputeRunningProcesses_v3\(gpu 1\) failed: Insufficient Permissions"
    ):
        inv.mps_clients()


def test_init_failure(fake_nvml_lib: Path, nvml_config) -> None:
    nvml_config(CONFIG + "fail nvmlInitWithFlags 9\n")
    with pytest.raises(InventoryError, match="^NVML nvmlInit failed: Driver Not Loaded$"):
        Inventory(library_path=str(fake_nvml_lib))


def test_missing_library_path(tmp_path: Path) -> None:
    missing = tmp_path / "libnvidia-ml.so.1"
    with pytest.raises(InventoryError) as exc:
        Inventory(library_path=str(missing))
    assert f"cannot load NVML library '{missing}'" in str(exc.value)
    assert "mpsd needs NVML (libnvidia-ml.so.1" in str(exc.value)
    assert "\n" not in str(exc.value)


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_library_not_on_the_loader_path(tmp_path: Path) -> None:
    code = (
        "from mpsd.inventory.nvml import Inventory\n"
        "from mpsd.errors import InventoryError\n"
        "try:\n    Inventory()\nexcept InventoryError as e:\n    print(e)\n"
    )
    out = _run_python(code, {"LD_LIBRARY_PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "NVML library libnvidia-ml.so.1 not found on the loader path; "
        "mpsd needs NVML (libnvidia-ml.so.1, installed with the NVIDIA driver)"
    )


def test_default_search_finds_the_library_on_ld_library_path(fake_nvml_lib: Path, tmp_path: Path) -> None:
    conf = tmp_path / "nvml.conf"
    conf.write_text(CONFIG)
    code = "from mpsd.inventory.nvml import Inventory\ninv = Inventory()\nprint([g.uuid for g in inv.gpus()])\ninv.close()\n"
    out = _run_python(code, {"LD_LIBRARY_PATH": str(fake_nvml_lib.parent), "FAKE_NVML_CONFIG": str(conf)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr([A100[0], T4[0]])


def test_use_library_switches_library_and_drops_cached_functions(
    fake_nvml_lib: Path, tmp_path: Path, open_inventory
) -> None:
    open_inventory().close()  # caches function pointers of the first library
    copy = tmp_path / "copy" / "libnvidia-ml.so.1"
    copy.parent.mkdir()
    shutil.copy(fake_nvml_lib, copy)
    use_library(str(copy))
    try:
        with Inventory() as inv:
            assert len(inv.gpus()) == 2
            fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetCount_v2")
            expected = ctypes.CDLL(str(copy)).nvmlDeviceGetCount_v2
            assert ctypes.cast(fn, ctypes.c_void_p).value == ctypes.cast(expected, ctypes.c_void_p).value
    finally:
        use_library(str(fake_nvml_lib))
    assert pynvml.nvmlLib._name == str(fake_nvml_lib)


def test_close_shuts_nvml_down_once(open_inventory) -> None:
    inv = open_inventory()
    inv.close()
    inv.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(InventoryError, match="after close"):
        inv.gpus()


@contextmanager
def _fake_config(text: str) -> Iterator[None]:
    old = os.environ.get("FAKE_NVML_CONFIG")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "nvml.conf"
        path.write_text(text)
        os.environ["FAKE_NVML_CONFIG"] = str(path)
        try:
            yield
        finally:
            if old is None:
                del os.environ["FAKE_NVML_CONFIG"]
            else:
                os.environ["FAKE_NVML_CONFIG"] = old


gpu_strategy = st.builds(
    lambda uuid, total, frac, cc, mig, name: (uuid, total, int(total * frac), cc, mig, name),
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.integers(1, 1 << 50),
    st.floats(0, 1),
    st.tuples(st.integers(3, 12), st.integers(0, 9)),
    st.booleans(),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#"), min_size=1, max_size=40),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gpus=st.lists(gpu_strategy, min_size=1, max_size=8),
    procs=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 4_000_000), st.integers(0, 1 << 40)), max_size=20),
)
def test_inventory_reports_exactly_what_the_driver_has(fake_nvml_lib: Path, gpus, procs) -> None:
    procs = [(gpu % len(gpus), pid, used) for gpu, pid, used in procs]
    with _fake_config(nvml_config_text(gpus=gpus, mps_clients=procs, privileged=True)), Inventory(str(fake_nvml_lib)) as inv:
        assert inv.gpus() == [Gpu(i, g[0], g[5], g[1], g[2], g[3], g[4], i) for i, g in enumerate(gpus)]
        expected = sorted(procs, key=lambda p: p[0])  # the fake lists per GPU in file order
        assert inv.mps_clients() == [Client(*p) for p in expected]


def test_gpus_carry_nvmls_minor_number(open_inventory) -> None:
    """/dev/nvidia<N> is numbered by the driver's minor number, not by the NVML index (they
    differ, e.g. when a GPU is hidden or after a hot-plug): NVML tells the minor number."""
    inv = open_inventory(CONFIG + "minor 0 3\nminor 1 0\n")
    assert [(g.index, g.minor_number) for g in inv.gpus()] == [(0, 3), (1, 0)]


def test_a_gpu_whose_minor_number_nvml_does_not_offer_has_none(open_inventory) -> None:
    inv = open_inventory(CONFIG + "fail nvmlDeviceGetMinorNumber 3\n")
    assert [g.minor_number for g in inv.gpus()] == [None, None]
