"""gac-fuse-attention: the attention maths written out becomes one gac.attention.

  matmul(Q, Kᵀ) [· c | / c]* [+ mask | select(keep, ·, -inf) | select(hide, -inf, ·)] -> softmax(-1)
  [-> select(all(s == -inf), 0, ·)  (torch's guard for rows with every key hidden)] -> matmul(·, V)

with reshapes and float casts anywhere in the chain, is what torch's decomposition of
`_scaled_dot_product_flash_attention_for_cpu` and hand-written attention (nn.MultiheadAttention
with need_weights) produce. Each intermediate must be used only by the chain: when training
saves the probabilities for the backward, nothing is fused and the backward's recomputation
stays the unfused maths. Scalings after a mask is added do not match (they would scale the mask).
"""

from __future__ import annotations

import math

from mlir import ir

from gac_torch.ir.builder import GacBuilder, op_attrs
from gac_torch.ir.types import DYN, shape_of
from gac_torch.passes.dce import gac_dce

_PASS = ("gac.reshape", "gac.cast")


def _op(v: ir.Value) -> ir.Operation | None:
    o = v.owner
    return o.operation if isinstance(o, (ir.Operation, ir.OpView)) else None


def _users(v: ir.Value) -> list[ir.Operation]:
    return [u.owner.operation if hasattr(u.owner, "operation") else u.owner for u in v.uses]


def _scalar(v: ir.Value) -> float | None:
    """The value of a splat float gac.constant (possibly broadcast), else None."""
    o = _op(v)
    while o is not None and o.name in ("gac.broadcast", "gac.reshape"):
        o = _op(o.operands[0])
    if o is None or o.name != "gac.constant":
        return None
    attr = o.attributes["value"]
    if not isinstance(attr, ir.DenseElementsAttr) or not attr.is_splat:
        return None
    try:
        return float(ir.FloatAttr(attr.get_splat_value()).value)
    except ValueError:
        return None


def _one_use(v: ir.Value, allowed: set | None = None) -> bool:
    users = _users(v)
    return len(users) == 1 or (allowed is not None and all(u in allowed for u in users))


def _guard(sel: ir.Operation) -> ir.Value | None:
    """For select(all(x == -inf over the last dim), 0, p): (x), the softmax input it tests."""
    cond, on_true, _ = sel.operands
    red = _op(cond)
    if red is None or red.name != "gac.reduce" or op_attrs(red)["kind"] != "all" or _scalar(on_true) != 0.0:
        return None
    eq = _op(red.operands[0])
    if eq is None or eq.name != "gac.binary" or op_attrs(eq)["kind"] != "eq" or _scalar(eq.operands[1]) != -math.inf:
        return None
    return eq.operands[0]


def _to_matmul(v: ir.Value) -> bool:
    """Whether v is the score chain (reshapes, casts, scalings, masks back to a matmul)."""
    o = _op(v)
    while o is not None and o.name != "gac.matmul":
        if o.name in _PASS or (o.name == "gac.binary" and op_attrs(o)["kind"] in ("mul", "div", "add")):
            o = _op(o.operands[0])
        elif o.name == "gac.select":
            o = _op(o.operands[2] if _scalar(o.operands[1]) == -math.inf else o.operands[1])
        else:
            return False
    return o is not None


def _match(mm2: ir.Operation):
    """(q', kᵀ', v', score ops from the first matmul on, softmax) or None."""
    p, v = mm2.operands
    guard_x = None
    o = _op(p)
    while o is not None and (o.name in _PASS or o.name == "gac.select") and _one_use(o.results[0]):
        if o.name == "gac.select":
            guard_x = _guard(o)
            if guard_x is None:
                return None
            o = _op(o.operands[2])
            continue
        o = _op(o.operands[0])
    if o is None or o.name != "gac.softmax" or op_attrs(o)["log"]:
        return None
    sm = o
    rank = len(shape_of(sm.results[0].type))
    if op_attrs(sm)["dim"] % rank != rank - 1 or not _one_use(sm.results[0]):
        return None
    x = sm.operands[0]
    if guard_x is not None and guard_x != x:
        return None
    steps = []  # from the softmax input back to the first matmul
    guard_users = {u for u in _users(x) if u.name == "gac.binary"} if guard_x is not None else set()
    first = True
    o = _op(x)
    while o is not None and o.name != "gac.matmul":
        if not _one_use(o.results[0], ({sm} | guard_users) if first else None):
            return None
        first = False
        if o.name in _PASS:
            steps.append(("pass", o, None))
            o = _op(o.operands[0])
        elif o.name == "gac.binary" and op_attrs(o)["kind"] in ("mul", "div") and _scalar(o.operands[1]) is not None:
            steps.append(("scale", o, None))
            o = _op(o.operands[0])
        elif o.name == "gac.binary" and op_attrs(o)["kind"] == "add":
            chain = 1 if not _to_matmul(o.operands[0]) and _to_matmul(o.operands[1]) else 0
            steps.append(("add", o, 1 - chain))  # (the mask is the other operand)
            o = _op(o.operands[chain])
        elif o.name == "gac.select" and _scalar(o.operands[2]) == -math.inf:
            steps.append(("keep", o, 0))
            o = _op(o.operands[1])
        elif o.name == "gac.select" and _scalar(o.operands[1]) == -math.inf:  # masked_fill(-inf)
            steps.append(("hide", o, 0))
            o = _op(o.operands[2])
        else:
            return None
    if o is None or (not first and not _one_use(o.results[0])) or (
            first and not _one_use(o.results[0], {sm} | guard_users)):
        return None
    if any(DYN in shape_of(x.type) for st in [o, mm2] + [op for _, op, _ in steps]
           for x in list(st.operands) + list(st.results) if isinstance(x.type, ir.RankedTensorType)):
        return None  # run-time sizes: the reshapes here would need size operands; left unfused
    full = shape_of(sm.results[0].type)
    if any(list(shape_of(x.type))[-2:] != list(full[-2:]) or math.prod(shape_of(x.type)) != math.prod(full)
           for x in (o.results[0], mm2.operands[0])):
        return None  # the reshapes regroup query rows or keys: not one attention per row
    kinds = [k for k, _, _ in reversed(steps) if k != "pass"]
    masks = ("add", "keep", "hide")
    last_scale = max((i for i, k in enumerate(kinds) if k == "scale"), default=-1)
    if any(k in masks for k in kinds[:last_scale]) or sum(k in masks for k in kinds) > 1:
        return None  # a scale after the mask, or two masks
    if any(str(ir.RankedTensorType(r.type).element_type) not in ("f16", "bf16", "f32", "f64")
           for r in (o.results[0], mm2.results[0])):
        return None
    return o, list(reversed(steps)), sm, v


def fuse_attention(module: ir.Module) -> ir.Module:
    b = GacBuilder()
    changed = False
    with module.context, ir.Location.unknown():
        for fn in module.body.operations:
            block = fn.regions[0].blocks[0]
            for op in list(block.operations):
                if op.operation.name != "gac.matmul":
                    continue
                m = _match(op.operation)
                if m is not None:
                    with ir.InsertionPoint(op), op.location:
                        _rewrite(b, op.operation, *m)
                    changed = True
    return gac_dce(module) if changed else module


def _rewrite(b: GacBuilder, mm2, mm1, steps, sm, v) -> None:
    full = list(shape_of(sm.results[0].type))  # (batch..., L, S)
    batch, L, S = full[:-2], full[-2], full[-1]
    q, kt = mm1.operands
    e = ir.RankedTensorType(q.type).element_type
    D = shape_of(q.type)[-1]
    Dv = shape_of(v.type)[-1]
    q4 = b.reshape(q, batch + [L, D])
    k4 = b.transpose(b.reshape(kt, batch + [D, S]), perm=list(range(len(batch))) + [len(batch) + 1, len(batch)])
    v4 = b.cast(b.reshape(v, batch + [S, Dv]), e)
    scale, mask = 1.0, None
    for kind, o, at in steps:
        if kind == "scale":
            c = _scalar(o.operands[1])
            scale *= c if op_attrs(o)["kind"] == "mul" else 1.0 / c
        elif kind in ("add", "keep", "hide"):
            mv = o.operands[at]
            if kind == "hide":
                mv = b.unary(mv, kind="logical_not")
            here = list(shape_of(o.results[0].type))
            ms = list(shape_of(mv.type))
            ms = [1] * (len(here) - len(ms)) + ms
            mv = b.reshape(mv, ms)
            if here != full:  # applied at another rank: make it whole, then the softmax's shape
                mv = b.reshape(b.broadcast(mv, shape=here), full)
            if kind == "add":
                mv = b.cast(mv, e)
            mask = mv
    operands = [q4, k4, v4] + ([mask] if mask is not None else [])
    out = b.attention(*operands, scale=scale, causal=0)
    res_t = ir.RankedTensorType(mm2.results[0].type)
    out = b.reshape(b.cast(out, res_t.element_type), list(res_t.shape))
    mm2.results[0].replace_all_uses_with(out)
