"""The config file is input: whatever is in it (or whatever it is), loading it ends in the
settings or in one ConfigError line naming the file, the place and what is wrong, and
``mpsd check-config`` exits 2 with that one line. Never a traceback, never a hang."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mpsd import config as cfg
from mpsd.config import yamlfile
from mpsd.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
V1 = b"version: v1\n"


def anchors(items: list[str]) -> bytes:
    return V1 + b"visibleDevices: [" + ", ".join(items).encode() + b"]\n"


def bomb(levels: int = 7) -> bytes:
    """Billion laughs: 10**levels strings from a few hundred bytes."""
    return anchors(['&a0 ["lol"]'] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)])


def chain(levels: int) -> bytes:
    """Each anchor one level deeper than the last: shallow text, deep once aliases expand."""
    return anchors(["&a0 [1]"] + [f"&a{i} [*a{i - 1}]" for i in range(1, levels)])


BAD_FILES: dict[str, tuple[bytes, str]] = {
    # name: (content, a fragment of the one line)
    "latin1-comment": (V1 + b"# caf\xe9 au lait\npipeDir: /x\n", "not UTF-8 text at line 2"),
    "utf16": ("version: v1\n".encode("utf-16"), "not UTF-8 text at line 1"),
    "int-5000-digits": (V1 + b"activeThreadPercentage: " + b"9" * 5000 + b"\n", "line 2"),
    "hex-5000-digits": (V1 + b"devicePlugin:\n  slicesPerGpu: 0x" + b"f" * 5000 + b"\n", "line 3"),
    "sexagesimal-huge": (V1 + b"healthInterval: " + b"59:" * 2000 + b"59\n", "line 2"),
    "int-key-5000-digits": (V1 + b"? " + b"9" * 5000 + b"\n: 1\n", "line 2"),
    "float-x": (V1 + b"activeThreadPercentage: !!float x\n", "line 2"),
    "int-0x": (V1 + b"devicePlugin:\n  slicesPerGpu: !!int 0x\n", "line 3"),
    "timestamp-month-99": (V1 + b"logLevel: !!timestamp 2020-99-01\n", "line 2"),
    "timestamp-word": (V1 + b"logLevel: !!timestamp soon\n", "line 2"),
    "python-apply": (V1 + b"pipeDir: !!python/object/apply:os.system [echo hi]\n", "could not determine a constructor"),
    "python-name": (V1 + b"pipeDir: !!python/name:os.system\n", "could not determine a constructor"),
    "deep-flow-list": (V1 + b"visibleDevices: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested deeper than"),
    "deep-flow-map": (V1 + b"pipeDir: " + b"{a: " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested deeper than"),
    "deep-block": (V1 + b"".join(b"  " * i + b"a:\n" for i in range(200)) + b"  " * 200 + b"b: 1\n", "nested deeper"),
    "alias-bomb": (bomb(), "aliases"),
    "alias-chain": (chain(200), "nested deeper than"),
    "alias-cycle": (V1 + b"visibleDevices: &a [1, *a]\n", "refers to a value that contains it"),
    "nul-byte": (V1 + b"pipeDir: a\x00b\n", "line 2"),
    "control-char": (V1 + b"pipeDir: a\x1bb\n", "line 2"),
    "value-with-newlines": (V1 + b'logLevel: "loud\\nline two\\nline three"\n', r"got 'loud\nline two\nline three'"),
    "value-with-line-separator": (V1 + 'logLevel: "a\u2028b"\n'.encode(), "logLevel: expected debug"),
    "key-with-newline": (V1 + b'"pipe\\nDir": /x\n', r"'pipe\nDir': unknown key"),
    "huge-value": (V1 + b"logLevel: " + b"x" * 50000 + b"\n", "(50000 characters)"),
    "tag-with-escaped-newline": (V1 + b"pipeDir: !<tag:a%0Ab> x\n", "could not determine a constructor"),
    "too-large": (V1 + b"#" * (2 << 20) + b"\n", "bytes accepted"),
}


def write(tmp_path: Path, name: str, content: bytes) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    return str(path)


def assert_one_line(message: str, path: str, fragment: str) -> None:
    assert len(message.splitlines()) == 1, message
    assert message.startswith(path), message
    assert fragment in message, message
    assert len(message) < 1000, message[:2000]


@pytest.mark.parametrize("name", BAD_FILES)
def test_every_loader_failure_is_one_config_error_line(tmp_path, name):
    content, fragment = BAD_FILES[name]
    path = write(tmp_path, name, content)
    with pytest.raises(ConfigError) as info:
        cfg.load(path, {}, {})
    assert_one_line(str(info.value), path, fragment)


def special(tmp_path: Path, kind: str) -> tuple[str, str]:
    path = tmp_path / f"{kind}.yaml"
    if kind == "directory":
        path.mkdir()
        return str(path), "Is a directory; expected a YAML file"
    if kind == "fifo":  # open() of a FIFO blocks until a writer comes: mpsd must not wait
        os.mkfifo(path)
        return str(path), "not a regular file (a FIFO)"
    if kind == "symlink-to-fifo":
        os.mkfifo(tmp_path / "target")
        path.symlink_to(tmp_path / "target")
        return str(path), "not a regular file (a FIFO)"
    if kind == "char-device":
        return "/dev/zero", "not a regular file (a character device)"
    if kind == "missing":
        return str(path), "cannot read config file: No such file or directory"
    raise AssertionError(kind)


SPECIAL = ["directory", "fifo", "symlink-to-fifo", "char-device", "missing"]


def check_config(path: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", "check-config", path],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_path_that_is_no_regular_file_exits_2_with_one_line_at_once(tmp_path, kind):
    path, fragment = special(tmp_path, kind)
    try:
        result = check_config(path, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"check-config of a {kind} did not return in 20s")
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert_one_line(result.stderr.removeprefix("mpsd: "), path, fragment)


@pytest.mark.parametrize("name", ["latin1-comment", "int-5000-digits", "float-x", "deep-flow-list", "alias-bomb"])
def test_check_config_of_a_bad_file_exits_2_with_one_line(tmp_path, name):
    content, fragment = BAD_FILES[name]
    path = write(tmp_path, name, content)
    result = check_config(path)
    assert result.returncode == 2, result
    assert result.stderr.startswith("mpsd: ") and "Traceback" not in result.stderr
    assert_one_line(result.stderr.removeprefix("mpsd: "), path, fragment)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to take another user's identity for a moment")
def test_an_unreadable_file_is_one_line():
    # Root reads every file: the open is tried as nobody (the effective UID only, given back).
    base = Path(tempfile.mkdtemp(prefix="mpsd-unreadable-"))
    try:
        base.chmod(0o755)
        path = base / "config.yaml"
        path.write_bytes(V1)
        path.chmod(0o600)
        os.seteuid(65534)
        try:
            with pytest.raises(ConfigError) as info:
                cfg.load(str(path), {}, {})
        finally:
            os.seteuid(0)
        assert_one_line(str(info.value), str(path), "cannot read config file: Permission denied")
    finally:
        for p in (base / "config.yaml", base):
            p.chmod(stat.S_IRWXU)
        (base / "config.yaml").unlink()
        base.rmdir()


def test_limits_leave_room_for_any_real_config(tmp_path):
    # A commented file near the size limit, nesting as deep as a config gets, a few aliases.
    body = V1 + b"# " + b"x" * (yamlfile.MAX_FILE_BYTES - 400) + b"\n"
    body += b"pinnedMemLimit: &lim 0=2G\ndevicePlugin:\n  enabled: true\n  slicesPerGpu: 4\n"
    body += b"visibleDevices: [0, 1]\n"
    path = write(tmp_path, "big-but-fine", body)
    assert len(body) <= yamlfile.MAX_FILE_BYTES
    c = cfg.load(path, {}, {})
    assert c.pinned_mem_limit == {0: 2 << 30} and c.visible_devices == "0,1" and c.device_plugin.slices_per_gpu == 4
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbf" + V1 + b"logLevel: debug\n")
    (tmp_path / "mounted.yaml").symlink_to(bom)  # a ConfigMap's files are symlinks
    assert cfg.load(str(tmp_path / "mounted.yaml"), {}, {}).log_level == "debug"
    merged = V1 + b"x: &d {enabled: true}\ndevicePlugin:\n  <<: *d\n  slicesPerGpu: 3\n"
    with pytest.raises(ConfigError, match="x: unknown key"):  # merge keys work; the anchor holder is unknown
        cfg.load(write(tmp_path, "merge", merged), {}, {})


def test_settings_are_printed_whole_and_on_one_line(tmp_path):
    # Errors cut a bad value short; the resolved settings (check-config, the start log) do not.
    long_path = "/opt/" + "x" * 100 + "/nvidia-cuda-mps-control"
    path = write(tmp_path, "long", V1 + f'controlBinary: {long_path}\npipeDir: "/run/a\\nb"\n'.encode())
    c = cfg.load(path, {}, {})
    assert cfg.format_value(c, "controlBinary") == f'"{long_path}"'
    line = cfg.describe(c)
    assert len(line.splitlines()) == 1 and "pipeDir='/run/a\\nb'" in line
