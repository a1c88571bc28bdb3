"""The allocation core both kubelet faces share (the device plugin and the DRA driver): slice
arithmetic (slicing.py), what a container gets for its slice (container.py, with clientenv.py
and frameworks.py), its fresh allocation directory (allocdir.py), the journal of allocations
(state.py, sharedlock.py), the region accounting read back (usage.py), and the kubelet-facing
unix socket each face serves (served.py).

A face reuses these, never copies them. May import mpsd.units, mpsd.errors, mpsd.logs,
mpsd.trees; nothing above."""
