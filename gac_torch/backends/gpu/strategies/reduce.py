"""`reduce`: a reduction with a recognized combiner (add, mul, min/max, and/or/xor) over at
least `min_extent` elements, when the reduced dims are innermost or the output is small -> the
row-reduction kernel gac_torch/kernels/reduce.py (a warp or a block per output), its math cloned
from the linalg body through the builder's `Ir` backend. Run-time reduction lengths get a warp
per row. A few outputs of long rows (a loss: one sum over millions) split each row over many
blocks and combine the partials in a second kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, gpu, memref

from gac_torch.backends.gpu.analysis import Generic, fill_before, map_dims
from gac_torch.backends.gpu.irutil import (
    clone_body, defining_op, is_static, load_at, map_indices, merge_dims,
    new_launch, size_ceildiv, size_prod,
)
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.kernels import reduce
from gac_torch.kernels.builder import Ir, delinearize


@dataclass(frozen=True)
class ReduceParams:
    threads: int = 256  # threads per block
    warp_max: int = 1024  # reductions up to this extent get one warp per output
    min_extent: int = 128  # smaller reductions stay sequential per thread (`loops`)
    # Few outputs of long rows spread over the GPU: each row splits into chunks of at least
    # `split_min` elements, one block each (about `split_blocks` blocks in all), whose partials
    # a second small kernel combines (deterministic, unlike atomics).
    split_max_outs: int = 64
    split_min: int = 16384
    split_blocks: int = 1024
    # Column sums (the reduced dims outer, the inputs contiguous along the outputs: a bias
    # gradient): a thread per output and chunk of at least `column_chunk` rows, consecutive
    # threads on consecutive addresses; a second kernel adds up the (at most `column_splits`)
    # chunks (before: a block per column, each load a sector of its own). Up to `column_max`
    # rows: longer ones would leave each thread a long chain of loads (unmeasured).
    column_min: int = 256
    column_max: int = 8192
    column_chunk: int = 64
    column_splits: int = 64


def strategy(params: ReduceParams = ReduceParams()) -> Strategy:
    def match(g: Generic, limits: GpuLimits) -> Generic | None:
        red = [g.ranges[i] for i, t in enumerate(g.iters) if t == "reduction"]
        par = [g.ranges[i] for i, t in enumerate(g.iters) if t == "parallel"]
        inner_is_reduction = bool(g.iters) and g.iters[-1] == "reduction"
        if red and None in red + par:  # run-time extents: rows of the innermost dim(s) only
            short = None not in red and math.prod(red) < params.min_extent  # type: ignore[arg-type]
            return g if inner_is_reduction and not short else None
        if red and math.prod(red) >= params.min_extent:  # type: ignore[arg-type]
            if inner_is_reduction or math.prod(par) < 8192:  # type: ignore[arg-type]
                return g
        return None

    def emit(g: Generic, name: str, limits: GpuLimits) -> bool:
        return _emit_reduce(g, name, limits, params)

    return Strategy("reduce", match, emit)


COMBINERS = {
    "arith.addf": "add", "arith.addi": "add", "arith.mulf": "mul", "arith.muli": "mul",
    "arith.maxnumf": "maxnumf", "arith.minnumf": "minnumf", "arith.maximumf": "maximumf",
    "arith.minimumf": "minimumf", "arith.maxsi": "maxsi", "arith.minsi": "minsi",
    "arith.maxui": "maxui", "arith.minui": "minui", "arith.andi": "and", "arith.ori": "or",
    "arith.xori": "xor",
}


def identity_attr(kind: str, t: ir.Type) -> ir.Attribute:
    if isinstance(t, ir.FloatType):
        v = {"add": 0.0, "mul": 1.0, "maxnumf": -math.inf, "maximumf": -math.inf,
             "minnumf": math.inf, "minimumf": math.inf}[kind]
        return ir.FloatAttr.get(t, v)
    w = ir.IntegerType(t).width
    v = {"add": 0, "mul": 1, "maxsi": -(1 << (w - 1)), "minsi": (1 << (w - 1)) - 1, "maxui": 0,
         "minui": -1, "and": -1, "or": 0, "xor": 0}[kind]
    return ir.IntegerAttr.get(t, v)


def widen(v: ir.Value, t: ir.Type, signed: bool) -> ir.Value:
    if v.type == t:
        return v
    if isinstance(t, ir.FloatType):
        return arith.extf(t, v)
    return arith.extsi(t, v) if signed else arith.extui(t, v)


def narrow(v: ir.Value, t: ir.Type) -> ir.Value:
    if v.type == t:
        return v
    return arith.truncf(t, v) if isinstance(t, ir.FloatType) else arith.trunci(t, v)


def _emit_reduce(g: Generic, name: str, limits: GpuLimits, params: ReduceParams) -> bool:
    if len(g.outputs) != 1:
        return False
    out_dims = map_dims(g.maps[-1])
    par = [i for i, t in enumerate(g.iters) if t == "parallel"]
    red = [i for i, t in enumerate(g.iters) if t == "reduction"]
    if out_dims is None or sorted(out_dims) != par:
        return False  # each output element must be owned by exactly one parallel point
    body_ops = [op.operation for op in g.body.operations]
    out_arg = g.body.arguments[len(g.inputs)]
    comb = defining_op(body_ops[-1].operands[0])
    if comb is None or comb.name not in COMBINERS or comb.block != g.body:
        return False
    uses = list(out_arg.uses)
    if len(uses) != 1 or out_arg not in list(comb.operands):
        return False
    if any(op.regions and len(op.regions) for op in body_ops[:-2]):
        return False
    kind = COMBINERS[comb.name]
    value = comb.operands[1] if comb.operands[0] == out_arg else comb.operands[0]
    with ir.InsertionPoint(g.op), g.op.location:  # run-time extents: memref.dim on the host
        p_ext = [g.extent(d) for d in par]
        r_ext = [g.extent(d) for d in red]
        n_out, n_red = size_prod(p_ext), size_prod(r_ext)
    if is_static(n_out) and (n_out == 0 or n_out > limits.max_grid[0]):
        return False
    elem = ir.MemRefType(g.outputs[0].type).element_type
    if isinstance(elem, ir.FloatType):
        acc_t = ir.F32Type.get() if ir.FloatType(elem).width < 32 else elem
    else:
        acc_t = ir.IntegerType.get_signless(32) if ir.IntegerType(elem).width < 32 else elem
    fill = fill_before(g.op, g.outputs[0])
    if is_static(n_out, n_red) and n_out <= params.split_max_outs and n_red >= 2 * params.split_min:
        _emit_split(g, name, limits, params, (comb, value, kind, acc_t, par, red, fill), p_ext, r_ext)
        return True
    if is_static(n_out, n_red) and params.column_min <= n_red <= params.column_max and _columns(g, par):
        _emit_columns(g, name, params, (comb, value, kind, acc_t, par, red, fill), p_ext, r_ext)
        return True
    p = reduce.plan(n_red if is_static(n_red) else None, limits.warp_size, params.threads, params.warp_max)
    with ir.InsertionPoint(g.op), g.op.location:
        grid = size_ceildiv(n_out, p.outs_per_block)
        trips = size_ceildiv(n_red, p.group)
        launch, body = new_launch(grid, p.threads, name)
        with ir.InsertionPoint(body):
            b = _Ir(body.arguments, g, comb, value, kind, acc_t, par, red, fill)
            reduce.kernel(b, p, acc_t, n_out, n_red, trips, p_ext, r_ext,
                           exact_grid=is_static(grid, n_out) and grid * p.outs_per_block == n_out,
                           exact_rows=is_static(n_red) and n_red % p.group == 0)
            gpu.TerminatorOp()
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True


def _emit_split(g: Generic, name: str, limits: GpuLimits, params: ReduceParams, math_: tuple,
                p_ext: list[int], r_ext: list[int]) -> None:
    """Two kernels: partial[o, s] = the reduction of chunk s of row o (a block each), then
    out[o] = combine(init, the reduction of partial[o, :]) (a warp per output)."""
    acc_t, fill = math_[3], math_[6]
    n_out, n_red = math.prod(p_ext), math.prod(r_ext)
    splits = max(2, min(-(-n_red // params.split_min), params.split_blocks // n_out))
    chunk = -(-n_red // splits)
    splits = -(-n_red // chunk)
    with ir.InsertionPoint(g.op), g.op.location:
        part = memref.AllocOp(ir.MemRefType.get([n_out, splits], acc_t), [], []).result
        p1 = reduce.plan(chunk, limits.warp_size, params.threads, params.warp_max)
        launch, body = new_launch(-(-n_out * splits // p1.outs_per_block), p1.threads, name)
        with ir.InsertionPoint(body):
            b = _Chunks(body.arguments, g, *math_, part, chunk, n_red, p_ext, r_ext)
            reduce.kernel(b, p1, acc_t, n_out * splits, chunk, -(-chunk // p1.group), [n_out, splits], [chunk],
                          exact_grid=(n_out * splits) % p1.outs_per_block == 0, exact_rows=chunk % p1.group == 0)
            gpu.TerminatorOp()
        p2 = reduce.plan(splits, limits.warp_size, params.threads, params.warp_max)
        grid = -(-n_out // p2.outs_per_block)
        launch, body = new_launch(grid, p2.threads, name.rsplit("_", 1)[0] + "x_reduce")
        with ir.InsertionPoint(body):
            b = _Partials(body.arguments, g, *math_, part)
            reduce.kernel(b, p2, acc_t, n_out, splits, -(-splits // p2.group), p_ext, [splits],
                          exact_grid=grid * p2.outs_per_block == n_out, exact_rows=splits % p2.group == 0)
            gpu.TerminatorOp()
    if fill is not None:
        fill[0].erase()
    g.op.erase()


def _columns(g: Generic, par: list[int]) -> bool:
    """Every input reads along the last parallel dim (its innermost index, unit stride) and no
    reduced dim is innermost: consecutive outputs are consecutive addresses."""
    if not par or g.iters[-1] != "parallel" or par[-1] != len(g.iters) - 1:
        return False
    for buf, m in zip(g.inputs, g.maps):
        strides, _ = ir.MemRefType(buf.type).get_strides_and_offset()
        last = m.results[-1] if m.results else None
        if not (isinstance(last, ir.AffineDimExpr) and last.position == par[-1] and strides[-1] == 1):
            return False
    return True


def _emit_columns(g: Generic, name: str, params: ReduceParams, math_: tuple, p_ext: list[int],
                  r_ext: list[int]) -> None:
    """Two kernels, a thread per output each: partial[s, o] = the reduction of rows
    s * chunk .. (s + 1) * chunk of column o, then out[o] = combine(init, partial[:, o])
    (at most `column_splits` chunks: the second kernel's loads per thread)."""
    acc_t, fill = math_[3], math_[6]
    n_out, n_red = math.prod(p_ext), math.prod(r_ext)
    chunk = max(params.column_chunk, -(-n_red // params.column_splits))
    splits = -(-n_red // chunk)
    p = reduce.per_thread(params.threads)
    with ir.InsertionPoint(g.op), g.op.location:
        part = memref.AllocOp(ir.MemRefType.get([splits, n_out], acc_t), [], []).result
        launch, body = new_launch(-(-n_out * splits // p.threads), p.threads, name)
        with ir.InsertionPoint(body):
            b = _ColumnChunks(body.arguments, g, *math_, part, chunk, n_red, p_ext, r_ext)
            reduce.kernel(b, p, acc_t, n_out * splits, chunk, chunk, [splits, n_out], [chunk],
                          exact_grid=(n_out * splits) % p.threads == 0, exact_rows=True)
            gpu.TerminatorOp()
        launch, body = new_launch(-(-n_out // p.threads), p.threads, name.rsplit("_", 1)[0] + "x_reduce")
        with ir.InsertionPoint(body):
            b = _ColumnPartials(body.arguments, g, *math_, part)
            reduce.kernel(b, p, acc_t, n_out, splits, splits, p_ext, [splits],
                          exact_grid=n_out % p.threads == 0, exact_rows=True)
            gpu.TerminatorOp()
    if fill is not None:
        fill[0].erase()
    g.op.erase()


class _Ir(Ir):
    """The reduce kernel's math from the linalg body: loads of the inputs at (p, r), the body
    cloned, the combiner cloned at the accumulator type."""

    def __init__(self, ids, g: Generic, comb: ir.Operation, value: ir.Value, kind: str,
                 acc_t: ir.Type, par: list[int], red: list[int], fill):
        super().__init__(ids)
        self.g, self.comb, self.value, self.kind, self.acc_t = g, comb, value, kind, acc_t
        self.par, self.red, self.fill = par, red, fill
        self.signed = kind not in ("maxui", "minui")
        self.out_elem = ir.MemRefType(g.outputs[0].type).element_type

    def combine(self, x: ir.Value, y: ir.Value) -> ir.Value:
        new = self.comb.clone()
        new.operands[0], new.operands[1] = x, y
        new.results[0].set_type(self.acc_t)
        return new.results[0]

    def identity(self) -> ir.Value:
        return arith.constant(self.acc_t, identity_attr(self.kind, self.acc_t))

    def element(self, p_ivs: list[ir.Value], r_ivs: list[ir.Value]) -> ir.Value:
        g = self.g
        ivs = merge_dims(self.par, p_ivs, len(g.iters))
        for d, v in zip(self.red, r_ivs):
            ivs[d] = v
        mapping: dict[ir.Value, ir.Value] = {}
        for arg, buf, m in zip(g.body.arguments, g.inputs, g.maps):
            mapping[arg] = load_at(buf, m, ivs)
        clone_body([op.operation for op in g.body.operations][:-1], self.comb, mapping, ivs)
        return widen(mapping.get(self.value, self.value), self.acc_t, self.signed)

    def shuffle_xor(self, x: ir.Value, off: int, width: int) -> ir.Value:
        i32 = ir.IntegerType.get_signless(32)
        mode = ir.Attribute.parse("#gpu<shuffle_mode xor>")
        return gpu.ShuffleOp(x, arith.constant(i32, off), arith.constant(i32, width), mode).results[0]

    def block_reduce(self, x: ir.Value) -> ir.Value:
        op_attr = ir.Attribute.parse(f"#gpu<all_reduce_op {self.kind}>")
        return gpu.AllReduceOp(x, op=op_attr, uniform=True).result

    def out_index(self, p_ivs: list[ir.Value]) -> list[ir.Value]:
        g = self.g
        return map_indices(g.maps[-1], merge_dims(self.par, p_ivs, len(g.iters)))

    def init(self, idx: list[ir.Value]) -> ir.Value:
        init = self.fill[1] if self.fill is not None else memref.load(self.g.outputs[0], idx)
        return widen(init, self.acc_t, self.signed)

    def store(self, idx: list[ir.Value], val: ir.Value) -> None:
        memref.store(narrow(val, self.out_elem), self.g.outputs[0], idx)


class _Chunks(_Ir):
    """Kernel 1 of a split reduction: output (o, s) reduces elements s * chunk + j of row o into
    partial[o, s], starting from the identity."""

    def __init__(self, ids, g, comb, value, kind, acc_t, par, red, fill, part, chunk, n_red, p_ext, r_ext):
        super().__init__(ids, g, comb, value, kind, acc_t, par, red, fill)
        self.part, self.chunk, self.n_red, self.p_ext, self.r_ext = part, chunk, n_red, p_ext, r_ext

    columns = False  # partial[s, o] (_ColumnChunks), not partial[o, s]

    def element(self, p_ivs: list[ir.Value], r_ivs: list[ir.Value]) -> ir.Value:
        o, s = p_ivs[::-1] if self.columns else p_ivs
        r = self.add(self.mul(s, self.chunk), r_ivs[0])

        def visit() -> ir.Value:
            return super(_Chunks, self).element(delinearize(self, o, self.p_ext), delinearize(self, r, self.r_ext))

        if self.n_red % self.chunk == 0:
            return visit()
        return self.if_(self.lt(r, self.n_red), self.acc_t, visit, self.identity)

    def out_index(self, p_ivs: list[ir.Value]) -> list[ir.Value]:
        return list(p_ivs)

    def init(self, idx: list[ir.Value]) -> ir.Value:
        return self.identity()

    def store(self, idx: list[ir.Value], val: ir.Value) -> None:
        memref.store(val, self.part, idx)


class _Partials(_Ir):
    """Kernel 2 of a split reduction: out[o] = combine(init, the reduction of partial[o, :])."""

    def __init__(self, ids, g, comb, value, kind, acc_t, par, red, fill, part):
        super().__init__(ids, g, comb, value, kind, acc_t, par, red, fill)
        self.part = part

    columns = False  # partial[s, o] (_ColumnPartials), not partial[o, s]

    def element(self, p_ivs: list[ir.Value], r_ivs: list[ir.Value]) -> ir.Value:
        o = self.const(0)
        for x, n in zip(p_ivs, self.p_ext_of()):
            o = self.add(self.mul(o, n), x)
        return memref.load(self.part, [r_ivs[0], o] if self.columns else [o, r_ivs[0]])

    def p_ext_of(self) -> list[int]:
        return [self.g.ranges[d] for d in self.par]  # type: ignore[misc]


class _ColumnChunks(_Chunks):
    """Kernel 1 of a column reduction: output (s, o), o fastest (consecutive threads on
    consecutive columns), into partial[s, o]."""

    columns = True


class _ColumnPartials(_Partials):
    """Kernel 2 of a column reduction: out[o] = combine(init, the reduction of partial[:, o])."""

    columns = True
