"""The ATen op registry: each overload is in exactly one bucket — lower, decompose or fallback.

- lower:     a function that emits gac ops for the node (`@lower(aten.relu.default)`).
- decompose: torch's own decomposition of the op (or ours, `@decompose_with`, where torch's is
             wrong) is applied before legalization (both front-ends share the table, see
             decompositions()).
- fallback:  the op runs in eager, with a stated reason.
An op in no bucket falls back with the reason "no lowering". A lowering may also refuse one
particular node (an unsupported argument) through its `check`, and declares the dtypes it takes
(`dtypes`, checked on the node's first tensor input, or its output for constructors).
A lowering that handles sizes known only at run time says so (`dynamic=True`); the others see
static shapes only (a graph with symbolic sizes is then compiled once per shape, see frontends/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch._ops import OpOverload

aten = torch.ops.aten

Check = Callable[[torch.fx.Node], "str | None"]

FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64})
ALL_DTYPES = FLOATS | INTS | {torch.bool}
NUMERIC = FLOATS | INTS  # no bool


@dataclass(frozen=True)
class Entry:
    overload: OpOverload
    bucket: str  # "lower" | "decompose" | "fallback"
    fn: Callable | None = None
    check: Check | None = None
    reason: str = ""
    dtypes: frozenset = ALL_DTYPES
    dynamic: bool = False  # the lowering handles run-time sizes (Cx shapes holding index Values)

    @property
    def name(self) -> str:
        """The base name: aten.add.Tensor and aten.add.Scalar are both "add"."""
        return self.overload._schema.name.split("::")[-1]


REGISTRY: dict[OpOverload, Entry] = {}
_TABLE: dict = {}  # decompositions(), built once after registration


def _add(entry: Entry) -> None:
    if entry.overload in REGISTRY:
        raise ValueError(f"{entry.overload} is registered twice "
                         f"({REGISTRY[entry.overload].bucket} and {entry.bucket})")
    REGISTRY[entry.overload] = entry
    _TABLE.clear()


def lower(*overloads: OpOverload, check: Check | None = None, dtypes: Iterable[torch.dtype] = ALL_DTYPES,
          dynamic: bool = False):
    """Registers fn(cx, *args, **kwargs) -> Value | tuple[Value, ...] for each overload."""
    def register(fn):
        for ov in overloads:
            _add(Entry(ov, "lower", fn, check, dtypes=frozenset(dtypes), dynamic=dynamic))
        return fn
    return register


def decompose(*overloads: OpOverload) -> None:
    """Ops torch's own decomposition expands into ops we lower."""
    from torch._decomp import decomposition_table

    for ov in overloads:
        if ov not in decomposition_table and not _is_composite(ov):
            raise ValueError(f"{ov} has no torch decomposition")
        _add(Entry(ov, "decompose"))


def decompose_with(*overloads: OpOverload):
    """Our own decomposition of an op, replacing torch's (which is wrong or missing)."""
    def register(fn):
        for ov in overloads:
            _add(Entry(ov, "decompose", fn))
        return fn
    return register


# The reason of the ops that run in torch by design, not because gac lacks them: communication
# (torch.distributed's functional collectives). The report lists them apart, not as fallbacks.
COLLECTIVE = "collective: runs in torch"


def fallback(reason: str, *overloads: OpOverload) -> None:
    for ov in overloads:
        _add(Entry(ov, "fallback", reason=reason))


def namespace_overloads(*namespaces: str) -> list[OpOverload]:
    """Every overload the dispatcher knows in these op namespaces (e.g. "_c10d_functional")."""
    found = []
    for full in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, name = full.partition("::")
        if namespace in namespaces:
            packet = getattr(getattr(torch.ops, namespace), name.partition(".")[0])
            found += [getattr(packet, ov) for ov in packet.overloads()]
    return sorted(set(found), key=str)


def _is_composite(ov: OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(ov.name(), "CompositeImplicitAutograd")


def decompositions() -> dict:
    """The decomposition table both front-ends use: core ATen plus our `decompose` bucket,
    minus ops we lower ourselves (a fused lowering beats torch's expansion)."""
    if not _TABLE:
        from torch._decomp import core_aten_decompositions, get_decompositions

        table = dict(core_aten_decompositions())
        table.update(get_decompositions([e.overload for e in REGISTRY.values()
                                         if e.bucket == "decompose" and e.fn is None]))
        table.update({e.overload: e.fn for e in REGISTRY.values() if e.bucket == "decompose" and e.fn})
        for ov, e in REGISTRY.items():
            if e.bucket in ("lower", "fallback"):
                table.pop(ov, None)
        table.update(TRACE_REWRITES)
        _TABLE.update(table)
    return dict(_TABLE)


def _vector_norm_with_canonical_dims(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """Traces linalg_vector_norm with dims >= 0 (else NotImplemented: the node stays as it is).
    torch 2.11's reference (the fake-tensor shape on cuda) keeps a size-1 dim reduced by a
    negative index: a wrong node shape, e.g. [1, 1] for a (1, 1) tensor's norm over -1 (H200
    fuzz seeds 207, 221, 401, 494)."""
    dims = [dim] if isinstance(dim, int) else dim
    if dims is None or x.dim() == 0 or all(d >= 0 for d in dims):
        return NotImplemented
    dims = [d % x.dim() for d in dims]
    return aten.linalg_vector_norm.default(x, ord, dims, keepdim, dtype=dtype)


# Not decompositions: trace-time rewrites of a lowered op's arguments into a form every torch
# version gives the right meta for (a rewrite returns NotImplemented where nothing needs doing).
TRACE_REWRITES = {aten.linalg_vector_norm.default: _vector_norm_with_canonical_dims}


def lowered_ops() -> list[OpOverload]:
    return sorted((e.overload for e in REGISTRY.values() if e.bucket == "lower"), key=str)
