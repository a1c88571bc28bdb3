"""What the node has, as NVML says (the one module that speaks NVML, through pynvml): GPUs, MPS
clients, driver version (nvml.py), and MIG instances as NVML describes them (mig.py).

May import mpsd.errors only."""
