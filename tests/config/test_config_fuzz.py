"""The config parser fuzzed: valid config files mutated (bytes flipped, YAML tags, anchors,
huge integers, deep nesting, non-UTF-8 bytes and control characters inserted, ranges cut or
repeated) go through ``mpsd check-config``. Each ends in exit 0, or exit 2 with exactly one line
on stderr: never a traceback, never a hang. In process (main() with argv) under hypothesis,
bounded in time; then a few mutants through the real CLI as a subprocess."""

from __future__ import annotations

import contextlib
import io
import random
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpsd import config as cfg
from mpsd.cli import main
from mpsd.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

BASES = [
    b"""version: v1
controlBinary: /opt/nvidia/bin/nvidia-cuda-mps-control
pipeDir: /run/mpsd/pipe
visibleDevices: "0,GPU-1234"
activeThreadPercentage: 50
pinnedMemLimit: "0=20G,1=10G"
clientPriority: 1
exclusiveProcess: true
healthInterval: 500ms
restartBackoffMax: 1m
metricsAddress: "127.0.0.1:9400"
logLevel: debug
devicePlugin:
  enabled: true
  slicesPerGpu: 4
  ipcMode: tmpfs
""",
    b"version: v1\nvisibleDevices: [0, 1]\ndevicePlugin: {enabled: yes, resourceName: mpsd.io/gpu}\n",
    yaml.safe_dump(cfg.default_config().to_dict()).encode(),
]

TOKENS = [
    b"!!float ",
    b"!!int ",
    b"!!str ",
    b"!!bool ",
    b"!!binary ",
    b"!!timestamp ",
    b"!!set ",
    b"!!omap ",
    b"!!python/object/apply:os.system ",
    b"!!python/name:os.system ",
    b"!<tag:a%0Ab> ",
    b"&a ",
    b"*a",
    b"<<: *a\n",
    b"9" * 5000,
    b"0x" + b"f" * 300,
    b"0b" + b"1" * 300,
    b"59:" * 300,
    b"1e999",
    b"-0.0",
    b".nan",
    b".inf",
    b"~",
    b"[" * 300,
    b"{a: " * 300,
    b"".join(b"  " * i + b"a:\n" for i in range(60)),
    b"- " * 100,
    b"\xe9",
    b"\xff\xfe",
    b"\xc3",
    b"\x00",
    b"\x1b",
    b"\x85",
    "\u2028".encode(),
    b"\t",
    b"\r",
    b"\n",
    b": ",
    b"- ",
    b"? ",
    b"'",
    b'"',
    b'"\\n\\n"',
    b"|\n",
    b">-\n",
    b"#",
    b"%YAML 1.1\n",
    b"%TAG ! tag:x,2000:\n",
    b"---\n",
    b"...\n",
    b"=",
    b",",
    b"0=",
    b"GPU-",
    b"version: v2\n",
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four mutations of ``data``, chosen by ``rng``."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["flip", "insert", "insert", "insert", "delete", "repeat", "replace-value"])
        pos = rng.randint(0, len(buf))
        if op == "flip" and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randint(0, 7)
        elif op == "insert":
            buf[pos:pos] = rng.choice(TOKENS)
        elif op == "delete":
            del buf[pos : pos + rng.randint(1, 16)]
        elif op == "repeat":
            end = min(len(buf), pos + rng.randint(1, 64))
            buf[pos:pos] = buf[pos:end] * rng.randint(2, 50)
        elif op == "replace-value":
            line_end = buf.find(b"\n", pos)
            colon = buf.rfind(b": ", 0, line_end if line_end >= 0 else len(buf))
            if colon >= 0:
                end = line_end if line_end > colon else len(buf)
                buf[colon + 2 : end] = rng.choice(TOKENS)
    return bytes(buf)


def check_config_in_process(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check-config", str(path)], env={})
    return code, out.getvalue(), err.getvalue()


def assert_exit_0_or_one_line(code: int, out: str, err: str, content: bytes) -> None:
    assert code in (0, 2), (code, content[:300], err[-2000:])
    if code == 0:
        assert err == "" and out.splitlines()[0].endswith(": ok"), (content[:300], out, err)
    else:
        assert out == "", (content[:300], out)
        assert len(err.splitlines()) == 1 and err.endswith("\n"), (content[:300], err)
        assert err.startswith("mpsd: ") and "Traceback" not in err, (content[:300], err)
        assert len(err) < 1000, (content[:300], err[:2000])


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "config.yaml"


@settings(
    max_examples=300,
    deadline=timedelta(seconds=5),  # a parse that expands or walks a bomb takes minutes
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(base=st.sampled_from(BASES), rng=st.randoms(use_true_random=False))
def test_mutated_config_files_exit_0_or_2_with_one_line(fuzz_file, base, rng):
    content = mutate(rng, base)
    fuzz_file.write_bytes(content)
    code, out, err = check_config_in_process(fuzz_file)
    assert_exit_0_or_one_line(code, out, err, content)
    try:  # the message itself, without the CLI's last guard that joins lines
        cfg.load(str(fuzz_file), {}, {})
    except ConfigError as exc:
        assert len(str(exc).splitlines()) == 1, str(exc)


@pytest.mark.parametrize("seed", range(6))
def test_mutated_config_files_through_the_real_cli(tmp_path, seed):
    rng = random.Random(seed)
    path = tmp_path / "config.yaml"
    content = mutate(rng, BASES[seed % len(BASES)])
    for _ in range(3):  # a few more mutations each: most of these end in exit 2
        content = mutate(rng, content)
    path.write_bytes(content)
    result = subprocess.run(
        [sys.executable, "-m", "mpsd", "check-config", str(path)],
        capture_output=True,
        text=True,
        errors="replace",
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert_exit_0_or_one_line(result.returncode, result.stdout, result.stderr, content)
