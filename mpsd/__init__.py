"""mpsd: GPU sharing for inference nodes on NVIDIA MPS."""

__version__ = "0.1.0"
