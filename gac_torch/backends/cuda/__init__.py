"""The cuda target: linalg -> GPU kernels -> NVVM -> PTX, launched with the CUDA driver API."""

from gac_torch.backends.cuda.target import TARGET

__all__ = ["TARGET"]
