"""EXCLUSIVE_PROCESS compute mode for the GPUs mpsd manages, restored on exit, via nvidia-smi.

NVIDIA recommends EXCLUSIVE_PROCESS under MPS so that only the MPS server uses the GPU; a
process that bypasses MPS then fails fast instead of time-slicing with it. The mode each
GPU had before is read first and put back by :meth:`ComputeMode.restore`.
"""

from __future__ import annotations

import logging
import subprocess

from ..errors import SetupError

log = logging.getLogger(__name__)

MODES = {
    "default": "DEFAULT",
    "exclusive_process": "EXCLUSIVE_PROCESS",
    "prohibited": "PROHIBITED",
    "exclusive_thread": "EXCLUSIVE_THREAD",
}


def parse_modes(output: str) -> dict[str, str]:
    """``nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader`` -> {index: MODE}."""
    modes: dict[str, str] = {}
    for line in output.splitlines():
        if not line.strip():
            continue
        index, sep, mode = line.partition(",")
        key = mode.strip().lower().replace(" ", "_")
        if not sep or key not in MODES:
            raise SetupError(f"unexpected nvidia-smi compute mode line {line!r}: expected INDEX, MODE")
        modes[index.strip()] = MODES[key]
    return modes


class ComputeMode:
    """Compute mode of ``devices`` (indices or UUIDs; None = every GPU)."""

    def __init__(self, nvidia_smi: str, devices: list[str] | None = None, timeout: float = 30.0) -> None:
        self.nvidia_smi = nvidia_smi
        self.devices = devices
        self.timeout = timeout
        self._saved: dict[str, str] = {}

    def _run(self, *args: str) -> str:
        cmd = [self.nvidia_smi, *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            raise SetupError(f"{' '.join(cmd)}: no answer in {self.timeout:g}s") from exc
        except OSError as exc:
            raise SetupError(f"cannot run {self.nvidia_smi!r}: {exc.strerror}") from exc
        if proc.returncode != 0:
            output = " | ".join(line for line in (proc.stdout + proc.stderr).splitlines() if line.strip())
            raise SetupError(f"{' '.join(cmd)} exited {proc.returncode}: {output}")
        return proc.stdout

    def current(self) -> dict[str, str]:
        args = ["--query-gpu=index,compute_mode", "--format=csv,noheader"]
        if self.devices:
            args += ["-i", ",".join(self.devices)]
        return parse_modes(self._run(*args))

    def set_exclusive(self) -> None:
        """Remember each GPU's mode, then set EXCLUSIVE_PROCESS where it differs. If one GPU
        fails, those already changed are put back before the SetupError is raised."""
        found = self.current()
        for index, mode in sorted(found.items()):
            if mode != "EXCLUSIVE_PROCESS":
                try:
                    self._run("-i", index, "-c", "EXCLUSIVE_PROCESS")
                except SetupError:
                    self.restore()
                    raise
                log.info("compute mode set gpu=%s old=%s new=EXCLUSIVE_PROCESS", index, mode)
            self._saved[index] = mode

    def restore(self) -> None:
        """Put back the modes :meth:`set_exclusive` found; errors are logged, every GPU tried."""
        saved, self._saved = self._saved, {}
        for index, mode in sorted(saved.items()):
            if mode == "EXCLUSIVE_PROCESS":
                continue
            try:
                self._run("-i", index, "-c", mode)
                log.info("compute mode restored gpu=%s mode=%s", index, mode)
            except SetupError as exc:
                log.error("compute mode restore failed gpu=%s mode=%s error=%s", index, mode, exc)
