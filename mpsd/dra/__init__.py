"""Dynamic Resource Allocation (DRA): mpsd as the kubelet's DRA driver for GPU slices enforced by MPS and the shim."""
