"""Dynamic Resource Allocation (DRA): mpsd as a DRA driver. ResourceSlices published through the
API server (slices.py, migdevices.py, publisher.py, keeper.py, taints.py over kubeapi.py, the one
module that speaks to the API server), claims prepared for the kubelet (kubeletplugin.py, thin
over prepared.py, the one place that changes prepared claims; cdi.py writes their CDI specs),
device health (devicehealth.py), wired by service.py.

A face: uses the allocation core (mpsd.alloc) and the sharing backend (mpsd.sharing), never the
device plugin's package; only the composition root imports it."""

from .. import grpcready  # noqa: F401  (first: one line, not a traceback, if grpcio is too old)
