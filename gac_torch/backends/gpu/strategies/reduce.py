"""`reduce`: a reduction with a recognized combiner (add, mul, min/max, and/or/xor) over at
least `min_extent` elements, when the reduced dims are innermost or the output is small: one warp
per output (rows up to `warp_max`, shuffle butterfly) or one block per output (gpu.all_reduce);
lanes stride over the reduction space with a constant trip count; f16/bf16 accumulate in f32,
small ints in i32. Run-time reduction lengths get a warp per row."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, gpu, memref, scf

from gac_torch.backends.gpu.analysis import Generic, fill_before, map_dims
from gac_torch.backends.gpu.irutil import (
    as_index, clone_body, defining_op, delinearize, is_static, load_at, map_indices, merge_dims,
    new_launch, size_ceildiv, size_prod,
)
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy


@dataclass(frozen=True)
class ReduceParams:
    threads: int = 256  # threads per block
    warp_max: int = 1024  # reductions up to this extent get one warp per output
    min_extent: int = 128  # smaller reductions stay sequential per thread (`loops`)


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


_COMBINERS = {
    "arith.addf": "add", "arith.addi": "add", "arith.mulf": "mul", "arith.muli": "mul",
    "arith.maxnumf": "maxnumf", "arith.minnumf": "minnumf", "arith.maximumf": "maximumf",
    "arith.minimumf": "minimumf", "arith.maxsi": "maxsi", "arith.minsi": "minsi",
    "arith.maxui": "maxui", "arith.minui": "minui", "arith.andi": "and", "arith.ori": "or",
    "arith.xori": "xor",
}


def _identity(kind: str, t: ir.Type) -> ir.Attribute:
    if isinstance(t, ir.FloatType):
        v = {"add": 0.0, "mul": 1.0, "maxnumf": -math.inf, "maximumf": -math.inf,
             "minnumf": math.inf, "minimumf": math.inf}[kind]
        return ir.FloatAttr.get(t, v)
    w = ir.IntegerType(t).width
    v = {"add": 0, "mul": 1, "maxsi": -(1 << (w - 1)), "minsi": (1 << (w - 1)) - 1, "maxui": 0,
         "minui": -1, "and": -1, "or": 0, "xor": 0}[kind]
    return ir.IntegerAttr.get(t, v)


def _widen(v: ir.Value, t: ir.Type, signed: bool) -> ir.Value:
    if v.type == t:
        return v
    if isinstance(t, ir.FloatType):
        return arith.extf(t, v)
    return arith.extsi(t, v) if signed else arith.extui(t, v)


def _narrow(v: ir.Value, t: ir.Type) -> ir.Value:
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
    if comb is None or comb.name not in _COMBINERS or comb.block != g.body:
        return False
    uses = list(out_arg.uses)
    if len(uses) != 1 or out_arg not in list(comb.operands):
        return False
    if any(op.regions and len(op.regions) for op in body_ops[:-2]):
        return False
    kind = _COMBINERS[comb.name]
    value = comb.operands[1] if comb.operands[0] == out_arg else comb.operands[0]
    with ir.InsertionPoint(g.op), g.op.location:  # run-time extents: memref.dim on the host
        p_ext = [g.extent(d) for d in par]
        r_ext = [g.extent(d) for d in red]
        n_out, n_red = size_prod(p_ext), size_prod(r_ext)
    if is_static(n_out) and (n_out == 0 or n_out > limits.max_grid[0]):
        return False
    # Short rows: one warp per output, 8 outputs per block, combined with shuffles. Long rows:
    # one block per output, combined with gpu.all_reduce (shuffles + shared memory). Rows of
    # run-time length take a warp each.
    warp = limits.warp_size
    per_warp = not is_static(n_red) or n_red <= params.warp_max
    threads = (params.threads if per_warp else
               min(params.threads, max(warp, 1 << (max(n_red, 1) - 1).bit_length())))
    group = warp if per_warp else threads  # threads cooperating on one output
    outs_per_block = threads // group
    elem = ir.MemRefType(g.outputs[0].type).element_type
    if isinstance(elem, ir.FloatType):
        acc_t = ir.F32Type.get() if ir.FloatType(elem).width < 32 else elem
    else:
        acc_t = ir.IntegerType.get_signless(32) if ir.IntegerType(elem).width < 32 else elem
    signed = kind not in ("maxui", "minui")
    fill = fill_before(g.op, g.outputs[0])

    def combine(x: ir.Value, y: ir.Value) -> ir.Value:
        new = comb.clone()
        new.operands[0], new.operands[1] = x, y
        new.results[0].set_type(acc_t)
        return new.results[0]

    with ir.InsertionPoint(g.op), g.op.location:
        grid = size_ceildiv(n_out, outs_per_block)
        trips = size_ceildiv(n_red, group)
        launch, body = new_launch(grid, threads, name)
        with ir.InsertionPoint(body):
            bid, tid = body.arguments[0], body.arguments[3]
            if per_warp:
                lane = arith.remui(tid, as_index(group))
                out_lin = arith.addi(arith.muli(bid, as_index(outs_per_block)), arith.divui(tid, as_index(group)))
            else:
                lane, out_lin = tid, bid
            active = None
            if not is_static(grid, n_out) or grid * outs_per_block != n_out:  # idle groups
                active = arith.cmpi(arith.CmpIPredicate.ult, out_lin, as_index(n_out))
            p_ivs = delinearize(out_lin, p_ext)
            ident = arith.constant(acc_t, _identity(kind, acc_t))
            # Constant trip count (lane + it * group): LLVM unrolls it and keeps loads in flight.
            loop = scf.ForOp(as_index(0), as_index(trips), as_index(1), [ident])
            with ir.InsertionPoint(loop.body):
                acc = loop.inner_iter_args[0]
                j = arith.addi(arith.muli(loop.induction_variable, as_index(group)), lane)
                cond = active
                if not is_static(n_red) or n_red % group:
                    in_row = arith.cmpi(arith.CmpIPredicate.ult, j, as_index(n_red))
                    cond = in_row if cond is None else arith.andi(cond, in_row)
                guard = scf.IfOp(cond, [acc_t], has_else=True) if cond is not None else None
                with ir.InsertionPoint(guard.then_block) if guard else ir.InsertionPoint(loop.body):
                    r_ivs = delinearize(j, r_ext)
                    ivs = merge_dims(par, p_ivs, len(g.iters))
                    for d, v in zip(red, r_ivs):
                        ivs[d] = v
                    mapping: dict[ir.Value, ir.Value] = {}
                    for arg, buf, m in zip(g.body.arguments, g.inputs, g.maps):
                        mapping[arg] = load_at(buf, m, ivs)
                    clone_body(body_ops[:-1], comb, mapping, ivs)
                    new = combine(acc, _widen(mapping.get(value, value), acc_t, signed))
                    if guard:
                        scf.YieldOp([new])
                if guard:
                    with ir.InsertionPoint(guard.else_block):
                        scf.YieldOp([acc])
                    new = guard.results[0]
                scf.YieldOp([new])
            total = loop.results[0]
            if per_warp:  # butterfly: every lane ends with the warp's total
                i32 = ir.IntegerType.get_signless(32)
                mode = ir.Attribute.parse("#gpu<shuffle_mode xor>")
                for off in (16, 8, 4, 2, 1):
                    other = gpu.ShuffleOp(total, arith.constant(i32, off), arith.constant(i32, warp),
                                          mode).results[0]
                    total = combine(total, other)
            else:
                op_attr = ir.Attribute.parse(f"#gpu<all_reduce_op {kind}>")
                total = gpu.AllReduceOp(total, op=op_attr, uniform=True).result
            leader = arith.cmpi(arith.CmpIPredicate.eq, lane, as_index(0))
            if active is not None:
                leader = arith.andi(leader, active)
            if_op = scf.IfOp(leader)
            with ir.InsertionPoint(if_op.then_block):
                out_idx = map_indices(g.maps[-1], merge_dims(par, p_ivs, len(g.iters)))
                init = fill[1] if fill is not None else memref.load(g.outputs[0], out_idx)
                final = combine(_widen(init, acc_t, signed), total)
                memref.store(_narrow(final, elem), g.outputs[0], out_idx)
                scf.YieldOp([])
            gpu.TerminatorOp()
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True
