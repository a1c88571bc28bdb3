"""shim.framework_env: mpsd.alloc.frameworks, the one source of the framework variables."""

from mpsd.alloc.frameworks import FRAMEWORKS, framework_env

__all__ = ["FRAMEWORKS", "framework_env"]
