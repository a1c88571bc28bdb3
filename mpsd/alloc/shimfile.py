"""Which shim file a container preloads: ``libmpsshim.so.<layout>``, one name per region layout.

The processes of a container share one region file, and every process of a container preloads
the file its ``LD_PRELOAD`` names, fixed when the container was allocated (Allocate's answer,
a claim's CDI spec). A process started after an mpsd upgrade must load a shim that drives the
region exactly as the container's older processes do, so mpsd never replaces a shim file with
one of another layout: each layout has a name of its own, written only with builds of that
layout (csrc/region.h: the layout changes with any change of the file or its protocol), always
by rename (a running process keeps the file it mapped). ``libmpsshim.so``, the name mpsd used
before layouts were named (layout 2), is never written again: containers started before the
upgrade keep preloading the shim they started with (docs/shim.md, "Upgrades").
"""

from __future__ import annotations

import re

from ..errors import PluginError
from .state import install_file

SHIM_LAYOUT = 3  # MS_LAYOUT_VERSION, csrc/region.h (tests/shim/test_upgrade.py asks the library)
SHIM_NAME = f"libmpsshim.so.{SHIM_LAYOUT}"
LEGACY_SHIM_NAME = "libmpsshim.so"  # layout 2: what mpsd installed before, never written again
CONTAINER_SHIM_DIR = "/run/mpsd-shim"


_NAME = re.compile(r"libmpsshim\.so(\.[0-9]{1,4})?")


def shim_name(value: object) -> str:
    """A shim file's name as a record keeps it: LEGACY_SHIM_NAME for None (a record written
    before layouts had names), else ``libmpsshim.so`` or ``libmpsshim.so.<layout>``."""
    if value is None:
        return LEGACY_SHIM_NAME
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise PluginError(f"bad shim file name {value!r}: expected libmpsshim.so or libmpsshim.so.<layout>")
    return value


def container_shim(name: str = SHIM_NAME) -> str:
    """The path a container preloads for the shim file ``name`` in shimHostDir."""
    return f"{CONTAINER_SHIM_DIR}/{name}"


def install_shim(library: str, shim_host_dir: str) -> str:
    """Install ``library`` (the shim built with this mpsd: layout SHIM_LAYOUT) into
    ``shim_host_dir`` as SHIM_NAME, atomically by rename; the installed path."""
    return install_file(library, shim_host_dir, SHIM_NAME)
