"""The fuzzer's op table: one entry per way of calling a lowered ATen op from Python (the
entries live in ops_math.py and ops_data.py).

Each entry names the registry ops it exercises (`aten`: base names; an entry whose ops are not all
in the registry's lower bucket is never drawn, see active_ops()) and a `make(g, *args)` that
returns the expression's source text, or None when the arguments do not suit it. `make` may look
at the arguments' example values (`a.t`) to stay inside an op's domain: the generator runs every
line eagerly as it writes it, so the values it sees are the values the program will see.

Flags:
  exact  the result has no rounding error when its inputs have none (views, max, neg, compares)
  disc   the result jumps under tiny input changes (floor, argmax, compares): drawn only for
         inputs with no rounding error, else one rounding difference upstream shows as a
         "mismatch" that is nobody's bug
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FLOAT = "f"
INT = "i"
BOOL = "b"
NUM = "fi"
ANY = "fib"


@dataclass(frozen=True)
class Op:
    name: str
    aten: tuple[str, ...]
    kinds: tuple[str, ...]  # per argument: which dtype kinds it takes ("f", "i", "b")
    make: Callable
    exact: bool = False
    disc: bool = False
    inplace: bool = False
    reduction: bool = False  # reduces its first argument (feature "reduce_0d" on 0-d input)


OPS: list[Op] = []


def op(name: str, aten: str, kinds: str | tuple = FLOAT, **flags):
    def register(make):
        ks = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        OPS.append(Op(name, tuple(aten.split()), ks, make, **flags))
        return make
    return register


def kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return BOOL
    return FLOAT if t.is_floating_point() else INT


def _dims(g, t) -> int:
    return max(t.dim(), 1)


def _dim(g, t) -> int:
    """A valid dim of t (0-d tensors take 0 or -1), sometimes negative."""
    d = g.rng.randrange(_dims(g, t))
    return d - _dims(g, t) if g.rng.random() < 0.3 else d


def _amax(t) -> float:
    return float(t.detach().double().abs().nan_to_num(0.0).max()) if t.numel() else 0.0


def _in(t, lo: float, hi: float) -> bool:
    """Every finite element lies in [lo, hi] (vacuous for empty tensors)."""
    if t.numel() == 0:
        return True
    v = t.detach().double()
    v = v[v.isfinite()]
    return v.numel() == 0 or (float(v.min()) >= lo and float(v.max()) <= hi)


def _domain(g, a, lo: float, hi: float, expr: str, guarded: str) -> str | None:
    """expr when a's values are in the op's domain, or the fuzz case may make NaN/inf (feature
    nonfinite); else a guarded form that keeps the values inside it."""
    if _in(a.t, lo, hi) or g.nonfinite:
        return expr
    return guarded


def active_ops(lowered: set[str]) -> list[Op]:
    """The entries all of whose ATen ops the registry lowers."""
    from gac_torch.tools.fuzz import ops_data, ops_math  # noqa: F401  (they fill OPS)

    return [o for o in OPS if set(o.aten) <= lowered]
