"""The other two buckets: ops torch's decomposition expands into ops we lower, and ops that
always run eagerly, each with its reason."""

from __future__ import annotations

from gac_torch.legalize.registry import aten, decompose, fallback

fallback("data-dependent output shape", aten.nonzero.default)
