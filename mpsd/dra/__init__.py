"""Dynamic Resource Allocation (DRA): mpsd as a DRA driver; ResourceSlices through the API server,
claims prepared for the kubelet."""
