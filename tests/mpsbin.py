"""Fetch the real ``nvidia-cuda-mps-control`` from Debian's non-free archive, without a system change.

Debian ships the binary (package ``nvidia-cuda-mps``) in several driver versions, one per
suite (:data:`VERSIONS`). We write a private sources list that names the machine's Debian
mirror (deb.debian.org where the machine has none) with that suite's ``non-free``
component, point apt's lists and cache at a directory we own, ``apt-get download`` the
package there and unpack it with ``dpkg-deb -x``. Nothing under /etc or /var is touched.
The archive keys come from the machine's ``debian-archive-keyring``.

Which versions a test run uses: ``MPSD_TEST_MPS_VERSIONS`` (comma-separated ids of
:data:`VERSIONS`, or ``all``; default :data:`DEFAULT_VERSION`). docs/mps-versions.md says
what differs between them.

    python -m tests.mpsbin [VERSION|all] [CACHE_DIR]     # prints each binary's path
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "nvidia-cuda-mps"
BINARY = Path("usr/bin/nvidia-cuda-mps-control")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / ".cache" / "mps"
SOURCE_FILES = (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"))
FALLBACK_URI = "http://deb.debian.org/debian"
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")  # package debian-archive-keyring
# id (the driver version it names) -> the Debian suite that carries it (as of November 2026)
VERSIONS = {
    "535.261": "bookworm",
    "535.216": "bookworm-backports",
    "550.163": "trixie",
    "555.58": "experimental",
}
DEFAULT_VERSION = "535.261"
VERSIONS_ENV = "MPSD_TEST_MPS_VERSIONS"
# the version string the binary carries (".rodata"), e.g. 535.261.03
_EMBEDDED_VERSION = re.compile(rb"\x00([1-9][0-9]{2}\.[0-9]{1,3}\.[0-9]{2})\x00")


class FetchError(RuntimeError):
    """The package could not be fetched; the message carries apt's output."""


def selected_versions(value: str | None = None) -> list[str]:
    """The version ids a run uses, from ``MPSD_TEST_MPS_VERSIONS`` (or ``value``): the first
    is the one tests that need just some daemon use. ValueError names a bad id."""
    text = (os.environ.get(VERSIONS_ENV, "") if value is None else value).strip()
    if not text:
        return [DEFAULT_VERSION]
    if text == "all":
        return list(VERSIONS)
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VERSIONS]
    if unknown or not chosen:
        raise ValueError(f"{VERSIONS_ENV}={text!r}: expected 'all' or ids from {', '.join(VERSIONS)}")
    return list(dict.fromkeys(chosen))


# What the versions do differently, seen on the binaries (docs/mps-versions.md): tests that
# pin a daemon behaviour ask these rather than assume the default version's.


def branch(version: str) -> int:
    """The driver branch of a version id: 535, 550, 555."""
    return int(version.split(".")[0])


def takes_defaults_from_any_uid(version: str) -> bool:
    """535 takes set_default_* from every UID; 550+ only from root and the daemon's own user."""
    return branch(version) < 550


def knows_server_status(version: str) -> bool:
    """get_server_status (INITIALIZING / ACTIVE / FAULT) came with 550."""
    return branch(version) >= 550


def knows_multiuser_server(version: str) -> bool:
    """-f -multiuser-server (one root server for every UID) came with 555."""
    return branch(version) >= 555


def embedded_version(binary: Path) -> str | None:
    """The driver version string inside the binary (``535.261.03``), None if none is found."""
    found = _EMBEDDED_VERSION.findall(Path(binary).read_bytes())
    return found[0].decode() if found else None


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
        fields = {
            m.group(1).lower(): m.group(2).split() for m in re.finditer(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M)
        }
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


def mirror_uri() -> str:
    """The machine's Debian mirror, or deb.debian.org: every suite of VERSIONS is on both."""
    try:
        return debian_source()[0]
    except FetchError:
        return FALLBACK_URI


def cache_for(version: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Where ``version`` is unpacked: the default version in ``cache_dir`` itself (the layout
    scripts and benchmarks expect, .cache/mps/root/...), every other in a folder of its id."""
    return Path(cache_dir) if version == DEFAULT_VERSION else Path(cache_dir) / version


def ensure_mps_control(cache_dir: Path = DEFAULT_CACHE, version: str = DEFAULT_VERSION) -> Path:
    """Path of the unpacked ``nvidia-cuda-mps-control`` of ``version`` (an id of VERSIONS),
    fetched once into ``cache_dir``. FetchError when apt fails or the suite now carries
    another driver branch than the id names (update VERSIONS and docs/mps-versions.md)."""
    if version not in VERSIONS:
        raise FetchError(f"unknown MPS version {version!r}: expected one of {', '.join(VERSIONS)}")
    work = cache_for(version, cache_dir).resolve()
    root = work / "root"
    binary = root / BINARY
    if binary.is_file() and _same_branch(embedded_version(binary), version):
        return binary
    shutil.rmtree(root, ignore_errors=True)  # another version (an older cache layout): fetched again
    suite = VERSIONS[version]
    for sub in ("lists/partial", "apt/archives/partial", "debs"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    for old in (work / "debs").glob(f"{PACKAGE}_*.deb"):
        old.unlink()
    sources = work / "sources.list"
    signed = f"[signed-by={KEYRING}] " if KEYRING.is_file() else ""  # else apt's trusted keys
    sources.write_text(f"deb {signed}{mirror_uri()} {suite} non-free\n")
    apt = [
        "apt-get",
        "-q",
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={work / 'lists'}",
        f"-oDir::Cache={work / 'apt'}",
        "-oAPT::Sandbox::User=root",
    ]
    _run(apt + ["update"], cwd=work)
    _run(apt + ["download", PACKAGE], cwd=work / "debs")
    debs = sorted((work / "debs").glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise FetchError(f"apt-get download {PACKAGE} ({suite}) left no .deb in {work / 'debs'}")
    _run(["dpkg-deb", "-x", str(debs[-1]), str(root)], cwd=work)
    if not binary.is_file():
        raise FetchError(f"{debs[-1].name} has no {BINARY}")
    found = embedded_version(binary)
    if not _same_branch(found, version):
        raise FetchError(
            f"{suite} now carries {debs[-1].name} (binary version {found}), not the {version.split('.')[0]} "
            f"branch that MPS version {version} names: update VERSIONS in tests/mpsbin.py and docs/mps-versions.md"
        )
    return binary


def _same_branch(found: str | None, version: str) -> bool:
    return found is not None and found.split(".")[0] == version.split(".")[0]


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
    wanted = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VERSION
    where = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_CACHE
    for one in selected_versions(wanted):
        path = ensure_mps_control(where, one)
        print(f"{one}\t{embedded_version(path)}\t{path}")
