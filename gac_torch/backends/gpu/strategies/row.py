"""`row`: a row group (backends/gpu/rows.py: elementwise producers -> row reductions ->
elementwise consumers over the same rows) as ONE kernel, gac_torch/kernels/rows.py: a warp or a
block per row, the row in registers (16-byte vector loads), read once, outputs written once. Its
math is cloned from the members' linalg bodies through the builder's `Ir` backend; f16/bf16
reductions accumulate in f32. Rows too long for registers stream through them in chunks (one
pass over the row per reduction) when there are enough rows to fill the GPU. Groups with
run-time sizes or 64-bit accumulators stay separate kernels (`reduce` and `loops`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, bufferization, gpu, llvm, memref, vector

from gac_torch.backends.gpu.irutil import block_ops, clone_into, new_launch
from gac_torch.backends.gpu.rows import Leaf, RowGroup, flat, leaf_buffer, output_buffer, replace_members
from gac_torch.backends.gpu.strategies.reduce import COMBINERS, identity_attr, narrow, widen
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.kernels import rows
from gac_torch.kernels.builder import Ir, delinearize

WORKGROUP = 3  # gpu address space of shared memory


@dataclass(frozen=True)
class RowParams:
    threads: int = 256  # per block when a row takes part of a block
    max_elems: int = 32  # row elements a thread may hold in registers
    pref_elems: int = 16  # ... and would rather hold
    min_block_group: int = 64  # threads per row once a row needs more than a warp
    stream_min_rows: int = 128  # rows too long to hold are streamed only when there are this many
    # (else a block per row leaves the GPU idle: `reduce` splits a few long rows over many blocks)
    vector_bytes: int = 16
    # cuda: rows of tensors this large (each full input or output, bytes) stream past the
    # caches: inputs `ld.global.nc.L1::no_allocate`, outputs `st.global.cs` (evict first);
    # None: plain accesses (vortex). Opt-in (GAC_ROWS_STREAM=auto|all): no gain measured on the H200
    stream_min_bytes: int | None = None
    # cuda: x / r with r a row value (softmax's sum) as x * (1 / r), one division a row and
    # thread. Opt-in (GAC_ROWS_RCP=1): no gain measured on the H200 (default: a correctly rounded
    # division per element, as eager)
    row_reciprocal: bool = False


@dataclass
class _Match:
    group: RowGroup
    plan: rows.Plan
    combs: dict[int, tuple[ir.Operation, ir.Value, str, ir.Type]]  # reduce node -> comb, value, kind, acc
    stream: bool = False  # full-row vector accesses with streaming cache hints (RowParams)
    rcp: bool = False  # divisions by a row value as products with its reciprocal (RowParams)


def _elem(v: ir.Value) -> ir.Type:
    t = v.type
    return ir.ShapedType(t).element_type if isinstance(t, ir.ShapedType) else t


def _bytes(t: ir.Type) -> int | None:
    if isinstance(t, ir.FloatType):
        return ir.FloatType(t).width // 8
    if isinstance(t, ir.IntegerType) and ir.IntegerType(t).width >= 8:
        return ir.IntegerType(t).width // 8
    return None  # i1, index: scalar accesses only


def strategy(params: RowParams = RowParams()) -> Strategy:
    def match(g: RowGroup, limits: GpuLimits) -> _Match | None:
        combs = {}
        for i, (nd, op) in enumerate(zip(g.nodes, g.ops)):
            if nd.op == "reduce":
                c = _combiner(op)
                if c is None:
                    return None
                combs[i] = c
        widths = []
        for nd, op in zip(g.nodes, g.ops):
            if nd.space in ("full", "col"):
                v = op.value if isinstance(op, Leaf) else op.results[0]
                b = _bytes(_elem(v))
                if b is None or (isinstance(op, Leaf) and op.slice is not None):
                    b = params.vector_bytes  # one element per access
                widths.append(b)
        vec = params.vector_bytes // max(widths, default=4)
        while g.C % vec:
            vec //= 2
        p = rows.plan(g.R, g.C, vec, limits.warp_size, params.threads, params.max_elems,
                      limits.max_threads_per_block, params.min_block_group, params.pref_elems)
        if p is None or p.grid > limits.max_grid[0] or (p.trips > 1 and g.R < params.stream_min_rows):
            return None
        rcp = params.row_reciprocal and os.environ.get("GAC_ROWS_RCP", "0") == "1"
        return _Match(g, p, combs, _streams(g, params), rcp)

    def emit(m: _Match, name: str, limits: GpuLimits) -> bool:
        _emit(m, name)
        return True

    return Strategy("row", match, emit, on="rows")


def _streams(g: RowGroup, params: RowParams) -> bool:
    """Cache hints on: the switch is on and some full input or output is that large (at least
    the L2: what a later kernel could have found there is mostly gone anyway)."""
    mode = os.environ.get("GAC_ROWS_STREAM", "0")  # 0: off; auto: past stream_min_bytes; all: every size
    if params.stream_min_bytes is None or mode == "0":
        return False
    if mode == "all":
        return True
    elems = [_bytes(_elem(op.value if isinstance(op, Leaf) else op.results[0])) or 0
             for nd, op in zip(g.nodes, g.ops) if nd.space == "full" and (nd.out or nd.op == "load")]
    return g.R * g.C * max(elems, default=0) >= params.stream_min_bytes


def _combiner(op: ir.Operation) -> tuple[ir.Operation, ir.Value, str, ir.Type] | None:
    """(combiner op, the combined element value, kind, accumulator type) of a reduction body;
    accumulators are 32-bit (warp shuffles move 32 bits)."""
    body = op.regions[0].blocks[0]
    ops = block_ops(body)
    out_arg = body.arguments[len(op.opview.inputs)]
    comb = ops[-1].operands[0].owner
    comb = comb.operation if hasattr(comb, "operation") else comb
    if not isinstance(comb, ir.Operation) or comb.name not in COMBINERS or comb.block != body:
        return None
    if len(list(out_arg.uses)) != 1 or out_arg not in list(comb.operands):
        return None
    value = comb.operands[1] if comb.operands[0] == out_arg else comb.operands[0]
    elem = _elem(op.results[0])
    if isinstance(elem, ir.FloatType):
        if ir.FloatType(elem).width > 32:
            return None
        acc = ir.F32Type.get()
    elif isinstance(elem, ir.IntegerType) and ir.IntegerType(elem).width <= 32:
        acc = ir.IntegerType.get_signless(32)
    else:
        return None
    return comb, value, COMBINERS[comb.name], acc


def _emit(m: _Match, name: str) -> None:
    g, p = m.group, m.plan
    last = g.members[-1]
    space = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), WORKGROUP)
    smem_t = {i: ir.MemRefType.get([p.warps_per_group], acc, memory_space=space)
              for i, (_, _, _, acc) in m.combs.items()}
    for i, nd in enumerate(g.nodes):  # a picked element goes through one shared word
        if nd.op == "pick":
            smem_t[i] = ir.MemRefType.get([1], _elem(g.ops[nd.args[0]].results[0]), memory_space=space)
    with ir.InsertionPoint(last), last.location:
        bufs: dict[int, ir.Value] = {}
        for i, op in enumerate(g.ops):
            if isinstance(op, Leaf) and isinstance(op.value.type, ir.RankedTensorType):
                bufs[i] = leaf_buffer(op.value)
        outs = {i: output_buffer(v) for i, v in g.results.items()}
        flats = {i: flat(b) for i, b in outs.items()}
        red = sorted(smem_t) if p.group > p.warp else []
        launch, body = new_launch(p.grid, p.threads, name, tuple(smem_t[i] for i in red))
        with ir.InsertionPoint(body):
            smem = dict(zip(red, list(body.arguments)[12:]))
            rows.kernel(_Ir(body.arguments, m, bufs, flats, smem), p, g.nodes)
            gpu.TerminatorOp()
        tensors = {i: bufferization.ToTensorOp(g.results[i].type, b, restrict=True, writable=True).result
                   for i, b in outs.items()}
    replace_members(g, tensors)


class _Ir(Ir):
    """kernels/rows.py's verbs on the group: loads of the leaves, the members' bodies cloned."""

    def __init__(self, ids, m: _Match, bufs: dict[int, ir.Value], outs: dict[int, ir.Value],
                 smem: dict[int, ir.Value]):
        super().__init__(ids)
        self.m, self.g, self.bufs, self.outs, self.smem = m, m.group, bufs, outs, smem
        self.rcps: dict[tuple, ir.Value] = {}  # (row value, block) -> its reciprocal there

    # -- memory
    def _index(self, i: int, row, col, e: int, space: str) -> list[ir.Value]:
        C = self.g.C
        lin = (self.add(self.mul(row, C), col) if space == "full" else row if space == "row"
               else col if space == "col" else self.const(0))
        if e:
            lin = self.add(lin, e)
        leaf = self.g.ops[i] if i < len(self.g.ops) else None
        if space == "other":  # the element's loop indices -> the leaf's (row-major) index
            lin = self.add(self.mul(row, C), col if not e else self.add(col, e))
            ranges, dims = leaf.gather
            ivs = delinearize(self, lin, ranges)
            shape = ir.RankedTensorType(leaf.value.type).shape
            lin, stride = self.const(0), 1
            for d in range(len(shape) - 1, -1, -1):
                if dims[d] is not None and shape[d] != 1:
                    lin = self.add(lin, self.mul(ivs[dims[d]], stride))
                stride *= shape[d]
        elif isinstance(leaf, Leaf) and leaf.slice is not None:  # slice index -> source index
            offs, sizes, strides = leaf.slice
            src = ir.RankedTensorType(leaf.value.type).shape
            idx = delinearize(self, lin, sizes)  # (unit dims: 0)
            lin, stride = self.const(0), 1
            for d in range(len(src) - 1, -1, -1):
                at = self.add(self.mul(idx[d], strides[d]), offs[d])
                lin = self.add(lin, self.mul(at, stride))
                stride *= src[d]
        buf = self.bufs.get(i, self.outs.get(i))
        return [] if ir.MemRefType(buf.type).rank == 0 else [lin]

    def load(self, i: int, row, col, vec: int, cond) -> list[ir.Value]:
        leaf = self.g.ops[i]
        if not isinstance(leaf.value.type, ir.RankedTensorType):
            return [leaf.value] * vec  # a scalar operand
        buf, elem = self.bufs[i], _elem(leaf.value)
        if leaf.slice is not None or vec == 1 or leaf.space == "other":
            def one(e: int) -> ir.Value:
                idx = self._index(i, row, col, e, leaf.space)
                return self._guard(cond, elem, lambda: memref.load(buf, idx))
            return [one(e) for e in range(vec)]
        vt = ir.VectorType.get([vec], elem)
        idx = self._index(i, row, col, 0, leaf.space)
        align = vec * (_bytes(elem) or 1)
        if self._hinted(leaf.space, vec, elem):
            base, k = _split_const(col)  # (the slot's constant column offset: an immediate)
            lin = self._index(i, row, base, 0, "full")[0] if base is not None else self.mul(row, self.g.C)
            v = self._guard(cond, vt, lambda: self._asm_load(buf, lin, k, vt, elem))
        else:
            v = self._guard(cond, vt, lambda: vector.load(vt, buf, idx, alignment=align))
        return [vector.extract(v, [], [e]) for e in range(vec)]

    # -- streaming accesses (cuda): 16/8/4-byte vectors through inline PTX with a cache hint
    def _hinted(self, space: str, vec: int, elem: ir.Type) -> bool:
        nbytes = vec * (_bytes(elem) or 0)
        return self.m.stream and space == "full" and nbytes in (4, 8, 16)

    def _address(self, buf: ir.Value, lin: ir.Value, elem: ir.Type) -> ir.Value:
        base = memref.extract_aligned_pointer_as_index(buf)  # kernel buffers: identity layout
        at = self.add(base, self.mul(lin, _bytes(elem)))
        return arith.index_cast(ir.IntegerType.get_signless(64), at)

    def _asm_load(self, buf: ir.Value, lin: ir.Value, k: int, vt: ir.Type, elem: ir.Type) -> ir.Value:
        """`n` words at element lin + k (k: an immediate byte offset, the slot's column)."""
        i32 = ir.IntegerType.get_signless(32)
        n = ir.VectorType(vt).shape[0] * _bytes(elem) // 4
        regs = ", ".join(f"${j}" for j in range(n))
        at = f"[${n}+{k * _bytes(elem)}]" if k else f"[${n}]"
        text = (f"ld.global.nc.L1::no_allocate.v{n}.b32 {{{regs}}}, {at};" if n > 1
                else f"ld.global.nc.L1::no_allocate.b32 $0, {at};")
        res_t = i32 if n == 1 else ir.Type.parse(f"!llvm.struct<({', '.join(['i32'] * n)})>")
        r = llvm.inline_asm(res_t, [self._address(buf, lin, elem)], text, "=r," * n + "l")
        words = [r] if n == 1 else [llvm.extractvalue(i32, r, [j]) for j in range(n)]
        wv = vector.from_elements(ir.VectorType.get([n], i32), words)
        return wv if ir.VectorType.get([n], i32) == vt else vector.bitcast(vt, wv)

    def _asm_store(self, buf: ir.Value, lin: ir.Value, k: int, v: ir.Value, elem: ir.Type) -> None:
        i32 = ir.IntegerType.get_signless(32)
        vt = ir.VectorType(v.type)
        n = vt.shape[0] * _bytes(elem) // 4
        wt = ir.VectorType.get([n], i32)
        wv = v if vt == wt else vector.bitcast(wt, v)
        words = [vector.extract(wv, [], [j]) for j in range(n)]
        regs = ", ".join(f"${j + 1}" for j in range(n))
        at = f"[$0+{k * _bytes(elem)}]" if k else "[$0]"
        text = f"st.global.cs.v{n}.b32 {at}, {{{regs}}};" if n > 1 else f"st.global.cs.b32 {at}, $1;"
        llvm.inline_asm(None, [self._address(buf, lin, elem), *words], text, "l" + ",r" * n,
                        has_side_effects=True)

    def _guard(self, cond, t: ir.Type, then):
        if cond is None:
            return then()
        zero = (arith.constant(t, ir.DenseElementsAttr.get_splat(t, _zero(ir.VectorType(t).element_type)))
                if isinstance(t, ir.VectorType) else arith.constant(t, _zero(t)))
        return self.if_(cond, t, then, lambda: zero)

    def store(self, i: int, row, col, vals: list[ir.Value], cond) -> None:
        space = self.g.nodes[i].space
        buf = self.outs[i]

        def put() -> None:
            idx = self._index(i, row, col if col is not None else self.const(0), 0, space)
            if len(vals) == 1:
                memref.store(vals[0], buf, idx)
            elif self._hinted(space, len(vals), vals[0].type):
                vt = ir.VectorType.get([len(vals)], vals[0].type)
                base, k = _split_const(col)
                lin = self._index(i, row, base, 0, space)[0] if base is not None else self.mul(row, self.g.C)
                self._asm_store(buf, lin, k, vector.from_elements(vt, vals), vals[0].type)
            else:
                vt = ir.VectorType.get([len(vals)], vals[0].type)
                vector.store(vector.from_elements(vt, vals), buf, idx,
                             alignment=len(vals) * (_bytes(vals[0].type) or 1))

        if cond is None:
            put()
        else:
            self.when(cond, put)

    def smem_put(self, i: int, w, v) -> None:
        memref.store(v, self.smem[i], [w])

    def smem_get(self, i: int, w: int) -> ir.Value:
        return memref.load(self.smem[i], [self.const(w)])

    def barrier(self) -> None:
        gpu.barrier()

    # -- math
    def _clone(self, op: ir.Operation, args: list[ir.Value], skip: ir.Operation | None) -> dict:
        body = op.regions[0].blocks[0]
        mapping = dict(zip(list(body.arguments), args))
        clone_into([o for o in block_ops(body)[:-1] if skip is None or o != skip], mapping)
        return mapping

    def compute(self, i: int, args: list[ir.Value]) -> ir.Value:
        op = self.g.ops[i]
        y = block_ops(op.regions[0].blocks[0])[-1].operands[0]
        mapping = self._clone(op, args, None)
        if self.m.rcp and self.g.nodes[i].space in rows.PER_COLUMN:
            per_row = [v for a, v in zip(self.g.nodes[i].args, args) if self.g.nodes[a].space in ("row", "scalar")]
            for o in block_ops(op.regions[0].blocks[0])[:-1]:
                if o.name == "arith.divf" and o.results[0] in mapping:
                    mapping[o.results[0]] = self._by_reciprocal(mapping[o.results[0]], per_row)
        return mapping.get(y, y)

    def _by_reciprocal(self, q: ir.Value, per_row: list[ir.Value]) -> ir.Value:
        """A cloned x / r whose r is a row value -> x * (1 / r), 1 / r once a row (per block
        of code: once per streamed chunk)."""
        div = q.owner.operation if isinstance(q.owner, ir.OpView) else q.owner
        x, r = div.operands[0], div.operands[1]
        if not any(r == v for v in per_row):
            return q
        key = (r, div.block)
        with ir.InsertionPoint(div), div.location:
            if key not in self.rcps:
                one = arith.constant(r.type, ir.FloatAttr.get(r.type, 1.0))
                self.rcps[key] = arith.divf(one, r)
            prod = arith.mulf(x, self.rcps[key])
        q.replace_all_uses_with(prod)
        div.erase()
        return prod

    def element(self, i: int, args: list[ir.Value]) -> ir.Value:
        comb, value, kind, acc = self.m.combs[i]
        x = self._clone(self.g.ops[i], args, comb).get(value, value)
        return widen(x, acc, kind not in ("maxui", "minui"))

    def combine(self, i: int, x: ir.Value, y: ir.Value) -> ir.Value:
        comb, _, _, acc = self.m.combs[i]
        new = comb.clone()
        new.operands[0], new.operands[1] = x, y
        new.results[0].set_type(acc)
        return new.results[0]

    def identity(self, i: int) -> ir.Value:
        _, _, kind, acc = self.m.combs[i]
        return arith.constant(acc, identity_attr(kind, acc))

    def finish(self, i: int, total: ir.Value, init: ir.Value | None) -> ir.Value:
        _, _, kind, acc = self.m.combs[i]
        start = init if init is not None else self.g.fills[i]
        elem = _elem(self.g.ops[i].results[0])
        return narrow(self.combine(i, widen(start, acc, kind not in ("maxui", "minui")), total), elem)

    def select(self, cond, x, y, ty=None):
        return arith.select(cond, x, y)

    def shuffle_xor(self, x: ir.Value, off: int, width: int) -> ir.Value:
        i32 = ir.IntegerType.get_signless(32)
        return self._shuffle(x, arith.constant(i32, off), width, "xor")

    def shuffle_idx(self, x: ir.Value, src: ir.Value, width: int) -> ir.Value:
        return self._shuffle(x, arith.index_cast(ir.IntegerType.get_signless(32), src), width, "idx")

    def _shuffle(self, x: ir.Value, lane: ir.Value, width: int, mode: str) -> ir.Value:
        i32 = ir.IntegerType.get_signless(32)
        m = ir.Attribute.parse(f"#gpu<shuffle_mode {mode}>")
        return gpu.ShuffleOp(x, lane, arith.constant(i32, width), m).results[0]


def _split_const(v: ir.Value, depth: int = 0) -> tuple[ir.Value | None, int]:
    """v = base + k with k the constant part of its index adds and products by constants
    (base None: v is the constant k); the rest of v rebuilt without it."""
    op = v.owner.operation if isinstance(v.owner, ir.OpView) else v.owner
    if not isinstance(op, ir.Operation) or depth > 6:
        return v, 0
    if op.name == "arith.constant" and isinstance(op.attributes["value"], ir.IntegerAttr):
        return None, ir.IntegerAttr(op.attributes["value"]).value
    if op.name not in ("arith.addi", "arith.muli"):
        return v, 0
    (a, ka), (b, kb) = _split_const(op.operands[0], depth + 1), _split_const(op.operands[1], depth + 1)
    with ir.InsertionPoint(op), op.location:
        if op.name == "arith.addi":
            if ka == kb == 0:
                return v, 0
            return (a if b is None else b if a is None else arith.addi(a, b)), ka + kb
        if a is None and b is None:
            return None, ka * kb
        if a is None or b is None:  # (x + k) * c = x * c + k * c
            x, c = (b, ka) if a is None else (a, kb)  # (x + kx) * c, c the constant factor
            kx = kb if a is None else ka
            if kx == 0:
                return v, 0
            return arith.muli(x, arith.constant(ir.IndexType.get(), c)), kx * c
        return v, 0


def _zero(t: ir.Type):
    return ir.FloatAttr.get(t, 0.0) if isinstance(t, ir.FloatType) else ir.IntegerAttr.get(t, 0)
