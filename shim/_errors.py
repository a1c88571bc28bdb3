"""Errors of the shim's Python side, part of the package-wide tree in mpsd/errors.py."""

from __future__ import annotations

from mpsd.errors import MpsdError, SetupError


class ShimError(MpsdError):
    """Base class for the shim's Python side."""


class ShimNotFound(ShimError, SetupError):
    """libmpsshim.so is not where it was looked for; the message says how to build it."""


class RegionError(ShimError):
    """An accounting region could not be read. ``reason``, one word: ``missing`` (no such
    file), ``unreadable`` (it cannot be opened), ``not_regular`` (a symlink, FIFO, device or
    directory, refused unopened), ``too_large`` (bigger than any region) or ``corrupted`` (the
    library refused its contents: layout, size or version)."""

    def __init__(self, message: str, reason: str = "corrupted") -> None:
        super().__init__(message)
        self.reason = reason
