"""ATen -> gac legalization: the registry and one module per op family."""

from gac_torch.legalize import (  # noqa: F401 (registers)
    attention, buckets, indexing, norm, pointwise, reduction, resample, shape, structured,
)
from gac_torch.legalize.context import LegalizeError, build_module, node_support
from gac_torch.legalize.registry import REGISTRY, decompositions, lowered_ops

__all__ = ["REGISTRY", "LegalizeError", "build_module", "decompositions", "lowered_ops", "node_support"]
