"""Which outputs may be written over which inputs: the pairs (input argument, output argument)
of the host function where the output can share the input's buffer without changing a value.

An optimizer step (`p.sub_(lr * g)` under torch.compile) is a functional graph whose outputs are
the new parameters; AOTAutograd then copies each into its parameter (`p.copy_(new)`: a device
copy of every weight per step). Where gac writes the new value into the parameter's own buffer
and returns the parameter itself, that copy is a copy of a tensor onto itself, which torch skips.

A pair is safe here when one elementwise generic is the only op that touches either buffer, and
it reads the input (once) and writes the output at the same point of one dense space, with
nothing but the two arguments themselves (no views): every element of the input is then read
by the thread that writes that element of the output, before it writes it. The generic reads
function arguments only (a `loops` kernel: one reading a GEMM's result would run in that GEMM's
epilogue, whose loads are not checked here). The pairs are
recorded on the function (`gac.in_place`, flat [input, output, ...]) and carried into the host
program (GpuProgram.in_place); a runtime only uses them when the caller asks for it (the dynamo
front-end, for the inputs AOTAutograd says the graph mutates). GAC_IN_PLACE=0 records none.
"""

from __future__ import annotations

import os

from mlir import ir

from gac_torch.backends.gpu.analysis import analyze, map_dims
from gac_torch.backends.gpu.irutil import identity_layout

ATTR = "gac.in_place"


def enabled() -> bool:
    return os.environ.get("GAC_IN_PLACE", "1") != "0"


def _dense_static(t: ir.Type) -> bool:
    return isinstance(t, ir.MemRefType) and ir.MemRefType(t).has_static_shape and identity_layout(t)


def _only_user(v: ir.Value) -> ir.Operation | None:
    owners = {(u.owner.operation if hasattr(u.owner, "operation") else u.owner) for u in v.uses}
    return owners.pop() if len(owners) == 1 else None


def in_place_pairs(fn: ir.Operation, n_inputs: int) -> list[tuple[int, int]]:
    """(input argument, output argument) pairs whose buffers one elementwise generic reads and
    writes element for element, and nothing else touches (see the module docstring)."""
    args = list(fn.regions[0].blocks[0].arguments)
    pairs = []
    taken: set[int] = set()
    for o in range(n_inputs, len(args)):
        out = args[o]
        if not _dense_static(out.type):
            continue
        g_op = _only_user(out)
        if g_op is None or g_op.name != "linalg.generic":
            continue
        g = analyze(g_op)
        if g is None or g.dynamic or "reduction" in g.iters or len(g.outputs) != 1 or g.outputs[0] != out:
            continue
        ident = list(range(len(g.iters)))
        if map_dims(g.maps[-1]) != ident or any(
                isinstance(v.type, ir.MemRefType) and v not in args[:n_inputs] for v in g.inputs):
            continue  # (reading a temporary, e.g. a GEMM's result, it would be that GEMM's epilogue)
        for k, v in enumerate(g.inputs):
            if v not in args[:n_inputs] or v.type != out.type or map_dims(g.maps[k]) != ident:
                continue
            i, user = args.index(v), _only_user(v)
            if i in taken or user is None or user != g_op or sum(1 for w in g.inputs if w == v) != 1:
                continue
            pairs.append((i, o))
            taken.add(i)
            break
    return pairs


def record(fn: ir.Operation, n_inputs: int) -> None:
    """Sets `gac.in_place` on the host function (nothing when there is no pair or it is off)."""
    if not enabled():
        return
    pairs = in_place_pairs(fn, n_inputs)
    if pairs:
        fn.attributes[ATTR] = ir.DenseI64ArrayAttr.get([x for p in pairs for x in p])


def recorded(fn: ir.Operation) -> tuple[tuple[int, int], ...]:
    if ATTR not in fn.attributes:
        return ()
    flat = list(ir.DenseI64ArrayAttr(fn.attributes[ATTR]))
    return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
