"""csrc/track.c: the allocation tracker against a dict model, and under many threads."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.conftest import HERE, VARIANTS, LineProc, driver_env

# Small key space (so adds hit existing keys and removes hit absent ones), both kinds, and
# keys that differ only in high bits or only in kind.
keys = st.sampled_from([0, 1, 2, 0x7F0000000000, 0x7F0000000200, 1 << 63, (1 << 64) - 1]) | st.integers(0, 40)
adds = st.tuples(st.just("a"), st.integers(0, 1), keys, st.integers(0, 63), st.integers(0, (1 << 64) - 1))
removes = st.tuples(st.just("r"), st.integers(0, 1), keys)
holds = st.tuples(st.just("h"), st.just(1), keys, st.integers(-3, 3))  # handles' references
programs = st.lists(adds | removes | holds, max_size=200)


@pytest.fixture(scope="module")
def trackers(core_bin: Path) -> Iterator[list[LineProc]]:
    """One driver per build; each example uses fresh keys by offsetting with a per-example base."""
    procs = [LineProc([core_bin / f"track_test{v}", "ops"]) for v in VARIANTS]
    yield procs
    for p in procs:
        assert p.close() == 0, p.stderr_text()


def run_program(proc: LineProc, program: list[tuple[object, ...]]) -> None:
    model: dict[tuple[int, int], tuple[int, int]] = {}
    held: dict[tuple[int, int], int] = {}  # a handle starts with one reference; forgotten at zero
    for op in program:
        if op[0] == "a":
            _, kind, key, dev, size = op
            assert proc.ask(f"a {kind} {key} {dev} {size}") == "ok"
            model[(kind, key)] = (dev, size)  # type: ignore[index]
            held[(kind, key)] = 1  # type: ignore[index]
        elif op[0] == "h":
            _, kind, key, delta = op
            k = (kind, key)
            if k not in model:
                assert proc.ask(f"h {key} {delta}") == "unknown"
                continue
            held[k] = max(0, held[k] + delta)  # type: ignore[index,operator]
            if held[k] == 0:
                dev, size = model.pop(k)  # type: ignore[arg-type]
                assert proc.ask(f"h {key} {delta}") == f"1 {dev} {size}"
            else:
                assert proc.ask(f"h {key} {delta}") == "held"
        else:
            _, kind, key = op
            want = model.pop((kind, key), None)  # type: ignore[arg-type]
            assert proc.ask(f"r {kind} {key}") == ("0" if want is None else f"1 {want[0]} {want[1]}")
    for (kind, key), (dev, size) in model.items():  # leave the table empty for the next example
        assert proc.ask(f"r {kind} {key}") == f"1 {dev} {size}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=programs)
def test_matches_a_dict_model(trackers: list[LineProc], program: list[tuple[object, ...]]) -> None:
    for proc in trackers:
        run_program(proc, program)


def ask_many(proc: LineProc, lines: list[str]) -> list[str]:
    """Pipelined in chunks small enough that neither pipe fills while the other waits."""
    assert proc.proc.stdin is not None and proc.proc.stdout is not None
    answers: list[str] = []
    for at in range(0, len(lines), 500):
        chunk = lines[at : at + 500]
        proc.proc.stdin.write(("\n".join(chunk) + "\n").encode())
        proc.proc.stdin.flush()
        answers += [proc.proc.stdout.readline().decode().rstrip("\n") for _ in chunk]
    return answers


def test_grows_and_shrinks_through_many_keys(trackers: list[LineProc]) -> None:
    """20000 live keys (every shard grows several times), then all removed."""
    n = 20000
    base = 0x7F0000000000
    for proc in trackers:
        assert ask_many(proc, [f"a {i & 1} {base + i * 512} {i % 8} {i + 1}" for i in range(n)]) == ["ok"] * n
        got = ask_many(proc, [f"r {i & 1} {base + i * 512}" for i in range(n)])
        assert got == [f"1 {i % 8} {i + 1}" for i in range(n)]
        assert proc.ask(f"r 0 {base}") == "0"
        assert proc.ask(f"r 1 {base + 512}") == "0"


@pytest.mark.parametrize("variant", VARIANTS)
def test_many_threads_with_keys_handed_between_them(core_bin: Path, variant: str) -> None:
    """8 threads add and remove; some keys are freed by another thread than the one that added
    them (as a framework's allocator thread may). Every remove must find exactly what was added."""
    ops = "300000" if variant == "" else "60000"
    proc = subprocess.run(
        [core_bin / f"track_test{variant}", "threads", "8", ops, "7"],
        capture_output=True,
        text=True,
        timeout=120,
        env=driver_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok adds=")
    adds = int(proc.stdout.split("adds=")[1].split()[0])
    assert adds > 8 * int(ops) // 3


def ticket(proc: LineProc, kind: int, key: int) -> int:
    answer = proc.ask(f"b {kind} {key}")
    assert answer.startswith("1 "), answer
    return int(answer.split()[1])


def test_racing_frees_of_one_key_give_it_back_exactly_once(trackers: list[LineProc]) -> None:
    """Two frees of one key in flight at once (a program's racing double free): whichever order
    the driver's answers come in, exactly one caller gets the charge back, and only if the driver
    freed; the second free joins the first instead of finding nothing."""
    key = 0x7E0000000000
    for proc in trackers:
        # the first free to be answered freed, the last was refused: the last one out gives it back
        assert proc.ask(f"a 0 {key} 3 100") == "ok"
        t = ticket(proc, 0, key)
        assert ticket(proc, 0, key) == t  # joined
        assert proc.ask(f"e 0 {key} {t} 1") == "0"
        assert proc.ask(f"e 0 {key} {t} 0") == "1 3 100"
        assert proc.ask(f"r 0 {key}") == "0" and proc.ask(f"b 0 {key}") == "0"
        # refused first, freed last
        assert proc.ask(f"a 0 {key} 3 100") == "ok"
        t = ticket(proc, 0, key)
        assert ticket(proc, 0, key) == t
        assert proc.ask(f"e 0 {key} {t} 0") == "0"
        assert proc.ask(f"e 0 {key} {t} 1") == "1 3 100"
        assert proc.ask(f"r 0 {key}") == "0"
        # every free refused: the entry is live again, with its values
        assert proc.ask(f"a 0 {key} 3 100") == "ok"
        t = ticket(proc, 0, key)
        assert ticket(proc, 0, key) == t
        assert proc.ask(f"e 0 {key} {t} 0") == "0"
        assert proc.ask(f"e 0 {key} {t} 0") == "0"
        assert proc.ask(f"r 0 {key}") == "1 3 100"
        # one free alone
        assert proc.ask(f"a 1 {key} 2 50") == "ok"
        t = ticket(proc, 1, key)
        assert proc.ask(f"e 1 {key} {t} 1") == "1 2 50"
        assert proc.ask(f"b 1 {key}") == "0"


def test_an_address_handed_out_again_while_a_free_is_in_flight_is_a_new_entry(trackers: list[LineProc]) -> None:
    key = 0x7E0000001000
    for proc in trackers:
        assert proc.ask(f"a 0 {key} 1 100") == "ok"
        old = ticket(proc, 0, key)
        # the driver freed it and gave the address to a new allocation before this free returned
        assert proc.ask(f"a 0 {key} 2 200") == "ok"
        new = ticket(proc, 0, key)  # a free of the new allocation marks the new entry
        assert new != old
        assert proc.ask(f"e 0 {key} {old} 1") == "1 1 100"
        assert proc.ask(f"e 0 {key} {new} 1") == "1 2 200"
        assert proc.ask(f"r 0 {key}") == "0"


def test_entries_being_freed_survive_the_table_growing(trackers: list[LineProc]) -> None:
    base = 0x7D0000000000
    n = 3000
    for proc in trackers:
        assert ask_many(proc, [f"a 0 {base + i * 512} {i % 8} {i + 1}" for i in range(n)]) == ["ok"] * n
        tickets = [int(a.split()[1]) for a in ask_many(proc, [f"b 0 {base + i * 512}" for i in range(n)])]
        more = 0x7C0000000000  # grows every shard while those are in flight
        assert ask_many(proc, [f"a 0 {more + i * 512} 0 1" for i in range(4 * n)]) == ["ok"] * (4 * n)
        got = ask_many(proc, [f"e 0 {base + i * 512} {tickets[i]} 1" for i in range(n)])
        assert got == [f"1 {i % 8} {i + 1}" for i in range(n)]
        assert ask_many(proc, [f"r 0 {more + i * 512}" for i in range(4 * n)]) == ["1 0 1"] * (4 * n)


def test_device_pointers_racing_frees_on_the_lock_free_table(trackers: list[LineProc]) -> None:
    key = 0x7B0000000000
    for proc in trackers:
        assert proc.ask(f"p {key} 3 100") == "ok"
        t = ticket(proc, 0, key)
        assert ticket(proc, 0, key) == t  # a racing free joins the first
        assert proc.ask(f"e 0 {key} {t} 0") == "0"
        assert proc.ask(f"e 0 {key} {t} 1") == "1 3 100"
        assert proc.ask(f"b 0 {key}") == "0"
        assert proc.ask(f"p {key} 3 100") == "ok"  # every free refused: live again
        t = ticket(proc, 0, key)
        assert proc.ask(f"e 0 {key} {t} 0") == "0"
        t2 = ticket(proc, 0, key)
        assert proc.ask(f"e 0 {key} {t2} 1") == "1 3 100"
        assert proc.ask(f"p {key} 1 10") == "ok"  # a free in flight while the address comes back
        old = ticket(proc, 0, key)
        assert proc.ask(f"p {key} 2 20") == "ok"
        new = ticket(proc, 0, key)
        assert new != old
        assert proc.ask(f"e 0 {key} {new} 1") == "1 2 20"
        assert proc.ask(f"e 0 {key} {old} 1") == "1 1 10"
        assert proc.ask(f"b 0 {key}") == "0"


def test_more_device_pointers_than_the_lock_free_table_holds_spill_to_the_shards(trackers: list[LineProc]) -> None:
    """70000 live pointers (the lock-free table has 65536 slots): every one is found once."""
    base, n = 0x790000000000, 70000
    for proc in trackers:
        assert ask_many(proc, [f"p {base + i * 256} {i % 8} {i + 1}" for i in range(n)]) == ["ok"] * n
        tickets = ask_many(proc, [f"b 0 {base + i * 256}" for i in range(n)])
        assert all(t.startswith("1 ") for t in tickets)
        got = ask_many(proc, [f"e 0 {base + i * 256} {t.split()[1]} 1" for i, t in enumerate(tickets)])
        assert got == [f"1 {i % 8} {i + 1}" for i in range(n)]
        assert ask_many(proc, [f"b 0 {base + i * 256}" for i in range(0, n, 97)]) == ["0"] * len(range(0, n, 97))


@pytest.mark.parametrize("variant", VARIANTS)
def test_threads_racing_to_free_one_pointer_give_it_back_exactly_once(core_bin: Path, variant: str) -> None:
    """Each round 4 threads free one pointer at once; a simulated driver frees it for the first
    (every 5th round for none: the entry must then be there, whole)."""
    iters = "20000" if variant == "" else "4000"
    proc = subprocess.run(
        [core_bin / f"track_test{variant}", "race", "4", iters],
        capture_output=True,
        text=True,
        timeout=120,
        env=driver_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = int(iters)
    assert proc.stdout.split() == ["ok", f"uncharged={n - n // 5}", f"kept={n // 5}"]


@pytest.fixture(scope="module")
def track_tsan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """track_test and csrc/track*.c built with ThreadSanitizer (here, so the core Makefile stays as it is)."""
    runtime = subprocess.run(["cc", "-print-file-name=libtsan.so"], capture_output=True, text=True, check=False)
    if not Path(runtime.stdout.strip()).is_absolute():
        pytest.skip("the C compiler has no ThreadSanitizer runtime")
    exe = tmp_path_factory.mktemp("tsan") / "track_test_tsan"
    csrc = HERE.parent.parent / "csrc"
    subprocess.run(
        ["cc", "-std=gnu11", "-D_GNU_SOURCE", "-g", "-O1", "-fsanitize=thread", "-pthread", f"-I{csrc}"]
        + ["-Wall", "-Wextra", "-Werror"]
        + [str(HERE / "track_test.c"), str(csrc / "track.c"), str(csrc / "track_refs.c"), "-o", str(exe)],
        check=True,
    )
    return exe


@pytest.mark.parametrize("args", [["race", "4", "3000"], ["threads", "8", "20000", "5"]])
def test_the_tracker_is_clean_under_thread_sanitizer(track_tsan: Path, args: list[str]) -> None:
    env = {**driver_env(), "TSAN_OPTIONS": "halt_on_error=1:exitcode=66"}
    proc = subprocess.run([track_tsan, *args], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0 and "ThreadSanitizer" not in proc.stderr, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok ")
