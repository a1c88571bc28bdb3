"""The MPS v3 stand-in's binary (tests/sharing/conftest.py), for the v3 control protocol's tests."""

from tests.sharing.conftest import fake_v3_binary  # noqa: F401 (fixture)
