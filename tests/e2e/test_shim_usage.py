"""shim.usage() and `python -m shim` on real region files, written by the real core
(csrc/region_*.c) from helper processes, read through libmpsshim.so's mpsshim_usage."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

import shim
from tests.regionholder import hold, read_loop, reader_survives_truncation

REPO = Path(__file__).resolve().parents[2]
G = 1 << 30
M = 1 << 20


def test_usage_reads_caps_usage_and_live_and_dead_holders(holder_exe, shim_lib, tmp_path):
    region = tmp_path / "region"
    a = hold(holder_exe, region, f"0:{4 * G}:{G}", f"1:{2 * G}:{M}")
    b = hold(holder_exe, region, f"0:{4 * G}:{512 * M}")
    try:
        devices = shim.usage(region, library=shim_lib)
        assert [(d.device, d.cap, d.used) for d in devices] == [(0, 4 * G, G + 512 * M), (1, 2 * G, M)]
        assert sorted((p.pid, p.alive, p.used) for p in devices[0].processes) == sorted([(a.pid, True, G), (b.pid, True, 512 * M)])
        b.send_signal(signal.SIGKILL)
        b.wait()
        dead = {p.pid: p.alive for p in shim.usage(region, library=shim_lib)[0].processes}
        assert dead.get(b.pid, False) is False and dead[a.pid] is True
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_usage_of_a_missing_or_corrupted_region_is_a_region_error(shim_lib, tmp_path):
    with pytest.raises(shim.RegionError, match=r"cannot read region '.*/absent': ") as missing:
        shim.usage(tmp_path / "absent", library=shim_lib)
    assert missing.value.reason == "missing"
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a region" * 1000)
    with pytest.raises(shim.RegionError, match=r"cannot read region '.*/bad': .+") as corrupted:
        shim.usage(bad, library=shim_lib)
    assert corrupted.value.reason == "corrupted"


def test_cli_path_and_usage(holder_exe, shim_lib, tmp_path, run_client):
    env = {"MPSSHIM_LIBRARY": str(shim_lib)}
    out = run_client([sys.executable, "-m", "shim", "path"], env=env, check=True)
    assert out.stdout == f"{shim_lib}\n"
    region = tmp_path / "region"
    a = hold(holder_exe, region, f"0:{4 * G}:{G}")
    try:
        table = run_client([sys.executable, "-m", "shim", "usage", str(region)], env=env, check=True).stdout
        assert table.splitlines()[1].split()[:5] == ["0", "4.0", "GiB", "1.0", "GiB"]
        assert f"pid {a.pid}" in table
        data = json.loads(run_client([sys.executable, "-m", "shim", "usage", str(region), "--json"], env=env, check=True).stdout)
        assert data == {"region": str(region), "devices": [{"device": 0, "cap": 4 * G, "used": G, "processes": [{"pid": a.pid, "alive": True, "used": G}]}]}
    finally:
        a.kill()
        a.wait()
    bad = run_client([sys.executable, "-m", "shim", "usage", str(tmp_path / "absent")], env=env)
    assert bad.returncode == 1 and bad.stderr.startswith("error: cannot read region") and bad.stdout == ""
    missing = run_client([sys.executable, "-m", "shim", "path"], env={"MPSSHIM_LIBRARY": "/no/lib.so"})
    assert missing.returncode == 1 and "MPSSHIM_LIBRARY='/no/lib.so' does not name a file" in missing.stderr


def _within(seconds, fn):
    """fn() on a thread: its result or exception, or a failure if it is still running after ``seconds``."""
    import threading

    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the caller
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds}s"
    return out[0]


def test_usage_refuses_a_fifo_a_symlink_and_an_oversized_file_without_blocking(holder_exe, shim_lib, tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real = tmp_path / "real"
    a = hold(holder_exe, real, f"0:{4 * G}:{G}")
    link = tmp_path / "link"
    link.symlink_to(real)
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that a reader must not map or read
    try:
        err = _within(10, lambda: shim.usage(fifo, library=shim_lib))
        assert isinstance(err, shim.RegionError) and "not a regular file" in str(err) and "\n" not in str(err)
        assert err.reason == "not_regular"  # the word mpsd_regions_refused_total counts it under
        err = _within(10, lambda: shim.usage(link, library=shim_lib))
        assert isinstance(err, shim.RegionError) and "symbolic link" in str(err) and str(link) in str(err)
        assert err.reason == "not_regular"
        err = _within(10, lambda: shim.usage(huge, library=shim_lib))
        assert isinstance(err, shim.RegionError) and "bytes" in str(err) and err.reason == "too_large"
        assert [(d.device, d.used) for d in shim.usage(real, library=shim_lib)] == [(0, G)]  # a real one still reads
    finally:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # unblock a reader stuck in open() (old code)
        except OSError:
            pass
        a.kill()
        a.wait()


def test_cli_usage_of_a_fifo_is_one_line_and_exit_1(shim_lib, tmp_path, run_client):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = run_client([sys.executable, "-m", "shim", "usage", str(fifo)], env={"MPSSHIM_LIBRARY": str(shim_lib)},
                      timeout=20)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "not a regular file" in proc.stderr


def test_usage_of_a_private_copy_has_the_same_figures_and_liveness(holder_exe, shim_lib, tmp_path):
    region = tmp_path / "region"
    a = hold(holder_exe, region, f"0:{4 * G}:{G}")
    try:
        mapped = shim.usage(region, library=shim_lib)
        copied = shim.usage(region, library=shim_lib, copy=True)
        assert [(d.device, d.cap, d.used) for d in copied] == [(d.device, d.cap, d.used) for d in mapped]
        assert [(p.pid, p.alive) for p in mapped[0].processes] == [(a.pid, True)]
        assert [(p.pid, p.alive) for p in copied[0].processes] == [(a.pid, True)]  # tested on the file
        a.kill()
        a.wait()
        assert [(p.pid, p.alive) for p in shim.usage(region, library=shim_lib, copy=True)[0].processes] == [
            (a.pid, False)
        ]
    finally:
        a.kill()
        a.wait()


# the live file, mapped (no private copy); a RegionError counts as a read
READ_LIVE = read_loop("import shim", "shim.usage(region, library=lib)")


def test_usage_of_the_live_file_while_it_is_truncated_is_an_error_not_sigbus(holder_exe, shim_lib, tmp_path):
    # copy=False maps the file others can shrink; the library's guard turns the fault into
    # "region ... corrupted" (a RegionError) instead of killing the reader (issue 16 #5)
    region = tmp_path / "region"
    holder = hold(holder_exe, region, f"0:{4 * G}:{G}")
    reader_survives_truncation(holder, region, READ_LIVE, str(region), str(shim_lib))
