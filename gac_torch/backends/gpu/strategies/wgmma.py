"""`wgmma`: a matmul-like contraction on f16/bf16 operands (f32 ones as TF32 when allowed) on
sm_90a, large enough to fill the GPU and laid out so TMA can read it (16-byte aligned strides):
warpgroup wgmma fed by TMA through an mbarrier pipeline (gac_torch/kernels/wgmma_gemm.py). What
it does not take goes on to `mma` (the matcher's analysis is mma.py's).

The shared lowering accumulates an f16/bf16 matmul in an f32 buffer and rounds it in the next
elementwise op; when that op does nothing else, the kernel stores the rounded values into its
output directly (the staged / paired stores). Any other elementwise consumer chain the
implicit-GEMM epilogue takes (bias, activation, residual add, output cast: epilogue.py's
`fused_epilogue`) runs in the kernel's store instead (GAC_WGMMA_EPILOGUE_FUSION=0: never). Either
way the consumer is erased by `fused`, first in the strategy list.
GAC_WGMMA=0 bisects (everything goes on to mma)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from mlir import ir

from gac_torch.backends.gpu import tuning
from gac_torch.backends.gpu.analysis import Generic, analyze, map_dims
from gac_torch.backends.gpu.irutil import buffer_root, defining_op, ops_after, ops_between, users
from gac_torch.backends.gpu.strategies import merged_rows, mma
from gac_torch.backends.gpu.strategies.epilogue import FUSED, fused_epilogue, rename_from
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template, template_text
from gac_torch.kernels import wgmma_gemm, wgmma_plan
from gac_torch.kernels.cuda_mma import Spec
from gac_torch.lowering.structured import CONV_CONTRACTION


def _rounding_consumer(g: Generic, fill: Any) -> Generic | None:
    """The generic after `g` whose only work is rounding g's f32 result (a temp nobody else
    uses) to f16/bf16, elementwise over the same shape; None if there is none."""
    y = g.outputs[0]
    root = buffer_root(y)
    alloc = defining_op(root)
    if fill is None or y != root or alloc is None or alloc.name != "memref.alloc":
        return None
    others = [u for u in users(root) if u not in (g.op, fill[0]) and u.name != "memref.dealloc"]
    if len(others) != 1 or others[0].name != "linalg.generic":
        return None
    r = analyze(others[0])
    if (r is None or r.inputs != [y] or len(r.outputs) != 1 or set(r.iters) != {"parallel"}
            or any(not m.is_permutation or list(m.results) != list(ir.AffineMap.get_identity(m.n_dims).results)
                   for m in r.maps)):
        return None
    out = r.outputs[0]
    if ir.MemRefType(out.type).shape != ir.MemRefType(y.type).shape:
        return None
    body = [op.name for op in r.op.regions[0].blocks[0].operations]
    if body != ["arith.truncf", "linalg.yield"] or str(ir.MemRefType(out.type).element_type) not in ("f16", "bf16"):
        return None
    d = defining_op(out)
    while d is not None and d.name != "memref.alloc":  # the output and its views must exist at g
        if g.op.is_before_in_block(d):
            return None
        d = defining_op(d.operands[0])
    if d is not None and g.op.is_before_in_block(d):
        return None
    return r


def _merged_epilogue(fused: Any, rows: merged_rows.Rows) -> Any:
    """epilogue.py's epilogue with its operands over the contraction's dims addressed through
    the merged M dim; None where one is not linear in it."""
    ops, ep, values = fused
    merged = []
    for x in (*ep.inputs, ep.out):
        if x is None or x[1] is not None:  # Y itself, or an operand over its own space
            merged.append(x)
            continue
        op = rows.merge_coef(x[0])
        if op is None:
            return None
        merged.append((op, None))
    return ops, replace(ep, inputs=tuple(merged[:-1]), out=merged[-1]), values


def _read_permuted(g: Generic) -> bool:
    """The next reader of g's result reads it through a permutation (the NCHW output of an NHWC
    conv chain): igemm's epilogue permutes its loops and fuses it, this one cannot."""
    root = buffer_root(g.outputs[0])
    for op in ops_after(g.op):  # (the reader is near: listing the host block cost more)
        r = analyze(op) if op.name == "linalg.generic" else None
        reads = [m for v, m in zip(r.inputs, r.maps) if buffer_root(v) == root] if r is not None else []
        if reads:
            return any(map_dims(m) != list(range(m.n_dims)) for m in reads)
    return False


def _tuned_plan(spec: Spec) -> wgmma_plan.Plan | None:
    """The heuristic tile width (256 once it still fills the GPU, narrower for a narrow N or a
    short K), or another where the GPU measured it faster for this problem (gpu/tuning.py; 64
    only a candidate for N <= 128)."""
    plan = wgmma_plan.plan(spec)
    if plan is None:
        return None
    alts = {f"bn{bn}": p for bn in (64, 128, 256)[spec.N > 128:]
            if (p := wgmma_plan.plan(spec, bn=bn)) is not None}
    if len(alts) < 2 or f"bn{plan.bn}" not in alts:
        return plan
    key = f"wgmma:{spec.kind}:{tuning.problem_key(spec)}"
    return alts[tuning.choose(key, tuple(alts), f"bn{plan.bn}")]


def strategy(allow_tf32: bool, conv_allow_tf32: bool = False) -> Strategy:
    """`allow_tf32`: f32 matmuls may run in TF32; `conv_allow_tf32`: likewise f32 convolutions
    (torch.backends.cudnn.allow_tf32): a 1x1 conv arrives as a plain contraction marked
    CONV_CONTRACTION (lowering/structured.py; NHWC, its M the run n, h, w)."""
    def match(g: Generic, limits: GpuLimits):
        if os.environ.get("GAC_WGMMA") == "0":
            return None
        conv = CONV_CONTRACTION in g.op.attributes
        if conv and _read_permuted(g):
            return None  # (igemm)
        allow_tf32_here = conv_allow_tf32 if conv else allow_tf32
        m = mma.match_spec(g, allow_tf32_here)
        rows = None  # several M dims (nn.Linear on 3-D inputs) merged into one
        if m is None:
            mr = merged_rows.merged_spec(g, allow_tf32_here)
            if mr is None:
                return None
            spec, fill, rows = mr
        else:
            _, spec, fill = m
        rounding = _rounding_consumer(g, fill)
        if rounding is not None and rows is not None and not rows.has_run(rounding.outputs[0], g.maps[2]):
            rounding = None
        if rounding is not None:
            c = mma.operand(rounding.outputs[0], g.maps[2])
            spec = Spec(**{**spec.__dict__, "c": rows.merge(c) if rows is not None else c})
        oriented = wgmma_plan.orient(spec)  # (tf32, B N-major: C^T = B^T A^T)
        plan = _tuned_plan(oriented)
        return None if plan is None else (g, oriented, plan, fill, rounding, oriented is not spec, rows)

    def emit(m, name: str, limits: GpuLimits) -> bool:
        g, spec, plan, fill, rounding, swapped, rows = m
        out = rounding.outputs[0] if rounding is not None else g.outputs[0]
        acc = str(ir.MemRefType(g.outputs[0].type).element_type)  # the fill's type
        fused = None
        if rounding is None and os.environ.get("GAC_WGMMA_EPILOGUE_FUSION") != "0":
            fused = fused_epilogue(g, list(g.inputs), fill[0] if fill is not None else None)
        if fused is not None and rows is not None:
            fused = _merged_epilogue(fused, rows)
        extra: list[ir.Value] = []
        if fused is not None:  # as implicit_gemm._emit: what the epilogue reads exists at g
            for op in ops_between(g.op, fused[0][-1]):
                if op not in fused[0]:
                    op.move_before(g.op)
            if buffer_root(fused[2][-1]) in {buffer_root(v) for v in g.inputs}:
                fused[2][-1] = rename_from(fused[2][-1], fused[0][-1], g.op)
            spec = wgmma_plan.GemmSpec(**{**spec.__dict__, "epilogue": fused[1]})
            plan = wgmma_plan.stage_epilogue(spec, replace(plan, pair_store=False, staged_store=False))
            extra = fused[2]
        elif rounding is None:  # (an f32 C with a short K: through shared memory, 5d)
            plan = wgmma_plan.stage_c(spec, plan)
        a_in = g.inputs[0]
        if rows is not None:  # A and C through views with the M run as one dim
            a_in, out = rows.collapse(a_in, g.maps[0], g.op), rows.collapse(out, g.maps[2], g.op)
        ins = [a_in, g.inputs[1]][::-1 if swapped else 1]  # the kernel's A, B
        text = template_text(("wgmma", spec, plan, acc), lambda: wgmma_gemm.template(spec, plan, acc))
        splice_template(text, g.op, [*ins, out, *extra],
                        fill[1] if fill is not None else None, acc, name)
        if rows is not None and not list(out.uses):  # (C unused: the epilogue writes Z)
            out.owner.erase()
        if fill is not None:
            fill[0].erase()
        g.op.erase()
        # the consumers are erased by `fused` when the scheduler reaches them
        for op in fused[0] if fused is not None else [rounding.op] if rounding is not None else []:
            op.attributes[FUSED] = ir.UnitAttr.get()
        return True

    return Strategy("wgmma", match, emit)
