"""The schedule's step for row groups: linalg generics on tensors that iterate the same R rows x
C columns and pass values to each other element for element (a full value) or row for row (a
reduction's result) -- LayerNorm, RMSNorm, softmax, any elementwise producer -> row reduction(s)
-> elementwise consumer chain -- are offered together to the target's "rows" strategies, which
may turn the whole group into one kernel (strategies/row.py, kernels/rows.py).

The rule is the dataflow, not op names: a group grows from a row reduction (parallel dims, then
reduction dims) to every generic that reads or produces one of its values with a matching
access -- per element (the row-major flat index r * C + c on both sides, through reshapes) or
per row. Other operands are leaves the kernel loads: full, per row, per column (a weight) or one
scalar, also through a static `tensor.extract_slice` (LayerNorm's shift by x[:, 0]).

Runs on linalg-on-tensors after elementwise fusion, before bufferization. The kernel reads its
leaves through `bufferization.to_buffer ... read_only` and writes fresh buffers that
`to_tensor ... restrict writable` hands back, as attention.py does for its calls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mlir import ir
from mlir.dialects import bufferization, memref

from gac_torch.backends.gpu.bufferize import is_fill
from gac_torch.backends.gpu.irutil import block_ops, defining_op, func_block, top_level
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy

_RESHAPES = ("tensor.expand_shape", "tensor.collapse_shape")
_PURE = (*_RESHAPES, "tensor.extract_slice", "tensor.empty")


@dataclass
class Leaf:
    value: ir.Value  # the tensor the kernel reads (a slice's source when `slice` is set)
    space: str  # full | row | col | scalar
    slice: tuple[list[int], list[int], list[int]] | None = None  # offsets, sizes, strides
    gather: tuple[list[int], list[int | None]] | None = None  # `other`: loop ranges; per leaf dim
    # the loop dim indexing it (None: a unit dim)


@dataclass
class RowGroup:
    """Members in block order; `nodes` the kernel program (kernels/rows.py), `ops[i]` what node
    i is: a Leaf, or the member generic it computes; `fills[i]` a reduction's constant start;
    `results[i]` the member result an output node replaces."""

    R: int
    C: int
    members: list[ir.Operation]
    nodes: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    fills: dict[int, ir.Value] = field(default_factory=dict)
    results: dict[int, ir.Value] = field(default_factory=dict)


def map_rows(fn: ir.Operation, strategies: Sequence[Strategy], limits: GpuLimits,
             counter: Iterator[int]) -> None:
    """Offer each row group of `fn` to the "rows" strategies; the first that emits it owns it."""
    mine = [s for s in strategies if s.on == "rows"]
    if not mine:
        return
    tried: set = set()
    others: set = set()  # generics that are no seed: taking a group does not change that (and
    # makes no generics), so the scans after it skip them rather than ask _form again
    memo: dict = {}  # (generic, R, C, flat) -> its _form, generic -> its _base, for find_group
    reduces: set = set()  # the seeds not tried yet, known from an earlier scan (same reason)
    while True:  # the block changes with each group taken: scan it again
        seeds = []
        for op in block_ops(func_block(fn)):
            if op.name != "linalg.generic" or op in tried or op in others:
                continue
            if op not in reduces and op not in memo:
                memo[op] = _base(op)
            if op in reduces or (_form(op, base=memo[op]) or ("",))[0] == "reduce":
                reduces.add(op)
                seeds.append(op)
            else:
                others.add(op)
        for seed in seeds:
            tried.add(seed)
            group = find_group(seed, memo=memo)
            if group is not None and any(_take(s, group, limits, counter) for s in mine):
                break
        else:
            return


def _take(s: Strategy, group: RowGroup, limits: GpuLimits, counter: Iterator[int]) -> bool:
    m = s.match(group, limits)
    return m is not None and s.emit(m, f"gac_k{next(counter)}_{s.name}", limits)


# ------------------------------------------------------------------------------------------------
# forms and accesses


def _ranges(op: ir.Operation) -> list[int] | None:
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    n = maps[0].n_dims if maps else 0
    ranges: list[int | None] = [None] * n
    for v, m in zip(op.operands, maps):
        if not isinstance(v.type, ir.RankedTensorType):
            continue
        for size, e in zip(ir.RankedTensorType(v.type).shape, m.results):
            if isinstance(e, ir.AffineDimExpr):
                if size < 0:
                    return None
                ranges[e.position] = size
    return None if None in ranges else ranges  # type: ignore[return-value]


def _base(op: ir.Operation) -> tuple[list[int], list[bool]] | None:
    """(ranges, reduction dims) of a generic _form can give a form, whatever (R, C); else None."""
    if op.name != "linalg.generic" or len(op.results) != 1 or is_fill(op):
        return None
    if not all(isinstance(v.type, ir.RankedTensorType) or not isinstance(v.type, ir.ShapedType)
               for v in op.operands):
        return None
    body = op.regions[0].blocks[0]
    if any(o.name == "linalg.index" or o.regions and len(o.regions) for o in block_ops(body)):
        return None
    ranges = _ranges(op)
    if ranges is None:
        return None
    iters = ["reduction" in str(a) for a in op.attributes["iterator_types"]]
    if not any(iters) and any(list(a.uses) for a in list(body.arguments)[len(op.opview.inputs):]):
        return None  # a map that reads its init
    return ranges, iters


def _form(op: ir.Operation, R: int | None = None, C: int | None = None, flat: bool = True,
          base: tuple | None | bool = False):
    """(kind, ranges, row dims, col dims) of a single-result generic on static tensors: kind
    "reduce" (parallel dims, then reduction dims), "full" (all parallel, R*C points split into
    rows then columns) or "row" (all parallel, R points); None if none fits (R, C). (`base`:
    its _base, known already.)"""
    if base is False:
        base = _base(op)
    if base is None:
        return None
    ranges, iters = list(base[0]), base[1]  # type: ignore[index]
    n = len(iters)
    if any(iters):
        k = iters.index(True)
        if not all(iters[k:]):
            return None
        r, c = math.prod(ranges[:k]), math.prod(ranges[k:])
        if c < 2 or (R is not None and (r, c) != (R, C)):
            return None
        return "reduce", ranges, list(range(k)), list(range(k, n))
    if R is None:
        return None
    for k in range(n + 1):
        if math.prod(ranges[:k]) == R and math.prod(ranges[k:]) == C:
            return "full", ranges, list(range(k)), list(range(k, n))
    if math.prod(ranges) == R:
        return "row", ranges, list(range(n)), []
    if flat and math.prod(ranges) == R * C:  # R*C points whose dims straddle the rows (GroupNorm's affine)
        return "full", ranges, None, list(range(n))
    return None


def _access(m: ir.AffineMap, t: ir.Type, form) -> str | None:
    """How a generic of `form` reads an operand of type `t` through map `m`."""
    if not isinstance(t, ir.RankedTensorType):
        return "scalar"
    kind, ranges, rows, cols = form
    dims = []
    for e, size in zip(m.results, ir.RankedTensorType(t).shape):
        if isinstance(e, ir.AffineDimExpr):
            if size != 1:
                dims.append(e.position)
        elif not (isinstance(e, ir.AffineConstantExpr) and e.value == 0 and size == 1):
            return None
    nr = [d for d in rows or [] if ranges[d] != 1]
    nc = [d for d in cols if ranges[d] != 1]
    options = [("full", nr + nc), ("row", nr), ("col", nc), ("scalar", [])]
    if kind == "row":
        return next((name for name, want in [("row", nr), ("scalar", [])] if dims == want), None)
    if rows is None:  # dims straddle the rows: only the identity is element for element
        options = [("full", nc), ("scalar", [])]
    # else a leaf gathered per element (`other`: e.g. a per-channel weight across rows)
    return next((name for name, want in options if dims == want), "other")


def _source(v: ir.Value) -> ir.Value:
    """Through whole-tensor reshapes (they keep the row-major flat index)."""
    op = defining_op(v)
    while op is not None and op.name in _RESHAPES:
        v = op.operands[0]
        op = defining_op(v)
    return v


def _reads(op: ir.Operation) -> list[tuple[ir.Value, ir.AffineMap]]:
    """The operands a member reads: its inputs, and a reduction's init."""
    maps = [ir.AffineMapAttr(a).value for a in op.attributes["indexing_maps"]]
    n_in = len(op.opview.inputs)
    reads = list(zip(list(op.operands)[:n_in], maps[:n_in]))
    if any("reduction" in str(a) for a in op.attributes["iterator_types"]):
        reads.append((op.operands[n_in], maps[n_in]))
    return reads


def _pick(op: ir.Operation, R: int, C: int) -> int | None:
    """The column k if `op` is a static tensor.extract_slice of every row's element at column
    k (e.g. x[:, 0:1]): its value per row is one element of a full value."""
    if op.name != "tensor.extract_slice" or any(len(x) for x in (op.opview.offsets, op.opview.sizes,
                                                                  op.opview.strides)):
        return None
    src = ir.RankedTensorType(op.operands[0].type)
    if not src.has_static_shape:
        return None
    shape, so = list(src.shape), op.opview
    offs, sizes, strides = list(so.static_offsets), list(so.static_sizes), list(so.static_strides)
    for j in range(len(shape) + 1):
        if math.prod(shape[:j]) == R and math.prod(shape[j:]) == C:
            if sizes[:j] != shape[:j] or any(offs[:j]) or any(x != 1 for x in strides[:j]):
                continue
            if any(x != 1 for x in sizes[j:]):
                continue
            return sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offs) if d >= j)
    return None


def _origin(v: ir.Value, R: int, C: int) -> tuple[ir.Value, int | None]:
    """(the value `v` reads through reshapes, the column if through a `_pick` slice)."""
    v = _source(v)
    op = defining_op(v)
    k = _pick(op, R, C) if op is not None else None
    return (_source(op.operands[0]), k) if k is not None else (v, None)  # type: ignore[union-attr]


def _users(v: ir.Value, rc: tuple[int, int] | None = None) -> Iterator[tuple[ir.Operation, ir.Value]]:
    """(user, the operand value it sees) through reshapes (and `_pick` slices, given R, C)."""
    for use in v.uses:
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name in _RESHAPES or (rc is not None and _pick(op, *rc) is not None):
            yield from _users(op.results[0], rc)
        else:
            yield op, v


# ------------------------------------------------------------------------------------------------
# the group


def find_group(seed: ir.Operation, flat: bool = True, memo: dict | None = None) -> RowGroup | None:
    """The row group grown from reduction `seed`; `flat`: members may iterate R*C points in dims
    that straddle rows (when such a member reads a group value any other way, the group is
    found again without them). `memo` keeps the generics' forms for the next seeds (map_rows:
    a group taken erases its members and makes no generics, so the others' forms hold)."""
    memo = {} if memo is None else memo

    def form_of(op: ir.Operation, R: int | None = None, C: int | None = None, flat: bool = True):
        key = (op, R, C, flat)
        if op.name != "linalg.generic":  # (no form; nor a memo entry: an erased op's address
            return None  # may be a new op's)
        if key not in memo:
            if op not in memo:  # (what does not depend on R, C: once per generic)
                memo[op] = _base(op)
            memo[key] = _form(op, R, C, flat, memo[op])
        return memo[key]

    _, ranges, rows, cols = form_of(seed)  # type: ignore[misc]
    R, C = math.prod(ranges[:len(rows)]), math.prod(ranges[len(rows):])
    forms = {seed: form_of(seed, R, C)}
    reads: dict = {}  # op -> [(value, map, its _origin)] (the IR does not change meanwhile)

    def reads_of(op: ir.Operation) -> list:
        if op not in reads:
            reads[op] = [(v, m, _origin(v, R, C)) for v, m in _reads(op)]
        return reads[op]

    work = [seed]
    while work:  # grow along matching accesses, both ways
        op = work.pop()
        near = []
        for _, _, (src, _) in reads_of(op):
            p = defining_op(src)
            if p is not None and p.block == seed.block:
                near.append(p)
        for user, _ in _users(op.results[0], (R, C)):
            if user.block == seed.block:
                near.append(user)
        for q in near:
            if q in forms:
                continue
            f = form_of(q, R, C, flat)
            if f is None:
                continue
            if any(src == q.results[0] for _, _, (src, _) in reads_of(op)):  # q produces for op
                reader, form, value, kind = op, forms[op], q.results[0], f[0]
            else:  # q consumes op's value
                reader, form, value, kind = q, f, op.results[0], forms[op][0]
            if _links_match(reader, form, value, kind, R, C, reads_of(reader)):
                forms[q] = f
                work.append(q)
    members = sorted(forms, key=_position)
    while len(members) >= 2:
        bad = _first_escape(members, R, C)
        if bad is None:
            break
        members = [m for m in members if m.is_before_in_block(bad)]
    if len(members) < 2 or not any(forms[m][0] == "reduce" for m in members):
        return None
    g = _program(RowGroup(R, C, members), forms)
    if g is None and flat and any(forms[m][2] is None for m in members):
        return find_group(seed, flat=False, memo=memo)
    return g


def _links_match(reader: ir.Operation, form, value: ir.Value, kind: str, R: int, C: int,
                 reads: list | None = None) -> bool:
    """Does `reader` (of `form`) read `value` (made by a generic of `kind`) only element for
    element (full), row for row (a reduction's or a row map's), or as a picked column?
    (`reads`: its reads with their _origin, known already.)"""
    if reads is None:
        reads = [(v, m, _origin(v, R, C)) for v, m in _reads(reader)]
    links = [(v, m, k) for v, m, (src, k) in reads if src == value]
    for v, m, k in links:
        want = "row" if k is not None or kind != "full" else "full"
        if (k is not None and kind != "full") or _access(m, v.type, form) != want:
            return False
    return bool(links)


def _block_order(a: ir.Operation, b: ir.Operation) -> int:
    # MLIR keeps an order index per block: no list of the block's ops per comparison (that
    # was quadratic: 20 s of BEVFormer-tiny's cuda compile)
    return 0 if a == b else -1 if a.is_before_in_block(b) else 1


_position = functools.cmp_to_key(_block_order)


def _first_escape(members: list[ir.Operation], R: int, C: int) -> ir.Operation | None:
    """The first non-member (not a reshape) using a member value before the last member: the
    kernel, placed at the last member, would come after it."""
    last, bad = members[-1], None
    for op in members:
        for user, _ in _users(op.results[0], (R, C)):
            user = top_level(user, last.block)  # (a use inside another op's region)
            if user not in members and user.is_before_in_block(last):
                if bad is None or user.is_before_in_block(bad):
                    bad = user
    return bad


def _program(g: RowGroup, forms: dict) -> RowGroup | None:
    from gac_torch.kernels.rows import Node

    node_of: dict = {}
    for op in g.members:
        f = forms[op]
        args: list[int] = []
        init = None
        reads = _reads(op)
        for k, (v, m) in enumerate(reads):
            is_init = f[0] == "reduce" and k == len(reads) - 1
            src, col = _origin(v, g.R, g.C)
            src_op = defining_op(src)
            if src_op is not None and src_op in g.members:
                if not _links_match(op, f, src, forms[src_op][0], g.R, g.C):
                    return None
                n = node_of[src_op] if col is None else _pick_node(g, node_of[src_op], col)
            elif is_init and src_op is not None and is_fill(src_op):
                init = -1  # the fill's constant
                fill_val = (src_op.operands[0] if src_op.name == "linalg.fill"
                            else block_ops(src_op.regions[0].blocks[0])[0].operands[0])
                continue
            else:
                space = _access(m, v.type, f)
                if space is None or (space == "other" and f[0] == "reduce"):
                    return None  # a reduction gathering its operands is a contraction (a GEMM's)
                n = _leaf(g, v, space, (f[1], [e.position if isinstance(e, ir.AffineDimExpr) else None
                                                  for e in m.results]))
                if n is None:
                    return None
            if is_init:
                init = n
            else:
                args.append(n)
        idx = len(g.nodes)
        node_of[op] = idx
        space = "full" if f[0] == "full" else "row"
        g.nodes.append(Node("reduce" if f[0] == "reduce" else "map", space, tuple(args),
                            init=None if init in (None, -1) else init))
        g.ops.append(op)
        if init == -1:
            g.fills[idx] = fill_val
    members = set(g.members)
    for op in g.members:  # outputs: member values something outside the group reads
        if any(u not in members for u, _ in _users(op.results[0], (g.R, g.C))):
            i = node_of[op]
            g.nodes[i] = Node(g.nodes[i].op, g.nodes[i].space, g.nodes[i].args, True, g.nodes[i].init)
            g.results[i] = op.results[0]
    return g


def _pick_node(g: RowGroup, n: int, col: int) -> int:
    from gac_torch.kernels.rows import Node

    node = Node("pick", "row", (n,), at=col)
    if node in g.nodes:
        return g.nodes.index(node)
    g.nodes.append(node)
    g.ops.append(None)
    return len(g.nodes) - 1


def _leaf(g: RowGroup, v: ir.Value, space: str, gather) -> int | None:
    from gac_torch.kernels.rows import Node

    if space == "other":  # the kernel computes the leaf's index per element from the loop dims
        g.nodes.append(Node("load", "other"))
        g.ops.append(Leaf(v, space, gather=gather))
        return len(g.nodes) - 1
    for i, o in enumerate(g.ops):
        if isinstance(o, Leaf) and o.value == v and o.space == space and o.slice is None:
            return i
    leaf = Leaf(v, space)
    op = defining_op(v)
    if op is not None and op.name == "tensor.extract_slice":
        so = op.opview
        static = [list(so.static_offsets), list(so.static_sizes), list(so.static_strides)]
        if not any(len(x) for x in (so.offsets, so.sizes, so.strides)) and _static(op.operands[0]):
            leaf = Leaf(op.operands[0], space, (static[0], static[1], static[2]))
    if not isinstance(v.type, ir.RankedTensorType) and space != "scalar":
        return None
    g.nodes.append(Node("load", space))
    g.ops.append(leaf)
    return len(g.nodes) - 1


def _static(v: ir.Value) -> bool:
    return isinstance(v.type, ir.RankedTensorType) and ir.RankedTensorType(v.type).has_static_shape


# ------------------------------------------------------------------------------------------------
# rewriting


def leaf_buffer(v: ir.Value) -> ir.Value:
    """A read-only buffer of tensor `v` (identity layout), as 1-D when its rank is 2 or more."""
    rt = ir.RankedTensorType(v.type)
    buf = bufferization.ToBufferOp(ir.MemRefType.get(list(rt.shape), rt.element_type), v,
                                   read_only=True).result
    return flat(buf)


def flat(buf: ir.Value) -> ir.Value:
    mt = ir.MemRefType(buf.type)
    if mt.rank < 2:
        return buf
    return memref.collapse_shape(ir.MemRefType.get([math.prod(mt.shape)], mt.element_type), buf,
                                 ir.ArrayAttr.get([ir.ArrayAttr.get(
                                     [ir.IntegerAttr.get(ir.IntegerType.get_signless(64), i)
                                      for i in range(mt.rank)])]))


def output_buffer(v: ir.Value) -> ir.Value:
    rt = ir.RankedTensorType(v.type)
    return memref.AllocOp(ir.MemRefType.get(list(rt.shape), rt.element_type), [], []).result


def replace_members(g: RowGroup, outs: dict[int, ir.Value]) -> None:
    """Each output's uses read `outs[node]` (the tensor of the buffer the kernel wrote, defined
    before the last member); the members, and the reshapes, slices, fills and empties only
    they used, go away."""
    for i, v in g.results.items():
        v.replace_all_uses_with(outs[i])
        _move_reshapes_after(outs[i], defining_op(outs[i]))
    cand = list(g.members)
    k = 0
    while k < len(cand):  # what feeds the members and may die with them
        for x in cand[k].operands:
            d = defining_op(x)
            if d is not None and d not in cand and (d.name in _PURE or is_fill(d)):
                cand.append(d)
        k += 1
    progress = True
    while progress:
        progress = False
        for op in list(cand):
            if all(not list(r.uses) for r in op.results):
                cand.remove(op)
                op.erase()
                progress = True


def _move_reshapes_after(t: ir.Value, anchor: ir.Operation) -> None:
    """Reshapes of a replaced value that sit before its new definition move right after it."""
    for use in list(t.uses):
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name in (*_RESHAPES, "tensor.extract_slice") and op.block == anchor.block and \
                op.is_before_in_block(anchor):
            op.move_after(anchor)
            _move_reshapes_after(op.results[0], op)
