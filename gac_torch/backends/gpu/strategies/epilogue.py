"""Epilogue fusion for the GEMM strategies (igemm/sgemm, wgmma, tiled_gemm): the elementwise ops
right after a contraction that only it feeds (bias, BatchNorm-eval, ReLU, residual add, output
cast) are found here and run in the contraction kernel's store step; the ops are marked FUSED and
erased when the scheduler reaches them, with the intermediate buffer they read."""

from __future__ import annotations

import os

from mlir import ir

from gac_torch.backends.gpu.analysis import (
    Generic, analyze, map_dims, read_at_own_point,
)
from gac_torch.backends.gpu.irutil import (
    VIEW_OPS, block_ops, buffer_root, defining_op, erase_if_unused, op_at, op_index, static_memref, top_level, users,
    users_now,
)
from gac_torch.backends.gpu.schedule import HOISTABLE
from gac_torch.backends.gpu.strategy import settle, views_pending
from gac_torch.kernels import conv_gemm
from gac_torch.kernels.gemm_epilogue import EOp, Epilogue


def affine_terms(e: ir.AffineExpr) -> tuple[dict[int, int], int] | None:
    """An affine expression as ({dim: coefficient}, constant), or None (mod, floordiv, ...)."""
    if isinstance(e, ir.AffineDimExpr):
        return {e.position: 1}, 0
    if isinstance(e, ir.AffineConstantExpr):
        return {}, e.value
    if isinstance(e, ir.AffineAddExpr):
        x, y = affine_terms(e.lhs), affine_terms(e.rhs)
        if x is None or y is None:
            return None
        out = dict(x[0])
        for d, k in y[0].items():
            out[d] = out.get(d, 0) + k
        return out, x[1] + y[1]
    if isinstance(e, ir.AffineMulExpr):
        x, y = affine_terms(e.lhs), affine_terms(e.rhs)
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
    terms = [affine_terms(e) for e in m.results]
    if any(x is None for x in terms):
        return None
    strides, offset = t.get_strides_and_offset()
    return conv_gemm.operand(str(t), str(t.element_type), tuple(t.shape), tuple(strides), offset,
                             terms, m.n_dims)  # type: ignore[arg-type]


FUSED = "gac.fused_epilogue"  # an elementwise op that now runs in its producer's kernel


def erase_fused(op: ir.Operation) -> None:
    """Erase a consumer fused into a contraction's epilogue, and the intermediate it read."""
    roots = [buffer_root(v) for v in op.operands if isinstance(v.type, ir.MemRefType)]
    op.erase()
    for root in roots:
        erase_if_unused(root)


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


def _consumer(prev: ir.Operation, y: ir.Value, avoid: set, interchange: bool = False, tap: bool = False):
    """The elementwise generic right after `prev` (views and constants aside) that reads the
    dense scratch buffer y once, at its own point (`interchange`: or through a permutation, its
    loops then permuted), or None (`tap`: y may be a buffer of its own, not an allocation, which
    the epilogue then stores too). Returns (generic, index of its y
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
    scratch = alloc is not None and alloc.name == "memref.alloc"
    if not (scratch or (tap and alloc is None)) or not _dense(yt) or _numel(yt) != _numel(ir.MemRefType(root.type)):
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
    waiting: list[ir.Operation] = []  # stand-ins whose kernels may view the buffer once in place

    def fixed(v: ir.Value, lazy: bool = False) -> bool:
        for use in v.uses:
            o = use.owner.operation if hasattr(use.owner, "operation") else use.owner
            if o.name in VIEW_OPS and (len(o.operands) != 1 or not fixed(o.results[0], lazy)):
                return False
            if lazy and o.name == "func.call" and views_pending(o, use.operand_number):
                waiting.append(o)
        return True

    # A kernel still pending (a stand-in) only adds uses once in place: a no from the uses in
    # place stands, and so does a yes when no pending kernel's template views the buffer (its
    # text says: strategy.views_pending). Only otherwise are they put in place first (settle),
    # folding here what no worker has started on (GAC_GPU_LAZY_SETTLE=0: always, as before).
    if lazy_settle():
        if not all(len(o.operands) == 1 for o in own) or not fixed(root, lazy=True):
            return False
        if not waiting:
            return True
    settle(root)  # (kernels whose templates are folded meanwhile: in place first)
    return fixed(root) and all(len(o.operands) == 1 for o in own)


def lazy_settle() -> bool:
    """GAC_GPU_LAZY_SETTLE (default on): _renamable answers from the stand-ins' template texts
    where they suffice, rather than putting the pending kernels in place first."""
    return os.environ.get("GAC_GPU_LAZY_SETTLE", "1") != "0"


def rename_from(z: ir.Value, first: ir.Operation, before: ir.Operation) -> ir.Value:
    """A fresh allocation (made before `before`) takes over z's buffer from op `first` on: the
    fused kernel must not write a buffer its own inputs are read from. Returns z's view of it."""
    root = buffer_root(z)
    fresh = defining_op(root).clone(ir.InsertionPoint(before)).results[0]
    own = _view_chain(z)

    # (a pending kernel's stand-in stands where its kernel will: `later` is the same for both,
    # and a stand-in's operands redirected here are the kernel's: strategy._resolve)
    seen_by = users_now if lazy_settle() else users

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
            elif o.name in VIEW_OPS and o not in own and any(later(u) for u in seen_by(o.results[0])):
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
                   interchange: bool = False, taps: bool = False):
    """(consumer ops, Epilogue, its extra template arguments) for the longest chain (up to
    `stages`) of elementwise generics after g, each reading the previous one's result (e.g. the
    f32 -> bf16 -> f32 rounding in place, then BatchNorm + ReLU across a reshape), whose
    intermediate buffers nothing else touches. `interchange`: the first may read g's result
    through a permutation (igemm; the other GEMM strategies' stores assume C's own order).
    `taps` (the conv_gemm template): an intermediate may also be a function argument (a graph
    output: the MLP's pre-activation, saved for the backward, then GELU), stored as well."""
    conv_roots = {buffer_root(v) for v in ins}  # the kernel reads these until it ends
    found: list = []
    prev, y = g.op, g.outputs[0]
    while len(found) < stages:
        st = _consumer(prev, y, conv_roots, interchange, tap=taps and prev != g.op)
        if st is None or _body_ops(st[0]) is None or operand_at(st[4], st[0].maps[-1]) is None:
            break
        found.append(st)
        prev, y = st[0].op, st[4]
    for n in range(len(found), 0, -1):
        chain = found[:n]
        final = buffer_root(chain[-1][4])
        scratch = {st[5] for st in chain} | {buffer_root(st[4]) for st in chain[:-1]}
        scratch = {r for r in scratch if defining_op(r) is not None}  # (taps: function arguments)
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
    taps: list = []  # (value, (Operand, space)) of intermediates in buffers of their own
    tapped: list[ir.Value] = []
    result = None
    for n, (e, ky, more, vals, z, _) in enumerate(chain):
        prev_e, prev_z = chain[n - 1][0], chain[n - 1][4]
        if n and defining_op(buffer_root(prev_z)) is None:  # the previous stage's own buffer
            taps.append((result, _over_conv_dims((operand_at(prev_z, prev_e.maps[-1]), tuple(prev_e.ranges)), g)))
            tapped.append(prev_z)
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
    return ([st[0].op for st in chain], Epilogue(tuple(inputs), out, tuple(ops), result, tuple(taps)),  # type: ignore[arg-type]
            [*values, *tapped, z])


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
