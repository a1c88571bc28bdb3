"""Prometheus: the families' common base (base.py), the node's own families (node.py: the daemon,
the GPUs, ``mpsd exec``'s regions), the accounting of those regions (regions.py), and the HTTP
server of /metrics, /healthz and /readyz (http.py). Each face keeps its own families
(mpsd/plugin/metrics.py, mpsd/dra/metrics.py, mpsd/mig/metrics.py); mpsd/registry.py puts them
in one registry.

May import mpsd.inventory, mpsd.config and the base modules; no face."""
