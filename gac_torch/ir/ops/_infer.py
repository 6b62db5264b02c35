"""Shape/dtype rules shared by op families."""

from __future__ import annotations

from mlir import ir

from gac_torch.ir.types import DYN, elem_of, shape_of
from gac_torch.errors import GacError


class GacTypeError(GacError, ValueError):
    """An op's operands or attributes break its shape/dtype rules."""


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy/torch broadcasting: align trailing dims; a static 1 stretches. A run-time size (DYN)
    never stretches: torch only leaves a size symbolic where it is not a broadcast 1, and two
    symbolic sizes meeting here are the same size (torch guarded on it)."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            dims.discard(DYN)  # a static size pins a run-time one
        if len(dims) > 1:
            raise GacTypeError(f"shapes {list(map(list, shapes))} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def check_sizes(name: str, shape, n_sizes: int) -> None:
    """Ops that make run-time sizes take one index operand per `?` of their result, in order."""
    dyn = sum(1 for s in shape if s == DYN)
    if dyn != n_sizes:
        raise GacTypeError(f"gac.{name}: {n_sizes} size operand(s) for a result shape {list(shape)} "
                           f"with {dyn} run-time size(s)")


def dims_match(a: int, b: int) -> bool:
    """Two sizes that may be equal: equal ints, or one known only at run time."""
    return a == b or DYN in (a, b)


def same_elem(types: list[ir.Type], what: str) -> ir.Type:
    elems = {str(elem_of(t)) for t in types}
    if len(elems) != 1:
        raise GacTypeError(f"{what}: operands must share one element type, got {sorted(elems)}")
    return elem_of(types[0])


def tensor(shape, elem: ir.Type) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), elem)


def norm_dim(d: int, rank: int, what: str) -> int:
    if not -max(rank, 1) <= d < max(rank, 1):
        raise GacTypeError(f"{what}: dim {d} out of range for rank {rank}")
    return d % max(rank, 1)


__all__ = ["GacTypeError", "broadcast_shapes", "check_sizes", "dims_match", "DYN", "same_elem", "tensor", "norm_dim", "shape_of", "elem_of"]
