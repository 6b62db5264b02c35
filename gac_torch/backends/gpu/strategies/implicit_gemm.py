"""Strategies `igemm` (tensor cores) and `sgemm` (exact f32, SIMT): a bufferized linalg.generic
that is a contraction over dim *sets* with affine operand maps -- a convolution (M = n, oh, ow;
N = f; K = c, kh, kw; batch = groups), or a GEMM with several M/N/K/batch dims or permuted
operands -- on the implicit-GEMM template gac_torch/kernels/conv_gemm.py.

Epilogue: when the op right after is an elementwise generic that is the result's only reader (a
bias, BatchNorm-eval, ReLU, residual add, output cast), it runs in the kernel's store step and
the intermediate buffer goes away.

Precision: f16/bf16 operands use mma.sync with f32 accumulators; f32 ones use TF32 tensor cores
when allowed (convolutions: torch.backends.cudnn.allow_tf32; other contractions: the matmul
flags), else the exact SIMT kernel.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from mlir import ir
from mlir.dialects import memref

from gac_torch.backends.gpu import tuning
from gac_torch.backends.gpu.analysis import (
    Generic, analyze, contraction_body, fill_before, map_dims, match_contraction,
)
from gac_torch.backends.gpu.irutil import (
    block_ops, buffer_root, defining_op, erase_if_unused, is_pending, ops_between,
    static_memref, users, users_now,
)
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template, template_text
from gac_torch.backends.gpu.strategies import sgemm_relayout, weight_layout
from gac_torch.backends.gpu.strategies.epilogue import (
    FUSED, affine_terms, erase_fused, fused_epilogue, operand_at, rename_from,
)
from gac_torch.kernels import conv_gemm, conv_gemm_plan, conv_gemm_text, cuda_mma
from gac_torch.lowering.structured import CONV_CONTRACTION


@dataclass(frozen=True)
class Params:
    mma: bool  # tensor cores (sm_80+)
    allow_tf32: bool = False  # f32 multi-dim contractions may use TF32 (the matmul flags)
    conv_allow_tf32: bool = False  # f32 convolutions likewise (torch.backends.cudnn.allow_tf32)
    fuse_epilogue: bool = True  # the elementwise consumer runs in the store step
    fuse_padding: bool = True  # a zero-padded input is read through bounds checks


@dataclass
class _Match:
    g: Generic
    spec: conv_gemm.Spec
    plan: conv_gemm_plan.Plan
    pads: list
    fill: tuple[ir.Operation, ir.Value] | None
    relayout: weight_layout.Relayout | None = None
    transposed: tuple[sgemm_relayout.Transposed | None, ...] = (None, None)  # (A, B): K-outer copies


def strategy(params: Params, simt: bool) -> Strategy:
    """`igemm` (simt=False: tensor-core kinds) or `sgemm` (simt=True: exact f32). Plain matmuls
    (`match_contraction`) are left by igemm to mma / wgmma; sgemm takes them too (static f32:
    its 128x128 register tiles beat simt_matmul's, which keeps dynamic shapes, casts and ints).
    GAC_IMPLICIT_GEMM=0 bisects both; GAC_SGEMM_PLAIN=0 only plain matmuls on sgemm."""
    plain_ok = simt and os.environ.get("GAC_SGEMM_PLAIN") != "0"

    def match(g: Generic, limits: GpuLimits) -> _Match | None:
        if os.environ.get("GAC_IMPLICIT_GEMM") == "0" or (
                not plain_ok and match_contraction(g) is not None):
            return None
        m = _match(g, limits, params)
        return m if m is not None and (m.spec.kind == "f32") == simt else None

    def emit(m: _Match, name: str, limits: GpuLimits) -> bool:
        return _emit(m, name, params)

    return Strategy("sgemm" if simt else "igemm", match, emit)


def fused_strategy() -> Strategy:
    """Erases the elementwise consumers an igemm/sgemm kernel took into its epilogue; first in
    the list (the consumer comes after its producer, which marked it)."""

    def emit(g: Generic, name: str, limits: GpuLimits) -> bool:
        erase_fused(g.op)
        return True

    return Strategy("fused", lambda g, limits: g if FUSED in g.op.attributes else None, emit)


def _match(g: Generic, limits: GpuLimits, params: Params, inner: int = 32) -> _Match | None:
    """The implicit-GEMM plan for `g`, or None (nothing is changed). `inner`: a K dim whose
    extent is a multiple of it goes innermost (weight_layout.c_inner)."""
    if len(g.inputs) != 2 or len(g.outputs) != 1 or g.dynamic:
        return None
    if not all(isinstance(v.type, ir.MemRefType) for v in (*g.inputs, *g.outputs)):
        return None
    out_dims = map_dims(g.maps[2])
    par = [d for d, t in enumerate(g.iters) if t == "parallel"]
    red = [d for d, t in enumerate(g.iters) if t == "reduction"]
    if out_dims is None or sorted(out_dims) != par or not red:
        return None
    body = contraction_body(g)
    if body is None or not body[2]:
        return None
    a_casts, b_casts, _ = body
    ops = [operand_at(v, m) for v, m in zip((*g.inputs, *g.outputs), g.maps)]
    if any(o is None for o in ops):
        return None
    # a zero padding written by a fill + copy right before is read through guards instead
    pads = [padding_of(g, i) if params.fuse_padding else None for i in range(2)]
    for i, pad in enumerate(pads):
        if pad is not None:
            ops[i] = pad[1]
    a, b, c = ops
    used_a = {d for d, k in enumerate(a.coef) if k}  # type: ignore[union-attr]
    used_b = {d for d, k in enumerate(b.coef) if k}  # type: ignore[union-attr]
    r = tuple(g.ranges)
    if any(d not in used_a or d not in used_b for d in red if r[d] > 1):
        return None
    batch = tuple(d for d in par if d in used_a and d in used_b)
    ms = [d for d in par if d in used_a and d not in used_b]
    ns = [d for d in par if d in used_b and d not in used_a]
    if any(d not in used_a and d not in used_b and r[d] > 1 for d in par):
        return None
    # each set outermost first by C's (K: B's, then A's) address step: unit-stride runs last
    ms.sort(key=lambda d: (-c.coef[d], d))  # type: ignore[union-attr]
    ns.sort(key=lambda d: (-c.coef[d], d))  # type: ignore[union-attr]
    ks = sorted(red, key=lambda d: (-b.coef[d], -a.coef[d], d))  # type: ignore[union-attr]
    conv = (any(not isinstance(e, ir.AffineDimExpr) for m in g.maps[:2] for e in m.results)
            or CONV_CONTRACTION in g.op.attributes)  # (a 1x1 conv as a plain contraction)
    # a zero-padded weight (a stem's channels padded to 4, passes/channels_last.py): c innermost
    # (the input's 16-byte vectors), the weight copied from the padded buffer into that order
    # (cwgmma's vectors, inner < 32: a's unit-stride K dim whenever it is whole vectors)
    moved = weight_layout.c_inner(ks, r, inner, a if pads[1] is not None or inner < 32 else None)  # type: ignore[arg-type]
    if conv and moved != ks and pads[1] is not None:
        pads[1], b = None, operand_at(g.inputs[1], g.maps[1])
        ops[1] = b
    relayout = None
    if conv and moved != ks and pads[1] is None:  # the weights copied into that K order
        relayout = weight_layout.relayout(g.inputs[1], g.maps[1], tuple(moved), r)
    if relayout is not None:
        b, ks = relayout.operand, moved
    elif moved != ks and weight_layout.keeps_runs(ks, moved, r, a, b):  # type: ignore[arg-type]
        ks = moved
    ms = ms or [d for d in par if r[d] == 1 and d not in batch][:1]
    ns = ns or [d for d in par if r[d] == 1 and d not in batch and d not in ms][:1]
    if not ms or not ns or math.prod(r[d] for d in ns) < 8:
        return None  # (N under one mma tile's 8, e.g. depthwise: the reduce/loops kernels)
    ea, eb, ec = a.elem, b.elem, c.elem  # type: ignore[union-attr]
    widen = [("arith.extf", "f32")]
    casts_ok = (a_casts in ([], widen) and b_casts in ([], widen)
                and (ec == "f32" or (not a_casts and not b_casts)))
    allow_tf32 = params.conv_allow_tf32 if conv else params.allow_tf32
    kind = cuda_mma.mma_kind(ea, eb, ec, casts_ok, allow_tf32) if params.mma else None
    if kind is None and ea == eb == ec == "f32" and not a_casts and not b_casts:
        kind = "f32"
    if kind is None:
        return None
    transposed: tuple[sgemm_relayout.Transposed | None, ...] = (None, None)
    if kind == "f32" and not conv:  # operands along K copied K-outer where it pays
        transposed = tuple(None if pads[i] is not None else sgemm_relayout.plan(
            g.inputs[i], g.maps[i], ops[i], tuple(ks), outer, batch, r, limits.max_grid)  # type: ignore[arg-type]
            for i, outer in ((0, ms), (1, ns)))
        a, b = (t.operand if t is not None else o for t, o in zip(transposed, (a, b)))
    fill = fill_before(g.op, g.outputs[0])
    spec = conv_gemm.Spec(kind, tuple(ms), tuple(ns), tuple(ks), batch, r, a, b, c,  # type: ignore[arg-type]
                          fill is not None)
    dynamic = 0 if os.environ.get("GAC_IGEMM_DYNAMIC_SMEM") == "0" else limits.max_dynamic_shared_bytes  # (bisects)
    plan = _tuned_plan(spec, limits, dynamic, params.mma, not conv)
    if plan is None:
        return None
    if plan.splits > 1:  # split-K adds into C: the fill runs first as its own kernel
        spec, fill = conv_gemm.Spec(**{**spec.__dict__, "fill": False}), None
    return _Match(g, spec, plan, pads, fill, relayout, transposed)


def _tuned_plan(spec: conv_gemm.Spec, limits: GpuLimits, dynamic: int, cp: bool, split_k: bool):
    """The heuristic tiling (128-wide tiles once they fill about a wave), or the other tile size
    (exact-f32 GEMMs: or 128-wide tiles with 32-deep K slices, or held by 128 threads, 8 x 16
    accumulators each) where the GPU measured it faster for this problem (gpu/tuning.py).
    cp.async needs sm_80+ (as mma.sync); split-K is for plain GEMMs, never convolutions."""
    def make(big: bool | None, bk: int | None = None, threads: int = 256) -> conv_gemm_plan.Plan | None:
        return conv_gemm_plan.plan(spec, limits.max_grid, limits.max_static_shared_bytes, big=big,
                              dynamic_limit=dynamic, simt_cp=cp, split_k=split_k, bk=bk, simt_threads=threads)

    plan = make(None)
    cands = [("tile128", make(True)), ("tile64", make(False))]
    if spec.kind == "f32" and split_k:  # (plain GEMMs; 128 threads: 8 x 16 accumulators each)
        cands += [("tile128bk32", make(True, 32)), ("tile128t128", make(True, threads=128))]
    alts: dict[str, conv_gemm_plan.Plan] = {}
    for k, p in cands:
        if p is not None and p not in alts.values():
            alts[k] = p
    heuristic = next((k for k, p in alts.items() if p == plan), None)
    if plan is None or heuristic is None or len(alts) < 2:
        return plan
    key = f"igemm:{spec.kind}:{tuning.problem_key(spec)}"
    return alts[tuning.choose(key, tuple(alts), heuristic)]


def _emit(m: _Match, name: str, params: Params, text_of: Any = None) -> bool:
    """Splice the kernel for `m` in; `text_of(spec)`: another template's text for the final
    spec (conv_wgmma's), else conv_gemm's."""
    g, spec, plan, pads, fill = m.g, m.spec, m.plan, m.pads, m.fill
    ec = spec.c.elem
    ins = [pad[0] if pad is not None else v for pad, v in zip(pads, g.inputs)]  # what the kernel reads
    if m.relayout is not None:
        ins[1] = weight_layout.copy_before(m.relayout, ins[1], g.op)
    for i, tr in enumerate(m.transposed):  # (kernel names: unique, kind `transpose`)
        if tr is not None:
            ins[i] = sgemm_relayout.copy_before(tr, ins[i], g.op, f"{name}{'ab'[i]}_transpose")
    # (taps: sgemm's epilogue may also store an intermediate graph output; GAC_EPILOGUE_TAPS=0 bisects)
    fused = (fused_epilogue(g, ins, fill[0] if fill is not None else None, interchange=True,  # type: ignore[arg-type]
                            taps=text_of is None and spec.kind == "f32" and os.environ.get("GAC_EPILOGUE_TAPS") != "0")
             if params.fuse_epilogue and plan.splits == 1 else None)  # (split-K: partial sums)
    if fused is not None:
        for op in ops_between(g.op, fused[0][-1]):
            if op not in fused[0]:
                op.move_before(g.op)  # views / constants the epilogue reads, defined in between
        spec = conv_gemm.Spec(**{**spec.__dict__, "epilogue": fused[1]})
    if fused is not None and buffer_root(fused[2][-1]) in {buffer_root(v) for v in ins}:
        fused[2][-1] = rename_from(fused[2][-1], fused[0][-1], g.op)  # (only whole allocs get here)
    text = (text_of(spec) if text_of is not None
            else template_text(("igemm", spec, plan), lambda: conv_gemm_text.template(spec, plan)))
    splice_template(text, g.op, [*ins, g.outputs[0], *(fused[2] if fused else []), *_streamk_buffers(plan, spec, g.op, name)],
                    fill[1] if fill is not None else None, ec, name)
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    for pad, v in zip(pads, g.inputs):
        if pad is not None:  # (already passed by schedule.map_to_gpu's loop)
            for op in pad[2]:
                op.erase()
            erase_if_unused(buffer_root(v))
    if fused is not None:  # erased by `fused_strategy` when the scheduler reaches them
        for op in fused[0]:
            op.attributes[FUSED] = ir.UnitAttr.get()
    return True


def _streamk_buffers(plan: conv_gemm_plan.Plan, spec: conv_gemm.Spec, before: ir.Operation,
                     name: str) -> list[ir.Value]:
    """Stream-K's workspace (kernels/conv_gemm_streamk.py): the partial sums and the tile
    counters, which a small kernel (`name`z_loops) zeroes right before; none without."""
    if not plan.sk_workers:
        return []
    from gac_torch.kernels import conv_gemm_streamk

    nw, nf = conv_gemm_streamk.workspace(spec, plan)
    with ir.InsertionPoint(before), before.location:
        ws = memref.alloc(ir.MemRefType(ir.Type.parse(f"memref<{nw}xf32>")), [], [])
        flags = memref.alloc(ir.MemRefType(ir.Type.parse(f"memref<{nf}xi32>")), [], [])
    text = template_text(("sk_zero", nf), lambda: conv_gemm_streamk.zero_template(nf))
    splice_template(text, before, [flags], None, "f32", f"{name}z_loops")
    return [ws, flags]


def padding_of(g: Generic, i: int):
    """(source, guarded operand, ops to erase) when input i is a scratch buffer P written only
    by `fill P with 0` and `copy x -> subview(P)` (a zero padding of x) before g."""
    v = g.inputs[i]
    alloc = defining_op(v)
    if alloc is None or alloc.name != "memref.alloc" or not static_memref(v.type):
        return None
    if any(is_pending(u) for u in users_now(v)):  # a kernel uses P: more than fill, copy and g
        return None  # (without waiting for its template, folded meanwhile: fold_pool.py)
    readers = [u for u in users(v) if u.name != "memref.dealloc"]
    pt_rank = ir.MemRefType(v.type).rank
    fills = [u for u in readers if u != g.op and u.name == "linalg.generic" and len(u.operands) == 1
             and u.operands[0] == v and len(block_ops(u.regions[0].blocks[0])) == 1
             and map_dims(ir.AffineMapAttr(u.attributes["indexing_maps"][0]).value) == list(range(pt_rank))]
    copies = [u for u in readers if u not in fills and u != g.op]
    if len(readers) != 3 or len(fills) != 1 or len(copies) != 1:
        return None
    fill, copy = fills[0], copies[0]
    if not (fill.block == copy.block == g.op.block and fill.is_before_in_block(copy)
            and copy.is_before_in_block(g.op)):
        return None
    value = block_ops(fill.regions[0].blocks[0])[0].operands[0]
    cst = defining_op(value)
    if cst is None or cst.name != "arith.constant" or not isinstance(cst.attributes["value"], ir.FloatAttr) \
            or ir.FloatAttr(cst.attributes["value"]).value != 0.0:
        return None
    cg = analyze(copy)
    if copy.name != "linalg.generic" or cg is None or len(cg.inputs) != 1 or len(cg.outputs) != 1:
        return None
    x, view = cg.inputs[0], cg.outputs[0]
    sub = defining_op(view)
    ident = list(range(len(cg.iters)))
    body = block_ops(cg.body)
    if (sub is None or sub.name != "memref.subview" or sub.operands[0] != v or len(body) != 1
            or body[0].operands[0] != cg.body.arguments[0] or any(map_dims(m) != ident for m in cg.maps)
            or not static_memref(x.type) or x.type == v.type):
        return None
    offsets = list(ir.DenseI64ArrayAttr(sub.attributes["static_offsets"]))
    sizes = list(ir.DenseI64ArrayAttr(sub.attributes["static_sizes"]))
    steps = list(ir.DenseI64ArrayAttr(sub.attributes["static_strides"]))
    xt, pt = ir.MemRefType(x.type), ir.MemRefType(v.type)
    if any(s != 1 for s in steps) or sizes != list(xt.shape) or len(sizes) != pt.rank:
        return None
    terms = [affine_terms(e) for e in g.maps[i].results]
    if any(t is None for t in terms):
        return None
    shifted = [(lin, c0 - off) for (lin, c0), off in zip(terms, offsets)]  # type: ignore[misc]
    guarded = tuple(j for j in range(pt.rank) if offsets[j] or sizes[j] != pt.shape[j])
    strides, offset = xt.get_strides_and_offset()
    op = conv_gemm.operand(str(xt), str(xt.element_type), tuple(xt.shape), tuple(strides), offset,
                           shifted, g.maps[i].n_dims, guarded)
    return x, op, [copy, sub, fill]
