"""Real containers for tests: podman + runc from Debian, a busybox image, bounded runs.

    def test_x(podman):                       # session fixture from tests/conftest.py
        result = podman.run(["cat", "/data/f"], mounts=[Mount(host_dir, "/data")])
        assert result.returncode == 0, result.output

What a run gets, and why:

- **Image**: ``podman import`` of a directory holding ``/bin/busybox`` (from ``busybox-static``)
  and its ``busybox --install`` links, plus empty ``/tmp``, ``/dev``, ``/proc`` ... Anything else
  a test needs comes in by bind mount (``Mount``); ``HOST_LIBS`` mounts the host's C library
  read-only so that a dynamically linked host binary (the real ``nvidia-cuda-mps-control``) runs.
- **Isolation**: one podman state per test session (``--root``/``--runroot``/``--tmpdir`` under a
  private directory, storage driver ``vfs``, file locks and file events instead of the
  machine-wide SHM lock table and journald), removed at the end; podman's own state on the
  machine is never touched.
- **Sandbox flags**: ``--runtime runc --cgroup-manager cgroupfs --network none --ulimit
  nofile=1024:1024 --ulimit nproc=1024:1024 --pull never`` (the machine's hard limits are lower
  than podman's defaults, and it has no network).
- **Bounded**: every run has a timeout; on expiry the container is removed with ``rm -f -t 0``
  and the client's process group killed; ``RunResult.timed_out`` says so.
- **CDI** (``devices=["mpsd.io/claim=NAME"], cdi_spec_dir=DIR``): podman 4.3 (Debian 12) resolves
  CDI names (a spec with ``cdiVersion`` 0.5.0, env and bind mounts, was seen applied; newer
  versions not tried) but has no ``--cdi-spec-dir`` and ignores ``cdi_spec_dirs`` in
  containers.conf (seen: "unresolvable CDI devices"); it reads only ``/etc/cdi`` and ``/var/run/cdi``. So the
  run happens in a private mount namespace (``unshare --mount``) where ``DIR`` is bind-mounted
  over ``/var/run/cdi``: the host's directory is not written (only created, empty, if missing).

Skips: ``podman_unavailable()`` names why podman cannot run here (not installed, or a trial run
fails); the ``podman`` fixture skips with that reason, unless ``MPSD_REQUIRE_CONTAINERS=1`` (CI
installs podman: there a broken podman fails the tests instead of hiding them).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
IMAGE = "localhost/mpsd-test-busybox:1"
RUN_FLAGS = (
    "--network", "none",
    "--ulimit", "nofile=1024:1024",
    "--ulimit", "nproc=1024:1024",
    "--pull", "never",
)
CDI_DIR = "/var/run/cdi"
_CONF = '[engine]\nlock_type = "file"\nevents_logger = "file"\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'


@dataclass(frozen=True)
class Mount:
    """A bind mount: host path -> container path, read-only unless ``read_only=False``."""

    host: str | os.PathLike[str]
    container: str
    read_only: bool = True

    def flag(self) -> str:
        return f"--volume={os.fspath(self.host)}:{self.container}:{'ro' if self.read_only else 'rw'}"


# The host's C library and loader, read-only: enough for a dynamically linked glibc program.
HOST_LIBS = tuple(Mount(p, p) for p in ("/lib", "/lib64", "/usr/lib") if os.path.isdir(p))


@dataclass(frozen=True)
class RunResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def output(self) -> str:
        """Everything the run printed, for assertion messages."""
        return f"$ {' '.join(self.argv)}\nexit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


@dataclass
class Podman:
    """One private podman state under ``state_dir``; ``image`` is imported on first use."""

    state_dir: Path
    _image_ready: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        (self.state_dir / "tmp").mkdir(parents=True, exist_ok=True)
        (self.state_dir / "containers.conf").write_text(_CONF)

    def global_args(self) -> list[str]:
        s = self.state_dir
        return [
            "podman", "--root", str(s / "root"), "--runroot", str(s / "run"), "--tmpdir", str(s / "tmp"),
            "--storage-driver", "vfs", "--events-backend", "file", "--cgroup-manager", "cgroupfs",
            "--runtime", "runc",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CONTAINERS_CONF"] = str(self.state_dir / "containers.conf")
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def podman(self, *args: str, timeout: float = 120) -> RunResult:
        """``podman <global flags> ARGS`` on this state; never raises on a non-zero exit."""
        argv = [*self.global_args(), *args]
        try:
            proc = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return RunResult(tuple(argv), -1, _text(exc.stdout), _text(exc.stderr), timed_out=True)
        return RunResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def ensure_image(self) -> str:
        if not self._image_ready:
            rootfs = self.state_dir / "rootfs"
            build_rootfs(rootfs)
            result = self.podman("import", str(_tar(rootfs, self.state_dir / "rootfs.tar")), IMAGE)
            if result.returncode != 0:
                raise ContainerError(f"podman import failed:\n{result.output}")
            self._image_ready = True
        return IMAGE

    def run(
        self,
        argv: Sequence[str],
        *,
        mounts: Sequence[Mount] = (),
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        devices: Sequence[str] = (),
        cdi_spec_dir: str | os.PathLike[str] | None = None,
        extra: Sequence[str] = (),
        timeout: float = 60,
    ) -> RunResult:
        """Run ``argv`` in a fresh container (removed afterwards) and wait at most ``timeout`` s.

        ``user``: ``"UID[:GID]"``; ``devices``: ``--device`` values (CDI names need
        ``cdi_spec_dir``); ``extra``: more ``podman run`` flags (``--ipc host``, ``--pid host`` ...).
        """
        image = self.ensure_image()
        name = f"mpsd-test-{uuid.uuid4().hex[:12]}"
        flags = ["run", "--rm", "--name", name, *RUN_FLAGS]
        flags += [m.flag() for m in mounts]
        flags += [f"--env={k}={v}" for k, v in (env or {}).items()]
        flags += [f"--user={user}"] if user else []
        flags += [f"--device={d}" for d in devices]
        cmd = [*self.global_args(), *flags, *extra, image, *argv]
        if cdi_spec_dir is not None:
            cmd = _with_cdi_dir(os.fspath(cdi_spec_dir), cmd)
        proc = subprocess.Popen(
            cmd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.podman("rm", "--force", "--time", "0", name, timeout=60)
            _kill_group(proc)
            out, err = proc.communicate(timeout=30)
            return RunResult(tuple(cmd), -1, out, err, timed_out=True)
        return RunResult(tuple(cmd), proc.returncode, out, err)

    def cleanup(self) -> None:
        self.podman("rm", "--all", "--force", "--time", "0", timeout=60)
        shutil.rmtree(self.state_dir, ignore_errors=True)


class ContainerError(RuntimeError):
    """The test image could not be built."""


def build_rootfs(rootfs: Path, busybox: Path = BUSYBOX) -> Path:
    """``rootfs/bin/busybox`` plus a link per applet (what ``busybox --install`` makes)."""
    bindir = rootfs / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    for sub in ("tmp", "dev", "proc", "sys", "etc", "run", "root"):
        (rootfs / sub).mkdir(exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    shutil.copy2(busybox, bindir / "busybox")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True, timeout=30)
    for applet in applets.stdout.split():
        link = bindir / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/tmp:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\nuser:x:1000:\n")
    return rootfs


def podman_unavailable(state_dir: Path | None = None) -> str | None:
    """Why podman cannot run a container here, or None when a trial run succeeds."""
    missing = [b for b in ("podman", "runc") if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
               is None]
    if missing:
        return f"not installed: {', '.join(missing)} (scripts/test.sh installs podman, runc, busybox-static)"
    if not BUSYBOX.is_file():
        return f"{BUSYBOX} missing (Debian package busybox-static)"
    own = state_dir is None
    podman = Podman(Path(tempfile.mkdtemp(prefix="mpsd-podman-")) if own else state_dir)
    try:
        podman.ensure_image()
        result = podman.run(["true"], timeout=120)
    except (ContainerError, OSError, subprocess.SubprocessError) as exc:
        return f"podman cannot build the test image: {exc}"
    finally:
        if own:
            podman.cleanup()
    if result.returncode != 0:
        return f"podman cannot run a container here:\n{result.output}"
    return None


def _with_cdi_dir(spec_dir: str, cmd: list[str]) -> list[str]:
    target = os.path.realpath(CDI_DIR)
    os.makedirs(target, exist_ok=True)
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", spec_dir, target, *cmd]


def _tar(rootfs: Path, out: Path) -> Path:
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(out), "."], check=True, timeout=60)
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""
