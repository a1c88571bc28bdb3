"""shim.framework_env: mpsd.frameworks, the one source of the framework variables."""

from mpsd.frameworks import FRAMEWORKS, framework_env

__all__ = ["FRAMEWORKS", "framework_env"]
