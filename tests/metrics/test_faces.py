"""mpsd.metrics.http is split by face (supervisor, device plugin, DRA): each module imports alone in a
fresh interpreter, so no face's package and mpsd.metrics.http import each other in a circle, and
Metrics still has every face's families in one registry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpsd.registry import Metrics


@pytest.mark.parametrize("module", ["mpsd.metrics.http", "mpsd.plugin", "mpsd.plugin.usage", "mpsd.dra.claimusage",
                                    "mpsd.metrics.node", "mpsd.plugin.metrics", "mpsd.dra.metrics"])
def test_each_face_imports_first_in_a_fresh_interpreter(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_metrics_has_every_faces_families() -> None:
    names = {f.name for f in Metrics().registry.collect()}
    assert {"mpsd_daemon_up", "mpsd_gpu_memory_total_bytes", "mpsd_region_memory_cap_bytes",
            "mpsd_allocation_memory_limit_bytes", "mpsd_claim_memory_bytes"} <= names
