"""Fetch the real ``nvidia-cuda-mps-control`` from Debian's non-free archive, without a system change.

The machine's apt sources usually name only ``main``. We write a private sources list that
repeats the machine's Debian URI and suite with ``main non-free``, point apt's lists and
cache at a directory we own, ``apt-get download`` the package there and unpack it with
``dpkg-deb -x``. Nothing under /etc or /var is touched.

    python -m tests.mpsbin [CACHE_DIR]     # prints the binary's path
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PACKAGE = "nvidia-cuda-mps"
BINARY = Path("usr/bin/nvidia-cuda-mps-control")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache" / "mps"
SOURCE_FILES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))


class FetchError(RuntimeError):
    """The package could not be fetched; the message carries apt's output."""


def debian_source(files: tuple[Path, ...] = SOURCE_FILES) -> tuple[str, str]:
    """(URI, suite) of the machine's main Debian archive, from deb822 or one-line sources."""
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        found = parse_debian_source(text)
        if found:
            return found
    raise FetchError(f"no Debian archive found in {', '.join(map(str, files))}")


def parse_debian_source(text: str) -> tuple[str, str] | None:
    # deb822 stanzas: "URIs: ..." and "Suites: ..."
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(
            (m.group(1).lower(), m.group(2).split()) for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
        )
        uris, suites = fields.get("uris", []), fields.get("suites", [])
        for uri in uris:
            if _is_debian_main(uri) and suites:
                suite = next((s for s in suites if "-" not in s), suites[0])
                return uri, suite
    # one-line: "deb [opts] URI SUITE COMPONENTS..."
    for line in text.splitlines():
        m = re.match(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m and _is_debian_main(m.group(1)) and "-" not in m.group(2):
            return m.group(1), m.group(2)
    return None


def _is_debian_main(uri: str) -> bool:
    return "debian" in uri and "security" not in uri and "debian-ports" not in uri


# Debian suites carrying other versions of the package (docs/security.md: per-version exposure)
SUITES = {"535.216": "bookworm-backports", "535.261": "bookworm", "550.163": "trixie", "555.58": "experimental"}


def ensure_mps_control(cache_dir: Path = DEFAULT_CACHE, suite: str | None = None) -> Path:
    """Path of the unpacked ``nvidia-cuda-mps-control``; fetched once into ``cache_dir``
    (``suite``: that Debian suite's package, in ``cache_dir/suite``; else the machine's)."""
    cache_dir = Path(cache_dir).resolve() / (suite or "")
    root = cache_dir / "root"
    binary = root / BINARY
    if binary.is_file():
        return binary
    uri, machine_suite = debian_source()
    suite = suite or machine_suite
    for sub in ("lists/partial", "apt/archives/partial", "debs"):
        (cache_dir / sub).mkdir(parents=True, exist_ok=True)
    sources = cache_dir / "sources.list"
    sources.write_text(f"deb {uri} {suite} main non-free\n")
    apt = [
        "apt-get",
        "-q",
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={cache_dir / 'lists'}",
        f"-oDir::Cache={cache_dir / 'apt'}",
        "-oAPT::Sandbox::User=root",
    ]
    _run(apt + ["update"], cwd=cache_dir)
    _run(apt + ["download", PACKAGE], cwd=cache_dir / "debs")
    debs = sorted((cache_dir / "debs").glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise FetchError(f"apt-get download {PACKAGE} left no .deb in {cache_dir / 'debs'}")
    _run(["dpkg-deb", "-x", str(debs[-1]), str(root)], cwd=cache_dir)
    if not binary.is_file():
        raise FetchError(f"{debs[-1].name} has no {BINARY}")
    return binary


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> None:
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise FetchError(
            f"{' '.join(cmd)}: no result in {timeout:g}s:\n{exc.stdout or ''}\n{exc.stderr or ''}"
        ) from exc
    except OSError as exc:
        raise FetchError(f"cannot run {cmd[0]}: {exc.strerror}") from exc
    if proc.returncode != 0:
        raise FetchError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")


if __name__ == "__main__":
    print(ensure_mps_control(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE, *sys.argv[2:3]))
