"""A co-tenant that shrinks or replaces the shared region (mode 0666: any process of the
container, whatever its UID, can ftruncate it) must not kill the other clients with SIGBUS:
their next charge or give-back ends in a refusal ("region ... corrupted", one line), and the
application's own SIGBUS still reaches its handler or the default action (issue 16, defect 5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.regionholder import FLIPPER

from tests.shim.conftest import ShimEnv, parse_line, shim_lines

M = 1 << 20
G = 1 << 30


def paused_client(
    shim: ShimEnv, mode: str, cmds: list[object], seen: list[dict[str, object]] | None = None
) -> subprocess.Popen[str]:
    """A client that ran up to its `pause` (the region mapped, memory charged) and waits there;
    its output lines up to the pause are appended to SEEN."""
    proc = subprocess.Popen(
        shim.argv(mode, cmds),
        env=shim.env("0=1G"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    while (line := proc.stdout.readline().strip()) != "pause rc=0":
        assert line, f"client ended before its pause: {proc.wait(timeout=30)}"
        if seen is not None:
            seen.append(parse_line(line))
    return proc


def resume(proc: subprocess.Popen[str]) -> tuple[int, list[dict[str, object]], list[str]]:
    """Let a paused client go on; its exit status, its later output lines and its shim lines."""
    out, err = proc.communicate("go\n", timeout=60)
    return proc.returncode, [parse_line(t) for t in out.splitlines() if t.strip()], shim_lines(err)


def corrupted_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "corrupted" in line]


@pytest.mark.parametrize("mode", ["link", "gpa2"])
def test_a_region_truncated_under_a_client_ends_in_refusals_not_sigbus(shim: ShimEnv, mode: str) -> None:
    region = shim.tmp / "test.region"
    client = paused_client(shim, mode, ["init", "ctx", 0, "alloc", 256 * M, "pause", "alloc", 256 * M, "free", "info"])
    os.truncate(region, 4096)  # another process (any UID of the container) shrinks the file
    rc, lines, logged = resume(client)
    assert rc == 0, f"client died with {signal.Signals(-rc).name if rc < 0 else rc}"
    allocs = [line for line in lines if line["cmd"] == "alloc"]
    assert [line["rc"] for line in allocs] == [2]  # CUDA_ERROR_OUT_OF_MEMORY, the driver never asked
    assert [line["rc"] for line in lines if line["cmd"] == "free"] == [0]  # the driver still frees
    info = next(line for line in lines if line["cmd"] == "info")
    assert info["free"] == 0  # as for an unusable region: nothing to hand out
    assert len(corrupted_lines(logged)) == 1, logged


def test_a_region_truncated_and_grown_back_ends_in_refusals(shim: ShimEnv) -> None:
    # truncating and growing again leaves zeros where the region was (a file "replaced" in
    # place, as `cp` over it does): no signal, but no accounting either
    region = shim.tmp / "test.region"
    client = paused_client(shim, "gpa2", ["init", "ctx", 0, "alloc", 256 * M, "pause", "alloc", 256 * M, "alloc", M])
    size = region.stat().st_size
    os.truncate(region, 0)
    os.truncate(region, size)
    rc, lines, logged = resume(client)
    assert rc == 0, f"client died with {rc}"
    assert [line["rc"] for line in lines if line["cmd"] == "alloc"] == [2, 2]
    assert len(corrupted_lines(logged)) == 1, logged


def test_a_client_allocating_while_a_co_tenant_flips_the_region_size_never_dies(shim: ShimEnv) -> None:
    region = shim.tmp / "test.region"
    client = paused_client(shim, "gpa2", ["init", "ctx", 0, "alloc", M, "pause", "hammer", 4, 20000, 64 * M, G])
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(region)], stdout=subprocess.PIPE, text=True)
    try:
        assert flipper.stdout is not None and flipper.stdout.readline().strip() == "flipping"
        rc, lines, logged = resume(client)  # 4 threads charging and giving back while the file flips
    finally:
        flipper.kill()
        flipper.wait()
    assert rc == 0, f"client died with {signal.Signals(-rc).name if rc < 0 else rc}"
    h = next(line for line in lines if line["cmd"] == "hammer")
    assert h["over"] == 0  # whatever was refused, the driver never held more than the cap
    assert h["refused"] > 0  # the region was lost for good: refusals from then on
    assert corrupted_lines(logged), logged  # rate-limited: one line a second at most


def test_a_region_truncated_while_a_new_client_opens_it_is_refused(shim: ShimEnv) -> None:
    region = shim.tmp / "test.region"
    shim.run("gpa2", ["init", "ctx", 0, "alloc", M], limit="0=1G")
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(region)], stdout=subprocess.PIPE, text=True)
    try:
        assert flipper.stdout is not None and flipper.stdout.readline().strip() == "flipping"
        deadline = time.monotonic() + 10
        runs = 0
        while time.monotonic() < deadline or runs < 20:
            r = shim.run("gpa2", ["init", "ctx", 0, "alloc", M, "free"], limit="0=1G", extra={"MPSSHIM_LOG": "0"})
            assert r.returncode == 0, f"client {runs} died with {r.returncode}: {r.stderr[-500:]}"
            assert r.rcs("alloc") in ([0], [2])
            runs += 1
    finally:
        flipper.kill()
        flipper.wait()


@pytest.mark.parametrize(
    ("before", "after", "expect"),
    [
        ([], ["ownbus", 0], -signal.SIGBUS),  # its own truncated mapping: the default action, as without the shim
        ([], ["ownbus", 1], 0),  # a handler installed after the shim's runs (it prints and exits 0)
        (["bushandler"], ["ownbus", 0], 0),  # one installed before the region was opened is chained
        ([], ["bussignal", "ownbus", 0], 0),  # one installed with signal() after it too
        ([], ["raisebus"], -signal.SIGBUS),  # a SIGBUS sent, not a fault: the default action too
    ],
)
def test_the_applications_own_sigbus_still_reaches_its_handler_or_the_default_action(
    shim: ShimEnv, before: list[object], after: list[object], expect: int
) -> None:
    # `init` opens the region (and installs the shim's handler) between `before` and `after`
    r = shim.run("gpa2", [*before, "init", "ctx", 0, "alloc", M, *after], limit="0=1G")
    assert r.returncode == expect, r.stderr[-500:]
    assert r.rcs("alloc") == [0]
    if expect == 0:
        assert r.of("ownbus")[0]["caught"] == 1


@pytest.mark.parametrize(
    ("before", "after"),
    [(["bushandler"], []), ([], ["bushandler"]), ([], ["bussignal"])],
    ids=["sigaction-before", "sigaction-after", "signal-after"],
)
def test_a_handler_the_application_installed_does_not_see_the_regions_fault(
    shim: ShimEnv, before: list[object], after: list[object]
) -> None:
    # before the region was opened (chained), or after it (the shim's sigaction/signal record it
    # instead of letting it displace the guard): either way the region's fault is the guard's
    region = shim.tmp / "test.region"
    cmds = [*before, "init", "ctx", 0, "alloc", M, *after, "busquery", "pause", "alloc", M, "free"]
    seen: list[dict[str, object]] = []
    client = paused_client(shim, "gpa2", cmds, seen)
    assert next(line for line in seen if line["cmd"] == "busquery")["mine"] == 1  # sigaction reports it back
    os.truncate(region, 4096)
    rc, lines, logged = resume(client)
    assert rc == 0
    assert [line["cmd"] for line in lines] == ["alloc", "free"]  # no "ownbus ... caught": not the app's
    assert [line["rc"] for line in lines] == [2, 0]
    assert len(corrupted_lines(logged)) == 1, logged
