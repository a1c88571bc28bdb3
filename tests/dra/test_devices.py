"""The DRA naming contract (mpsd/dra/devices.py): one table per function."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpsd.dra.devices import device_name, parse_device_name, slice_compute, slice_memory

MIB, GIB = 1 << 20, 1 << 30


@pytest.mark.parametrize("gpu, k, name", [
    (0, None, "gpu-0"), (7, None, "gpu-7"), (12, None, "gpu-12"), (9999, None, "gpu-9999"),
    (0, 0, "gpu-0-slice-0"), (1, 3, "gpu-1-slice-3"), (3, 99, "gpu-3-slice-99"),
])
def test_names_and_their_parse(gpu: int, k: int | None, name: str) -> None:
    assert device_name(gpu, k) == name
    assert parse_device_name(name) == (gpu, k)


@pytest.mark.parametrize("gpu, k, message", [
    (-1, None, "bad GPU index -1: expected 0..9999"),
    (10000, None, "bad GPU index 10000"),
    (0, -1, "bad slice index -1: expected 0..99"),
    (0, 100, "bad slice index 100"),
])
def test_out_of_range_indexes_are_refused(gpu: int, k: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        device_name(gpu, k)


@pytest.mark.parametrize("name", [
    "", "gpu", "gpu-", "gpu-01", "gpu-0-slice-", "gpu-0-slice-01", "gpu-0-slice-100", "GPU-0", "gpu-0 ",
    "gpu-0-slice-1-slice-2", "gpu-10000", "gpu--1", "gpu-0-Slice-1", "gpu-٣", "node-a/gpu-0", "x" * 5000,
])
def test_only_the_canonical_spelling_parses(name: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_device_name(name)
    text = str(excinfo.value)
    assert "\n" not in text and len(text) < 200
    assert "expected gpu-<index> (capacity mode) or gpu-<index>-slice-<k> (slices mode)" in text


def test_a_non_string_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="bad device name '3'"):
        parse_device_name(3)  # type: ignore[arg-type]


@given(st.integers(0, 9999), st.one_of(st.none(), st.integers(0, 99)))
def test_every_name_round_trips_and_is_a_dns_label(gpu: int, k: int | None) -> None:
    name = device_name(gpu, k)
    assert parse_device_name(name) == (gpu, k)
    assert len(name) <= 63 and name == name.lower()


@pytest.mark.parametrize("total, n, shares", [
    (16 * GIB, 4, [4 * GIB] * 4),
    (10 * MIB, 3, [3 * MIB, 3 * MIB, 4 * MIB]),  # whole MiB, adding up to the GPU
    (10 * MIB + 5, 3, [3 * MIB, 3 * MIB, 4 * MIB]),  # a partial MiB is not handed out
    (80 * GIB, 1, [80 * GIB]),
])
def test_slice_memory_is_the_device_plugins_share(total: int, n: int, shares: list[int]) -> None:
    assert [slice_memory(total, n, k) for k in range(n)] == shares


@pytest.mark.parametrize("n, percent", [(1, 100.0), (2, 50.0), (3, 33.33), (10, 10.0), (7, 14.29)])
def test_slice_compute(n: int, percent: float) -> None:
    assert slice_compute(n) == percent
