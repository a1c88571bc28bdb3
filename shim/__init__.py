"""The Python side of libmpsshim.so, the LD_PRELOAD memory-cap shim.

- ``library_path()``: where libmpsshim.so is (``$MPSSHIM_LIBRARY`` or next to this package).
- ``usage(region_path)``: per device, the cap, the bytes in use and the processes holding them,
  read from a container's accounting region (its ``MPSSHIM_REGION``) through the library.
- ``layout()``: the region layout the library creates and charges (mpsd installs it for
  containers as ``libmpsshim.so.<layout>``).
- ``framework_env(...)``: variables that make frameworks live within a capped slice.
- ``python -m shim path`` / ``python -m shim usage REGION [--json]`` on the command line.
"""

from ._errors import RegionError, ShimError, ShimNotFound
from ._frameworks import framework_env
from ._library import LIBRARY_ENV, library_path
from ._usage import DeviceUsage, ProcessUsage, layout, usage

__all__ = [
    "LIBRARY_ENV",
    "DeviceUsage",
    "ProcessUsage",
    "RegionError",
    "ShimError",
    "ShimNotFound",
    "framework_env",
    "layout",
    "library_path",
    "usage",
]
