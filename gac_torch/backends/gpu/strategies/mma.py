"""`mma`: a matmul-like contraction on f16/bf16 operands, or f32 ones when TF32 is allowed, on
sm_80+: tensor cores with mma.sync (gac_torch/kernels/cuda_mma.py), f32 accumulators. Static
shapes only; a contraction it does not take goes on to the next strategy (e.g. `matmul`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlir import ir

from gac_torch.backends.gpu.analysis import Contraction, Generic, fill_before, map_dims, match_contraction
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_fused
from gac_torch.kernels import cuda_mma


@dataclass
class _Match:
    c: Contraction
    spec: cuda_mma.Spec
    plan: cuda_mma.Plan
    fill: tuple[ir.Operation, ir.Value] | None


def operand(v: ir.Value, m: ir.AffineMap) -> cuda_mma.Operand:
    t = ir.MemRefType(v.type)
    strides, offset = t.get_strides_and_offset()
    return cuda_mma.Operand(str(t), str(t.element_type), tuple(map_dims(m) or ()), tuple(t.shape),
                            tuple(strides), offset)


def match_spec(g: Generic, allow_tf32: bool) -> tuple[Contraction, cuda_mma.Spec, Any] | None:
    """The contraction, its tensor-core Spec and the fill folded in, or None (not a float
    contraction on static shapes whose element types a tensor core takes). Also wgmma.py's."""
    c = match_contraction(g)
    if c is None or not c.is_float or g.dynamic:
        return None
    kind = tensor_core_kind(g, c.a_casts, c.b_casts, allow_tf32)
    if kind is None:
        return None
    fill = fill_before(g.op, g.outputs[0])
    spec = cuda_mma.Spec(kind, c.m, c.n, c.k, tuple(c.batch), tuple(g.ranges),
                         operand(g.inputs[0], g.maps[0]), operand(g.inputs[1], g.maps[1]),
                         operand(g.outputs[0], g.maps[2]), fill is not None)
    return c, spec, fill


def tensor_core_kind(g: Generic, a_casts: list, b_casts: list, allow_tf32: bool) -> str | None:
    """The tensor-core kind of a float contraction whose body casts A and B by `a_casts` /
    `b_casts` (only widening to f32, and only into an f32 result), or None."""
    ea, eb = (str(ir.MemRefType(v.type).element_type) for v in g.inputs)
    ec = str(ir.MemRefType(g.outputs[0].type).element_type)
    widen = [("arith.extf", "f32")]
    casts_ok = (a_casts in ([], widen) and b_casts in ([], widen)
                and (ec == "f32" or (not a_casts and not b_casts)))
    return cuda_mma.mma_kind(ea, eb, ec, casts_ok, allow_tf32)


def strategy(allow_tf32: bool) -> Strategy:
    """`allow_tf32`: f32 matmuls may run on tensor cores in TF32 (a numerics option)."""

    def match(g: Generic, limits: GpuLimits) -> _Match | None:
        m = match_spec(g, allow_tf32)
        if m is None:
            return None
        c, spec, fill = m
        plan = cuda_mma.plan(spec, limits.max_grid, limits.max_static_shared_bytes)
        return None if plan is None else _Match(c, spec, plan, fill)

    def emit(m: _Match, name: str, limits: GpuLimits) -> bool:
        splice_fused(cuda_mma.template(m.spec, m.plan), m.c.g, m.fill, m.spec.c.elem, name)
        return True

    return Strategy("mma", match, emit)
