"""Dynamic Resource Allocation (DRA): mpsd as a DRA driver; ResourceSlices through the API server,
claims prepared for the kubelet."""

from .. import grpcready  # noqa: F401  (first: one line, not a traceback, if grpcio is too old)
