"""Where libmpsshim.so is: MPSSHIM_LIBRARY if set, else next to this package."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from ._errors import ShimNotFound

log = logging.getLogger(__name__)

LIBRARY_NAME = "libmpsshim.so"
LIBRARY_ENV = "MPSSHIM_LIBRARY"
PACKAGE_DIR = Path(__file__).resolve().parent


def library_path(environ: Mapping[str, str] | None = None, package_dir: Path = PACKAGE_DIR) -> Path:
    """The absolute path of libmpsshim.so, checked to exist.

    ``$MPSSHIM_LIBRARY`` wins when set (and must name an existing file); otherwise the library
    built next to the package by ``pip install`` (or ``make -C csrc OUT=...``)."""
    env = os.environ if environ is None else environ
    override = env.get(LIBRARY_ENV)
    if override:
        path = Path(override).expanduser().resolve()
        if not path.is_file():
            raise ShimNotFound(
                f"{LIBRARY_ENV}={override!r} does not name a file; unset it or point it at a built {LIBRARY_NAME}"
            )
        log.debug("library source=env path=%s", path)
        return path
    path = Path(package_dir).resolve() / LIBRARY_NAME
    if not path.is_file():
        raise ShimNotFound(
            f"{LIBRARY_NAME} not found at {path}; build it with `pip install -e .` or "
            f"`make -C csrc OUT={path}`, or set {LIBRARY_ENV} to a built copy"
        )
    log.debug("library source=package path=%s", path)
    return path
