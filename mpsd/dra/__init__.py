"""The DRA driver: ResourceSlices through the API server, claims prepared for the kubelet."""
