"""`flash`: a gac.attention call with static shapes on sm_80+ as one flash-attention kernel
(gac_torch/kernels/flash_attention.py: mma.sync, online softmax, no score matrix in memory).
A call it does not take is inlined (backends/gpu/attention.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlir import ir

from gac_torch.backends.gpu.attention import AttentionCall, buffers, replace_call
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template
from gac_torch.kernels import flash_attention as fa
from gac_torch.kernels.flash_attention_text import template


@dataclass
class _Match:
    call: ir.Operation
    spec: fa.Spec
    plan: fa.Plan


def buf_of(t: ir.Type) -> fa.Buf | None:
    rt = ir.RankedTensorType(t)
    if not rt.has_static_shape:
        return None
    mt = ir.MemRefType.get(list(rt.shape), rt.element_type)
    strides, _ = mt.get_strides_and_offset()
    return fa.Buf(str(mt), str(rt.element_type), tuple(rt.shape), tuple(strides))


def strategy(allow_tf32: bool) -> Strategy:
    """`allow_tf32`: f32 attention may run its matmuls in TF32 (else 3xTF32, a numerics option)."""

    def match(c: AttentionCall, limits: GpuLimits) -> _Match | None:
        bufs = [buf_of(v.type) for v in c.op.operands] + [buf_of(c.op.results[0].type)]
        if any(b is None for b in bufs):
            return None  # run-time sizes: the unfused maths
        q, k, v, out = bufs[0], bufs[1], bufs[2], bufs[-1]
        kind = fa.kind_for(q.elem, allow_tf32)  # type: ignore[union-attr]
        if kind is None:
            return None
        mask = bufs[3] if len(c.op.operands) == 4 else None
        spec = fa.Spec(kind, q, k, v, out, mask, c.mask, c.scale, c.causal)  # type: ignore[arg-type]
        plan = fa.plan(spec, limits.max_grid, limits.max_static_shared_bytes)
        return None if plan is None else _Match(c.op, spec, plan)

    return Strategy("flash", match, emitter(template), on="attention")


def emitter(make: Callable[[Any, Any], str]) -> Callable[[Any, str, GpuLimits], bool]:
    """An attention strategy's emit: the kernel template `make(spec, plan)` spliced before the
    call, which then reads the kernel's output (for matches with .call, .spec and .plan)."""

    def emit(m: Any, name: str, limits: GpuLimits) -> bool:
        args = buffers(m.call)
        splice_template(make(m.spec, m.plan), m.call, args, None, "f32", name)
        replace_call(m.call, args[-1])
        return True

    return emit
