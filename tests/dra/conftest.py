"""Fixtures of the DRA tests: the stand-in API server and a KUBECONFIG pointing at it."""
from tests.dra.apiserver import apiserver, kubeconfig  # noqa: F401 (fixtures)
from tests.inventory.conftest import fake_nvml_lib, nvml_config  # noqa: F401 (fixtures)
