"""`gemm` (vortex): a plain f32 contraction (matmul, batched matmul, convolution as an implicit
GEMM: K over (c, kh, kw), columns over (n, oh, ow)) -> the tiled local-memory template
gac_torch.kernels.vortex_gemm, a `threads` (rows x cols) CTA with a register tile per thread.
A Vortex CTA must fit one core (its barrier waits for all of its warps) and warps are narrow.
With a cost table (`GemmCosts`, SimX cycles the target measured) the op stays a `loops` kernel
where the tiles would cost more than the scalar loop (tiny or badly overhanging shapes).
Epilogue: the elementwise consumers right after (BatchNorm-eval, ReLU, a residual add: the
chain implicit_gemm finds for cuda) run in the store step and their intermediates go away
(`implicit_gemm.fused_strategy` erases them when the scheduler reaches them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mlir import ir

from gac_torch.backends.gpu.analysis import Generic, fill_before
from gac_torch.backends.gpu.irutil import block_ops, buffer_root, erase_if_unused
from gac_torch.backends.gpu.strategies import epilogue as gemm_epilogue, implicit_gemm
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template
from gac_torch.kernels import vortex_gemm


@dataclass(frozen=True)
class GemmCosts:
    """The target's cost table: warp-instructions of the three kernels (a model fitted to the
    functional simulator's counts) times SimX cycles per warp-instruction of each kernel class.
    Tiled, per CTA: `gemm_cta` + per K stage, per staged element `stage_plain` (plain subscripts)
    or `stage_conv + stage_conv_dim * (non-unit K dims)` (+ `stage_k_over` when K overhangs the
    stage), and `gemm_mac` per multiply-add of the bm x bn x bk tile. `loops`: `loops_out` per
    output + `loops_mac` per multiply-add."""

    gemm_cpi: float
    loops_cpi: float
    direct_cpi: float
    gemm_cta: float
    gemm_mac: float
    stage_plain: float
    stage_conv: float
    stage_conv_dim: float
    stage_k_over: float
    loops_out: float
    loops_mac: float
    direct_cta: float
    direct_load: float
    direct_k: float
    lanes: int            # threads per warp

    def direct(self, s: vortex_gemm.GemmShape, t: vortex_gemm.GemmTiling) -> float:
        gx, gy, gz = vortex_gemm.grid(s, t)
        per_k = t.threads // self.lanes * (self.direct_load * (t.rm + t.rn) + t.rm * t.rn + self.direct_k)
        return gx * gy * gz * (self.direct_cta + s.K * per_k) * self.direct_cpi

    def tiled(self, s: vortex_gemm.GemmShape, t: vortex_gemm.GemmTiling) -> float:
        gx, gy, gz = vortex_gemm.grid(s, t)
        kdims = sum(e > 1 for e in s.k_ext)
        over = self.stage_k_over if s.K % t.bk else 0.0

        def per_elem(subs: tuple[vortex_gemm.Sub, ...]) -> float:
            plain = all(not isinstance(d, tuple) for d in subs) and kdims <= 1
            return self.stage_plain if plain else self.stage_conv + self.stage_conv_dim * kdims + over

        stage = (t.bm * t.bk * per_elem(s.a_dims) + t.bk * t.bn * per_elem(s.b_dims)
                 + t.bm * t.bn * t.bk * self.gemm_mac)
        return gx * gy * gz * (self.gemm_cta + -(-s.K // t.bk) * stage) * self.gemm_cpi

    def loops(self, s: vortex_gemm.GemmShape) -> float:
        return s.M * s.N * math.prod(s.batch) * (self.loops_out + self.loops_mac * s.K) * self.loops_cpi


def strategy(threads: tuple[int, int], costs: GemmCosts | None = None, epilogue: bool = True,
             padding: bool = False) -> Strategy:
    """`threads`: (rows, cols) of the GEMM CTA; rows * cols <= one core's threads. `epilogue`:
    fuse C's elementwise consumers into the store step; `padding`: read a zero-padded input
    (fill + copy into a scratch buffer right before) through guarded loads instead -- off on
    SimX: the guards cost more than the fill and copy kernels (BEVFormer's stem 7x7/2 conv,
    3 channels: +51% warp instructions in the GEMM against 43% for fill + copy; a 3x3 16 -> 32
    conv: +40% against 19%), as the guards repeat per (kh, kw) and column."""

    def match(g: Generic, limits: GpuLimits) -> tuple[Generic, vortex_gemm.GemmShape, bool] | None:
        m = match_gemm(g) if len(g.inputs) == 2 and len(g.outputs) == 1 else None
        if m is None or 0 in (m[0].M, m[0].N, m[0].K):
            return None
        return g, *m

    def emit(m: tuple[Generic, vortex_gemm.GemmShape, bool], name: str, limits: GpuLimits) -> bool:
        g, shape, swap = m
        pads = [padding_of(g, i) if padding else None for i in range(2)]
        if swap:
            pads = pads[::-1]   # (A, B) order
        for which, pad in zip("ab", pads):
            if pad is not None:
                shape = dataclasses.replace(shape, **{f"{which}_dims": pad[1], f"{which}_guard": pad[2],
                                                      f"{which}_type": str(pad[0].type)})
        tiling = vortex_gemm.choose_tiling(shape.M, shape.N, shape.K, *threads)
        if tiling.lmem_bytes() > limits.max_static_shared_bytes or any(
                x > lim for x, lim in zip(vortex_gemm.grid(shape, tiling), limits.max_grid)):
            return False
        if costs is not None:   # the cheapest of staged tiles, direct tiles and `loops`
            direct = dataclasses.replace(tiling, direct=True)
            est = {costs.tiled(shape, tiling): tiling, costs.direct(shape, direct): direct}
            best = min(est)
            if best > costs.loops(shape):
                return False
            tiling = est[best]
        ins = [p[0] if p is not None else v for p, v in zip(pads[::-1] if swap else pads, g.inputs)]
        a, b = (g.inputs[1], g.inputs[0]) if swap else (g.inputs[0], g.inputs[1])
        a, b = (pads[0][0] if pads[0] else a), (pads[1][0] if pads[1] else b)
        splice_gemm(g, a, b, ins, epilogue, name,
                    lambda fill, ep: vortex_gemm.gemm_template(shape, tiling, fill, ep))
        for pad, v in zip(pads, (g.inputs[1], g.inputs[0]) if swap else g.inputs):
            if pad is not None:   # the fill and copy (passed already by the scheduler's loop)
                for op in pad[3]:
                    op.erase()
                erase_if_unused(buffer_root(v))
        return True

    return Strategy("gemm", match, emit)


def splice_gemm(g: Generic, a: ir.Value, b: ir.Value, ins: list[ir.Value], epilogue: bool, name: str,
                template) -> None:
    """Replace g (and the fill right before it) by a GEMM template `template(fused_fill, ep)`
    reading A = a, B = b; with `epilogue`, C's elementwise consumers (fused_epilogue, `ins`: what
    the kernel reads) go into its store step and are marked for implicit_gemm.fused_strategy."""
    fill = fill_before(g.op, g.outputs[0])
    fused = fused_epilogue(g, fill, ins) if epilogue else None
    ep = None if fused is None else vortex_gemm.Fused(fused[1], gemm_epilogue.operand_at(g.outputs[0], g.maps[2]))
    splice_template(template(fill is not None, ep), g.op, [a, b, g.outputs[0], *(fused[2] if fused else [])],
                    fill[1] if fill is not None else None, "f32", name)
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    for op in fused[0] if fused else []:   # erased by implicit_gemm.fused_strategy
        op.attributes[gemm_epilogue.FUSED] = ir.UnitAttr.get()


def padding_of(g: Generic, i: int):
    """(x, subscripts on x, guards, ops to erase) when input i is a zero padding of x
    (implicit_gemm.padding_of's pattern): each subscript shifted by the pad's offset, guarded
    where the padded buffer is larger."""
    found = implicit_gemm.padding_of(g, i)
    subs = linear_subscripts(g.maps[i])
    if found is None or subs is None:
        return None
    x, _, ops = found
    sub = ops[1]
    offsets = list(ir.DenseI64ArrayAttr(sub.attributes["static_offsets"]))
    xs, ps = ir.MemRefType(x.type).shape, ir.MemRefType(g.inputs[i].type).shape
    shifted = tuple(_shift(d, -o) for d, o in zip(subs, offsets))
    guard = tuple((j, xs[j]) for j in range(len(xs)) if offsets[j] or xs[j] != ps[j])
    return x, shifted, guard, ops


def _shift(d: vortex_gemm.Sub, by: int) -> vortex_gemm.Sub:
    """Subscript d + by."""
    if not by:
        return d
    terms = {} if d is None else {d: 1} if isinstance(d, int) else dict(d)
    terms[None] = terms.get(None, 0) + by
    return tuple(sorted(((k, v) for k, v in terms.items() if v), key=lambda dc: (dc[0] is None, dc[0] or 0))) or None


def fused_epilogue(g: Generic, fill: tuple[ir.Operation, ir.Value] | None, ins: list[ir.Value]):
    """strategies/epilogue.py's consumer chain after g (ops, Epilogue, extra template arguments), made
    ready to splice: ops between g and the chain's end that it reads moved before g, and an
    output aliasing what the kernel reads (`ins`: a fused padding's source, not the padded
    copy) renamed (as implicit_gemm._emit does), or None."""
    fused = gemm_epilogue.fused_epilogue(g, ins, fill[0] if fill is not None else None)
    if fused is None:
        return None
    ops = block_ops(g.op.block)
    for op in ops[ops.index(g.op) + 1:ops.index(fused[0][-1])]:
        if op not in fused[0]:
            op.move_before(g.op)  # views / constants the epilogue reads, defined in between
    if buffer_root(fused[2][-1]) in {buffer_root(v) for v in ins}:
        fused[2][-1] = gemm_epilogue.rename_from(fused[2][-1], fused[0][-1], g.op)
    return fused


def linear_subscripts(m: ir.AffineMap) -> list[vortex_gemm.Sub] | None:
    """Each result of an indexing map as a vortex_gemm.Sub (a dim, None for 0, or a sum of
    coeff * dim terms and a constant), or None if some result is not linear in the dims."""
    def terms(e: ir.AffineExpr) -> dict[int | None, int] | None:
        if isinstance(e, ir.AffineDimExpr):
            return {e.position: 1}
        if isinstance(e, ir.AffineConstantExpr):
            return {None: e.value}
        if isinstance(e, (ir.AffineAddExpr, ir.AffineMulExpr)):
            x, y = terms(e.lhs), terms(e.rhs)
            if x is None or y is None:
                return None
            if isinstance(e, ir.AffineAddExpr):
                return {d: x.get(d, 0) + y.get(d, 0) for d in {*x, *y}}
            if set(y) == {None}:
                return {d: c * y[None] for d, c in x.items()}
            if set(x) == {None}:
                return {d: c * x[None] for d, c in y.items()}
        return None

    out: list[vortex_gemm.Sub] = []
    for e in m.results:
        t = terms(e)
        if t is None:
            return None
        t = {d: c for d, c in t.items() if c}
        if not t:
            out.append(None)
        elif len(t) == 1 and None not in t and next(iter(t.values())) == 1:
            out.append(next(iter(t)))
        else:
            out.append(tuple(sorted(t.items(), key=lambda dc: (dc[0] is None, dc[0] or 0))))
    return out


def match_gemm(g: Generic, inputs: tuple[str, ...] = ("f32",)) -> tuple[vortex_gemm.GemmShape, bool] | None:
    """A plain f32 contraction out += x * y (a matmul, a batched matmul, a convolution): the
    shape with A = the input without the output's innermost dim (so C's stores walk columns),
    and whether A is the op's second input. Reduction, row (A and C), column (B and C) and
    batch (A, B and C) dims may each be several; A's and B's subscripts may be linear in them
    (a convolution's oh * stride + kh), C's must be plain dims. `inputs`: the element types x
    and y may have (both the same); narrower than f32 they are extended in the body
    (out += extf(x) * extf(y), as a half-precision matmul into f32)."""
    elems = [str(ir.MemRefType(v.type).element_type) if isinstance(v.type, ir.MemRefType) else ""
             for v in (*g.inputs, *g.outputs)]
    if len(elems) != 3 or elems[0] != elems[1] or elems[0] not in inputs or elems[2] != "f32":
        return None
    subs = [linear_subscripts(m) for m in g.maps]
    c_subs = subs[2]
    if subs[0] is None or subs[1] is None or c_subs is None or any(isinstance(d, tuple) for d in c_subs):
        return None
    c_named = [d for d in c_subs if d is not None]
    if len(set(c_named)) != len(c_named) or not c_named:
        return None
    swap = c_named[-1] not in vortex_gemm.sub_dims(subs[1])   # the innermost output dim belongs to B
    a_subs, b_subs = (subs[1], subs[0]) if swap else (subs[0], subs[1])
    a, b, out = vortex_gemm.sub_dims(a_subs), vortex_gemm.sub_dims(b_subs), set(c_named)
    red = [d for d, t in enumerate(g.iters) if t == "reduction"]
    par = [d for d, t in enumerate(g.iters) if t == "parallel"]
    if not red or any(d in out for d in red) or not all(d in a or d in b for d in red):
        return None
    rows = [d for d in par if d in a and d not in b]
    cols = [d for d in par if d in b and d not in a]
    batch = [d for d in par if d in a and d in b]
    if not rows or not cols or any(d not in out for d in par) or None in g.ranges:
        return None
    # body: yield(addf(out, mulf(a, b))), operands in any order
    ops = [op.operation for op in g.body.operations]
    ba, bb, bc = g.body.arguments
    if elems[0] != "f32":   # the extensions of x and y first
        if [op.name for op in ops[:2]] != ["arith.extf"] * 2 or {op.operands[0] for op in ops[:2]} != {ba, bb}:
            return None
        ba, bb = ops[0].results[0], ops[1].results[0]
        ops = ops[2:]
    if [op.name for op in ops] != ["arith.mulf", "arith.addf", "linalg.yield"]:
        return None
    mul, add, yld = ops
    if (set(mul.operands) != {ba, bb} or set(add.operands) != {bc, mul.results[0]}
            or yld.operands[0] != add.results[0]):
        return None
    ext = g.ranges
    a_in, b_in = (g.inputs[1], g.inputs[0]) if swap else (g.inputs[0], g.inputs[1])
    return vortex_gemm.GemmShape(
        m_dims=tuple(rows), m_ext=tuple(ext[d] for d in rows),  # type: ignore[misc]
        n_dims=tuple(cols), n_ext=tuple(ext[d] for d in cols),  # type: ignore[misc]
        k_dims=tuple(red), k_ext=tuple(ext[d] for d in red),  # type: ignore[misc]
        batch_dims=tuple(batch), batch=tuple(ext[d] for d in batch),  # type: ignore[misc]
        a_dims=tuple(a_subs), b_dims=tuple(b_subs), c_dims=tuple(c_subs),
        a_type=str(a_in.type), b_type=str(b_in.type), c_type=str(g.outputs[0].type)), swap
