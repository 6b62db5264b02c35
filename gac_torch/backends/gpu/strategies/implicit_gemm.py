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

from mlir import ir

from gac_torch.backends.gpu import tuning
from gac_torch.backends.gpu.analysis import (
    Generic, analyze, contraction_body, fill_before, map_dims, match_contraction, read_at_own_point,
)
from gac_torch.backends.gpu.irutil import (
    VIEW_OPS, block_ops, buffer_root, defining_op, erase_if_unused, op_at, op_index, ops_between,
    static_memref, top_level, users,
)
from gac_torch.backends.gpu.schedule import HOISTABLE
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template, template_text
from gac_torch.backends.gpu.strategies import weight_layout
from gac_torch.kernels import conv_gemm, conv_gemm_text, cuda_mma
from gac_torch.kernels.gemm_epilogue import EOp, Epilogue
from gac_torch.lowering.structured import CONV_CONTRACTION


def _linear(e: ir.AffineExpr) -> tuple[dict[int, int], int] | None:
    """An affine expression as ({dim: coefficient}, constant), or None (mod, floordiv, ...)."""
    if isinstance(e, ir.AffineDimExpr):
        return {e.position: 1}, 0
    if isinstance(e, ir.AffineConstantExpr):
        return {}, e.value
    if isinstance(e, ir.AffineAddExpr):
        x, y = _linear(e.lhs), _linear(e.rhs)
        if x is None or y is None:
            return None
        out = dict(x[0])
        for d, k in y[0].items():
            out[d] = out.get(d, 0) + k
        return out, x[1] + y[1]
    if isinstance(e, ir.AffineMulExpr):
        x, y = _linear(e.lhs), _linear(e.rhs)
        if x is None or y is None:
            return None
        (lin, k), c = (x, y[1]) if not y[0] else (y, x[1]) if not x[0] else (None, None)  # type: ignore[assignment]
        if lin is None:
            return None
        return {d: v * c for d, v in lin.items()}, k * c
    return None


def operand_at(v: ir.Value, m: ir.AffineMap) -> conv_gemm.Operand | None:
    t = ir.MemRefType(v.type)
    if not static_memref(v.type):
        return None
    terms = [_linear(e) for e in m.results]
    if any(x is None for x in terms):
        return None
    strides, offset = t.get_strides_and_offset()
    return conv_gemm.operand(str(t), str(t.element_type), tuple(t.shape), tuple(strides), offset,
                             terms, m.n_dims)  # type: ignore[arg-type]


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
    plan: conv_gemm.Plan
    pads: list
    fill: tuple[ir.Operation, ir.Value] | None
    relayout: weight_layout.Relayout | None = None


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


def _match(g: Generic, limits: GpuLimits, params: Params) -> _Match | None:
    """The implicit-GEMM plan for `g`, or None (nothing is changed)."""
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
    moved = weight_layout.c_inner(ks, r)
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
    fill = fill_before(g.op, g.outputs[0])
    spec = conv_gemm.Spec(kind, tuple(ms), tuple(ns), tuple(ks), batch, r, a, b, c,  # type: ignore[arg-type]
                          fill is not None)
    dynamic = 0 if os.environ.get("GAC_IGEMM_DYNAMIC_SMEM") == "0" else limits.max_dynamic_shared_bytes  # (bisects)
    plan = _tuned_plan(spec, limits, dynamic, params.mma, not conv)
    if plan is None:
        return None
    if plan.splits > 1:  # split-K adds into C: the fill runs first as its own kernel
        spec, fill = conv_gemm.Spec(**{**spec.__dict__, "fill": False}), None
    return _Match(g, spec, plan, pads, fill, relayout)


def _tuned_plan(spec: conv_gemm.Spec, limits: GpuLimits, dynamic: int, cp: bool, split_k: bool):
    """The heuristic tiling (128-wide tiles once they fill about a wave), or the other tile size
    (exact-f32 GEMMs: or 128-wide tiles with 32-deep K slices) where the GPU measured it faster for
    this problem (gpu/tuning.py). cp.async needs sm_80+ (as mma.sync); split-K is for plain
    GEMMs, never convolutions."""
    def make(big: bool | None, bk: int | None = None) -> conv_gemm.Plan | None:
        return conv_gemm.plan(spec, limits.max_grid, limits.max_static_shared_bytes, big=big,
                              dynamic_limit=dynamic, simt_cp=cp, split_k=split_k, bk=bk)

    plan = make(None)
    cands = [("tile128", make(True)), ("tile64", make(False))]
    if spec.kind == "f32" and split_k:  # (plain GEMMs)
        cands.append(("tile128bk32", make(True, 32)))
    alts: dict[str, conv_gemm.Plan] = {}
    for k, p in cands:
        if p is not None and p not in alts.values():
            alts[k] = p
    heuristic = next((k for k, p in alts.items() if p == plan), None)
    if plan is None or heuristic is None or len(alts) < 2:
        return plan
    key = f"igemm:{spec.kind}:{tuning.problem_key(spec)}"
    return alts[tuning.choose(key, tuple(alts), heuristic)]


def _emit(m: _Match, name: str, params: Params) -> bool:
    g, spec, plan, pads, fill = m.g, m.spec, m.plan, m.pads, m.fill
    ec = spec.c.elem
    ins = [pad[0] if pad is not None else v for pad, v in zip(pads, g.inputs)]  # what the kernel reads
    if m.relayout is not None:
        ins[1] = weight_layout.copy_before(m.relayout, ins[1], g.op)
    fused = (fused_epilogue(g, ins, fill[0] if fill is not None else None, interchange=True)  # type: ignore[arg-type]
             if params.fuse_epilogue and plan.splits == 1 else None)  # (split-K: partial sums)
    if fused is not None:
        for op in ops_between(g.op, fused[0][-1]):
            if op not in fused[0]:
                op.move_before(g.op)  # views / constants the epilogue reads, defined in between
        spec = conv_gemm.Spec(**{**spec.__dict__, "epilogue": fused[1]})
    if fused is not None and buffer_root(fused[2][-1]) in {buffer_root(v) for v in ins}:
        fused[2][-1] = rename_from(fused[2][-1], fused[0][-1], g.op)  # (only whole allocs get here)
    text = template_text(("igemm", spec, plan), lambda: conv_gemm_text.template(spec, plan))
    splice_template(text, g.op, [*ins, g.outputs[0], *(fused[2] if fused else [])],
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


FUSED = "gac.fused_epilogue"  # an elementwise op that now runs in its producer's kernel


def erase_fused(op: ir.Operation) -> None:
    """Erase a consumer fused into a contraction's epilogue, and the intermediate it read."""
    roots = [buffer_root(v) for v in op.operands if isinstance(v.type, ir.MemRefType)]
    op.erase()
    for root in roots:
        erase_if_unused(root)


def padding_of(g: Generic, i: int):
    """(source, guarded operand, ops to erase) when input i is a scratch buffer P written only
    by `fill P with 0` and `copy x -> subview(P)` (a zero padding of x) before g."""
    v = g.inputs[i]
    alloc = defining_op(v)
    if alloc is None or alloc.name != "memref.alloc" or not static_memref(v.type):
        return None
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
    terms = [_linear(e) for e in g.maps[i].results]
    if any(t is None for t in terms):
        return None
    shifted = [(lin, c0 - off) for (lin, c0), off in zip(terms, offsets)]  # type: ignore[misc]
    guarded = tuple(j for j in range(pt.rank) if offsets[j] or sizes[j] != pt.shape[j])
    strides, offset = xt.get_strides_and_offset()
    op = conv_gemm.operand(str(xt), str(xt.element_type), tuple(xt.shape), tuple(strides), offset,
                           shifted, g.maps[i].n_dims, guarded)
    return x, op, [copy, sub, fill]


def _dense(t: ir.MemRefType) -> bool:
    strides, offset = t.get_strides_and_offset()
    want, step = [], 1
    for n in reversed(t.shape):
        want.append(step)
        step *= n
    return offset == 0 and list(strides) == want[::-1]


def _numel(t: ir.MemRefType) -> int:
    n = 1
    for x in t.shape:
        n *= x
    return n


def _consumer(prev: ir.Operation, y: ir.Value, avoid: set, interchange: bool = False):
    """The elementwise generic right after `prev` (views and constants aside) that reads the
    dense scratch buffer y once, at its own point (`interchange`: or through a permutation, its
    loops then permuted), or None. Returns (generic, index of its y
    input, (Operand, iteration space) per other input, those inputs, its output, y's root)."""
    at = op_index(prev) + 1
    nxt = op_at(prev.block, at)
    while nxt is not None and (nxt.name in HOISTABLE or nxt.name == "arith.constant"):
        at += 1  # views, allocations, constants: no memory touched in between
        nxt = op_at(prev.block, at)
    if nxt is None or nxt.name != "linalg.generic":
        return None
    e = analyze(nxt)
    if e is None or e.dynamic or len(e.outputs) != 1 or "reduction" in e.iters:
        return None
    root, yt = buffer_root(y), ir.MemRefType(y.type)
    alloc = defining_op(root)
    if alloc is None or alloc.name != "memref.alloc" or not _dense(yt) or _numel(yt) != _numel(ir.MemRefType(root.type)):
        return None
    readers = [k for k, v in enumerate(e.inputs) if isinstance(v.type, ir.MemRefType) and buffer_root(v) == root]
    if len(readers) != 1:
        return None
    ky = readers[0]
    vy = ir.MemRefType(e.inputs[ky].type)
    ident = list(range(len(e.iters)))
    if interchange and map_dims(e.maps[ky]) != ident:  # (the NCHW output of an NHWC conv chain)
        e = read_at_own_point(e, ky) or e
    out = map_dims(e.maps[-1])
    if map_dims(e.maps[ky]) != ident or out is None or sorted(out) != ident or not _dense(vy) \
            or _numel(vy) != _numel(yt):
        return None
    z = e.outputs[0]
    zt = ir.MemRefType(z.type)
    if (buffer_root(z) in avoid and not _renamable(z, e.op)) or not static_memref(z.type):
        return None
    if buffer_root(z) == root and (not _dense(zt) or _numel(zt) != _numel(yt) or out != ident):
        return None  # in place on y: only element for element
    inputs: list = []
    values: list[ir.Value] = []
    for k, (v, m) in enumerate(zip(e.inputs, e.maps)):
        if k == ky:
            continue
        if not isinstance(v.type, ir.MemRefType) or not static_memref(v.type):
            return None
        if buffer_root(v) == buffer_root(z) and (v.type != z.type or map_dims(m) != out):
            return None  # reads Z's buffer elsewhere than at the point it writes
        op = operand_at(v, m)
        if op is None:
            return None
        inputs.append((op, tuple(e.ranges)))
        values.append(v)
    return e, ky, inputs, values, z, root


def _dead_after(root: ir.Value, first: ir.Operation, last: ir.Operation, allowed: set) -> bool:
    """Between `first` and `last` only `allowed` ops touch root, and after `last` its value is
    never read: the next op that touches it overwrites all of it (a reused buffer's other
    lifetimes, before and after, are no concern)."""
    block = first.block
    tops = {}
    for u in users(root):
        if u.name == "memref.dealloc":
            continue
        top = top_level(u, block)
        if top.is_before_in_block(first):
            continue
        if top in allowed:
            continue
        if not last.is_before_in_block(top):
            return False  # between the chain's ops
        tops[top] = True
    if not tops:
        return True
    nxt = min(tops, key=op_index)
    if nxt.name != "linalg.generic":
        return False
    e = analyze(nxt)
    if e is None or any(isinstance(v.type, ir.MemRefType) and buffer_root(v) == root for v in e.inputs):
        return False
    outs = [k for k, v in enumerate(e.outputs) if buffer_root(v) == root]
    if len(outs) != 1:
        return False
    v = e.outputs[outs[0]]
    arg = e.body.arguments[len(e.inputs) + outs[0]]
    vt = ir.MemRefType(v.type)
    return (not list(arg.uses) and map_dims(e.maps[len(e.inputs) + outs[0]]) == list(range(len(e.iters)))
            and "reduction" not in e.iters and _dense(vt) and _numel(vt) == _numel(ir.MemRefType(root.type)))


def _view_chain(z: ir.Value) -> list[ir.Operation]:
    """The view ops from z's allocation down to z (outermost first)."""
    chain = []
    d = defining_op(z)
    while d is not None and d.name in VIEW_OPS:
        chain.append(d)
        d = defining_op(d.operands[0])
    return chain[::-1]


def _renamable(z: ir.Value, at: ir.Operation) -> bool:
    """z is (a view of) a whole scratch allocation: from `at` on, another allocation can stand
    in for it (see rename_from). Views of it made before `at` and used after are rebuilt on
    the stand-in, when they have no operand but the buffer (static views)."""
    root = buffer_root(z)
    d = defining_op(root)
    if d is None or d.name != "memref.alloc":
        return False
    own = set(_view_chain(z))

    def fixed(v: ir.Value) -> bool:
        for use in v.uses:
            o = use.owner.operation if hasattr(use.owner, "operation") else use.owner
            if o.name in VIEW_OPS and (len(o.operands) != 1 or not fixed(o.results[0])):
                return False
        return True

    return fixed(root) and all(len(o.operands) == 1 for o in own)


def rename_from(z: ir.Value, first: ir.Operation, before: ir.Operation) -> ir.Value:
    """A fresh allocation (made before `before`) takes over z's buffer from op `first` on: the
    fused kernel must not write a buffer its own inputs are read from. Returns z's view of it."""
    root = buffer_root(z)
    fresh = defining_op(root).clone(ir.InsertionPoint(before)).results[0]
    own = _view_chain(z)

    def later(o: ir.Operation) -> bool:
        top = top_level(o, first.block)
        return top == first or first.is_before_in_block(top)

    def redirect(old: ir.Value, new: ir.Value) -> None:
        """Uses of `old` from `first` on use `new`; an earlier view of it with later users gets
        a copy on `new` for them (the buffer's reshaped views, e.g. the next conv's input)."""
        for use in list(old.uses):
            o = use.owner.operation if hasattr(use.owner, "operation") else use.owner
            if later(o):
                o.operands[use.operand_number] = new
            elif o.name in VIEW_OPS and o not in own and any(later(u) for u in users(o.results[0])):
                copy = o.clone(ir.InsertionPoint(before))
                copy.operands[0] = new
                redirect(o.results[0], copy.results[0])

    redirect(root, fresh)
    v = fresh
    for view in own:  # z's own views, rebuilt on the fresh buffer
        new = view.clone(ir.InsertionPoint(before))
        new.operands[0] = v
        v = new.results[0]
    return v


def fused_epilogue(g: Generic, ins: list[ir.Value], fill: ir.Operation | None, stages: int = 3,
                   interchange: bool = False):
    """(consumer ops, Epilogue, its extra template arguments) for the longest chain (up to
    `stages`) of elementwise generics after g, each reading the previous one's result (e.g. the
    f32 -> bf16 -> f32 rounding in place, then BatchNorm + ReLU across a reshape), whose
    intermediate buffers nothing else touches. `interchange`: the first may read g's result
    through a permutation (igemm; the other GEMM strategies' stores assume C's own order)."""
    conv_roots = {buffer_root(v) for v in ins}  # the kernel reads these until it ends
    found: list = []
    prev, y = g.op, g.outputs[0]
    while len(found) < stages:
        st = _consumer(prev, y, conv_roots, interchange)
        if st is None or _body_ops(st[0]) is None or operand_at(st[4], st[0].maps[-1]) is None:
            break
        found.append(st)
        prev, y = st[0].op, st[4]
    for n in range(len(found), 0, -1):
        chain = found[:n]
        final = buffer_root(chain[-1][4])
        scratch = {st[5] for st in chain} | {buffer_root(st[4]) for st in chain[:-1]}
        scratch.discard(final)
        allowed = {g.op, *(st[0].op for st in chain)} | ({fill} if fill is not None else set())
        if any(not _dead_after(r, g.op, chain[-1][0].op, allowed) for r in scratch):
            continue
        if any(buffer_root(v) in scratch | ({final} if final in {st[5] for st in chain} else set())
               for st in chain for v in st[3]):
            continue  # a stage reads an intermediate other than through its chain input
        return chain_epilogue(chain, g)
    return None


def _over_conv_dims(x: tuple, g: Generic) -> tuple:
    """(Operand over e-space S, S) -> (the same Operand over g's iteration dims, None) when S
    only merges consecutive dims of g's output shape (addresses stay linear), else x."""
    op, space = x
    cdims, cshape = map_dims(g.maps[2]), list(ir.MemRefType(g.outputs[0].type).shape)
    lin: list[dict[int, int]] = []
    i = 0
    for n in space:
        form: dict[int, int] = {}
        size = 1
        while size < n and i < len(cshape):
            for d in form:
                form[d] *= cshape[i]
            form[cdims[i]] = form.get(cdims[i], 0) + 1  # type: ignore[index]
            size *= cshape[i]
            i += 1
        if size != n:
            return x
        lin.append(form)
    if any(cshape[k] != 1 for k in range(i, len(cshape))):
        return x
    coef = [0] * len(g.iters)
    for k, form in zip(op.coef, lin):
        for d, mult in form.items():
            coef[d] += k * mult
    return conv_gemm.Operand(op.type, op.elem, tuple(coef), op.const, op.offset, op.span), None


def chain_epilogue(chain: list, g: Generic):
    inputs: list = [None]  # argument 0: the contraction's value
    values: list[ir.Value] = []
    ops: list[EOp] = []
    result = None
    for e, ky, more, vals, z, _ in chain:
        body = _body_ops(e)
        remap: dict = {}  # the stage's refs in the combined numbering; y is the previous value
        j = 0
        for k in range(len(e.inputs)):
            if k == ky:
                remap[k] = ("arg", 0) if result is None else result
            else:
                remap[k] = ("arg", len(inputs) + j)
                j += 1
        base = len(ops)

        def fix(r, remap=remap, base=base):
            return remap[r[1]] if r[0] == "arg" else ("op", r[1] + base) if r[0] == "op" else r

        ops += [EOp(o.name, tuple(fix(r) for r in o.args), o.attrs, o.types, o.result) for o in body[0]]  # type: ignore[index]
        result = fix(body[1])  # type: ignore[index]
        inputs += more
        values += vals
    e, z = chain[-1][0], chain[-1][4]
    out = _over_conv_dims((operand_at(z, e.maps[-1]), tuple(e.ranges)), g)
    inputs = [x if x is None else _over_conv_dims(x, g) for x in inputs]
    return [st[0].op for st in chain], Epilogue(tuple(inputs), out, tuple(ops), result), [*values, z]  # type: ignore[arg-type]


def _body_ops(e: Generic) -> tuple[tuple[EOp, ...], tuple] | None:
    """The body as EOps (generic form), operands referring to block arguments, earlier ops or
    constants from outside; None if it has regions, linalg.index or reads the output."""
    args = list(e.body.arguments)
    if list(args[-1].uses):
        return None
    refs: dict = {a: ("arg", i) for i, a in enumerate(args[:-1])}
    out: list[EOp] = []

    def ref(v: ir.Value):
        if v in refs:
            return refs[v]
        d = defining_op(v)
        if d is not None and d.name == "arith.constant" and d.block != e.body:
            return ("const", str(d.attributes["value"]), str(v.type))
        return None

    ops = block_ops(e.body)
    for op in ops[:-1]:
        if op.regions or op.name.startswith("linalg.") or len(op.results) != 1:
            return None
        if op.name == "arith.constant":
            refs[op.results[0]] = ("const", str(op.attributes["value"]), str(op.results[0].type))
            continue
        rs = [ref(v) for v in op.operands]
        if any(x is None for x in rs):
            return None
        a = op.attributes
        attrs = ", ".join(f"{a[i].name} = {a[i].attr}" for i in range(len(a)))
        out.append(EOp(op.name, tuple(rs), "{" + attrs + "}" if attrs else "",
                       tuple(str(v.type) for v in op.operands), str(op.results[0].type)))
        refs[op.results[0]] = ("op", len(out) - 1)
    result = ref(ops[-1].operands[0])
    return (tuple(out), result) if result is not None else None
