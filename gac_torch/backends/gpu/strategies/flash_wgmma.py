"""`fa3` (kernels gac_k<i>_fa3): a gac.attention call that the Hopper kernel takes (f16/bf16,
no mask, head dims 16/32/64/128, TMA-readable buffers; gac_torch/kernels/flash_wgmma.py) on
sm_90a, before `flash` (mma.sync), which takes the rest. By default only for head dims >= 64:
measured on the H200 (2026-12-02), 4x16x4096x64 bf16 took 0.646 ms against mma.sync's 0.945
(eager 0.591), but 8x8x2500x32 0.39-0.47 ms against 0.27. GAC_FLASH_WGMMA=1 takes every head dim
it can, 0 none."""

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


MIN_HEAD_DIM = 64  # (by default: below it the mma.sync kernel was faster)


def enabled(head_dim: int) -> bool:
    mode = os.environ.get("GAC_FLASH_WGMMA", "auto")
    return mode == "1" or (mode == "auto" and head_dim >= MIN_HEAD_DIM)


def strategy() -> Strategy:
    def match(c: AttentionCall, limits: GpuLimits) -> _Match | None:
        if len(c.op.operands) != 3:
            return None
        bufs = [buf_of(v.type) for v in c.op.operands] + [buf_of(c.op.results[0].type)]
        if any(x is None for x in bufs):
            return None
        kind = fa.kind_for(bufs[0].elem, False)  # type: ignore[union-attr]
        if kind not in ("f16", "bf16"):
            return None
        spec = fa.Spec(kind, *bufs, None, c.mask, c.scale, c.causal)  # type: ignore[arg-type]
        if not enabled(spec.D):
            return None
        plan = fw.plan(spec)
        return None if plan is None else _Match(c.op, spec, plan)

    return Strategy("fa3", match, emitter(template), on="attention")
