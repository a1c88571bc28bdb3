"""The real control daemon's fixtures (tests/mpsfixtures.py), shared by tests/daemon, tests/lifecycle
and tests/config."""

from tests.mpsfixtures import make_config, mps_dirs, procs, run_supervisor  # noqa: F401 (fixtures)
