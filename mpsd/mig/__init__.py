"""MIG glue for ``mpsd run``: one MPS control daemon per MIG instance (fleet.py), wired into the
run (node.py), its device-plugin face with a resource per profile (plugin.py), its metrics
(metrics.py). Instances as NVML sees them are mpsd.inventory.mig; their slices are
mpsd.sharing.mig.

A face: may import mpsd.plugin, mpsd.lifecycle and everything below; only the composition root
imports it."""
