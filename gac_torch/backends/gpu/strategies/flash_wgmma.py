"""`fa3` (kernels gac_k<i>_fa3): a gac.attention call that the Hopper kernel takes (f16/bf16,
no mask, head dims 16/32/64/128, TMA-readable buffers; gac_torch/kernels/flash_wgmma.py) on
sm_90a, before `flash` (mma.sync), which takes the rest. Opt-in while unmeasured:
GAC_FLASH_WGMMA=1."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mlir import ir

from gac_torch.backends.gpu.attention import AttentionCall
from gac_torch.backends.gpu.strategies.flash_attention import buf_of, emitter
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.kernels import flash_attention as fa
from gac_torch.kernels import flash_wgmma as fw
from gac_torch.kernels.flash_wgmma_text import template


@dataclass
class _Match:
    call: ir.Operation
    spec: fa.Spec
    plan: fw.Plan


def enabled() -> bool:
    return os.environ.get("GAC_FLASH_WGMMA", "0") == "1"


def strategy() -> Strategy:
    def match(c: AttentionCall, limits: GpuLimits) -> _Match | None:
        if not enabled() or len(c.op.operands) != 3:
            return None
        bufs = [buf_of(v.type) for v in c.op.operands] + [buf_of(c.op.results[0].type)]
        if any(x is None for x in bufs):
            return None
        kind = fa.kind_for(bufs[0].elem, False)  # type: ignore[union-attr]
        if kind not in ("f16", "bf16"):
            return None
        spec = fa.Spec(kind, *bufs, None, c.mask, c.scale, c.causal)  # type: ignore[arg-type]
        plan = fw.plan(spec)
        return None if plan is None else _Match(c.op, spec, plan)

    return Strategy("fa3", match, emitter(template), on="attention")
