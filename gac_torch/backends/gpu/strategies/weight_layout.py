"""Weights of an implicit-GEMM convolution copied into the contraction's K order.

The implicit GEMM orders a conv's K as (kh, kw, c) (strategies/implicit_gemm.py: the im2col
indices of a K slice are then computed once). An NCHW conv's weights [g, f, c, kh, kw] are not
contiguous along that order: every weight element would be its own 4-byte gather, c at a stride
of kh*kw elements, so a 3x3 conv's weight tile cost nine 32-byte sectors per 16 values (the
TF32 3x3 convs of ResNet-50 were bound by that L2 traffic, ~6 TB/s for 37 TFLOP/s). Here such
a weight is first copied (one small `loops` kernel: 9.4 MB for ResNet-50's largest 3x3 conv)
into [g, f, kh, kw, c]; the conv then stages it in 16-byte vectors by cp.async.

GAC_IGEMM_WEIGHT_LAYOUT=0 keeps the gather (bisects); the K order then stays (c, kh, kw)
unless GAC_IGEMM_KORDER=cinner (`keeps_runs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mlir import ir

from gac_torch.backends.gpu.analysis import map_dims
from gac_torch.backends.gpu.irutil import block_ops, func_block, static_memref
from gac_torch.kernels import conv_gemm, conv_gemm_plan


@dataclass(frozen=True)
class Relayout:
    """The copy: its dim p is the weight buffer's dim perm[p]; `operand` reads it."""

    perm: tuple[int, ...]
    operand: conv_gemm.Operand


def c_inner(ks: list[int], r: tuple[int, ...], multiple: int = 32,
            a: conv_gemm.Operand | None = None) -> list[int]:
    """`ks` with a K dim whose extent is a multiple of `multiple` moved innermost (a conv: (kh,
    kw, c)): each K slice then shares the outer K dims, so the im2col indices are computed once
    per slice (igemm: 32); conv_wgmma gathers 16-byte vectors along it (4: a tf32 vector).
    Without one, given `a` (the input of a conv whose weights are zero-padded: an RGB stem's 4
    channels on NHWC, passes/channels_last.py), the dim that is a's unit stride, its extent a
    multiple of 4: the input then stages in whole vectors."""
    wide = [d for d in ks if r[d] > 1]
    unit = [d for d in wide if a is not None and a.coef[d] == 1 and r[d] % 4 == 0]
    if unit and unit[0] != wide[-1] and r[unit[0]] % multiple == 0:
        # a's unit-stride run, whole vectors, behind an innermost dim that is a multiple too
        # (the space-to-depth stem's 4-wide kernel: passes/space_to_depth.py)
        return [d for d in ks if d != unit[0]] + unit[:1]
    if not wide or r[wide[-1]] % multiple == 0:
        return ks
    if not any(r[d] % multiple == 0 for d in wide):
        return [d for d in ks if d != unit[0]] + unit[:1] if unit else ks
    inner = max((d for d in wide if r[d] % multiple == 0), key=lambda d: r[d])
    return [d for d in ks if d != inner] + [inner]


def keeps_runs(ks: list[int], moved: list[int], r: tuple[int, ...], a: conv_gemm.Operand,
                b: conv_gemm.Operand) -> bool:
    """Whether K order `moved` keeps both operands' unit-stride runs along K (up to a vector's
    8): not so for an NCHW conv's weights when they are not copied (`relayout`), c then a
    gather at a stride of kh*kw. GAC_IGEMM_KORDER=cinner reorders anyway (bisects)."""
    run = conv_gemm_plan.unit_run
    return os.environ.get("GAC_IGEMM_KORDER") == "cinner" or all(
        run(op, tuple(moved), r)[0] >= min(run(op, tuple(ks), r)[0], 8) for op in (a, b))


def relayout(v: ir.Value, m: ir.AffineMap, ks: tuple[int, ...], ranges: tuple[int, ...]) -> Relayout | None:
    """The copy of weight `v` (read through map `m`) that makes it contiguous along K dims `ks`
    (outermost first), or None (see `permuted`)."""
    dims = map_dims(m)
    if os.environ.get("GAC_IGEMM_WEIGHT_LAYOUT") == "0" or dims is None or not static_memref(v.type):
        return None
    t = ir.MemRefType(v.type)
    strides, offset = t.get_strides_and_offset()
    return permuted(str(t), str(t.element_type), tuple(t.shape), tuple(strides), offset, tuple(dims),
                    m.n_dims, ks, ranges)


def permuted(type_text: str, elem: str, shape: tuple[int, ...], strides: tuple[int, ...], offset: int,
             dims: tuple[int, ...], ndims: int, ks: tuple[int, ...], ranges: tuple[int, ...]) -> Relayout | None:
    """A buffer of `shape` / `strides` whose dim j is indexed by iteration dim dims[j], copied
    with the non-K dims first (in their order) and the K dims last in `ks` order: when that
    makes a 16-byte vector's worth of unit-stride run along `ks` where there was none."""
    inner = sorted((j for j, d in enumerate(dims) if d in ks), key=lambda j: ks.index(dims[j]))
    perm = tuple([j for j, d in enumerate(dims) if d not in ks] + inner)
    new_shape = tuple(shape[j] for j in perm)
    dense = [1] * len(shape)
    for j in range(len(shape) - 2, -1, -1):
        dense[j] = dense[j + 1] * new_shape[j + 1]
    text = "memref<" + "".join(f"{n}x" for n in new_shape) + f"{elem}>"
    op = conv_gemm.operand(text, elem, new_shape, tuple(dense), 0, [({dims[j]: 1}, 0) for j in perm], ndims)
    old = conv_gemm.operand(type_text, elem, shape, strides, offset, [({d: 1}, 0) for d in dims], ndims)
    run_old, run_new = (conv_gemm_plan.unit_run(o, ks, ranges)[0] for o in (old, op))
    want = 16 // conv_gemm_plan.ESIZE.get(elem, 4)
    if run_old >= want or run_new < want:
        return None
    return Relayout(perm, op)


def copy_before(r: Relayout, w: ir.Value, before: ir.Operation) -> ir.Value:
    """Emit `alloc + copy` of w in r's layout before `before` (the conv); returns the copy. The
    copy is a plain elementwise generic: the scheduler makes it a `loops` kernel."""
    n = len(r.perm)
    ds = ", ".join(f"d{i}" for i in range(n))
    src = ", ".join(f"d{r.perm.index(j)}" for j in range(n))
    elem = r.operand.elem
    iters = ", ".join(['"parallel"'] * n)
    text = (f"func.func @tmpl(%w: {w.type}) {{\n"
            f"  %0 = memref.alloc() : {r.operand.type}\n"
            f"  linalg.generic {{indexing_maps = [affine_map<({ds}) -> ({src})>, affine_map<({ds}) -> ({ds})>], "
            f"iterator_types = [{iters}]}} "
            f"ins(%w : {w.type}) outs(%0 : {r.operand.type}) {{\n"
            f"  ^bb0(%a: {elem}, %b: {elem}):\n    linalg.yield %a : {elem}\n  }}\n"
            "  return\n}\n")
    tmpl = ir.Module.parse(text, before.context)
    tblock = func_block(tmpl.body.operations[0].operation)
    tblock.arguments[0].replace_all_uses_with(w)
    ops = block_ops(tblock)[:-1]
    for op in ops:
        op.move_before(before)
    return ops[0].results[0]
