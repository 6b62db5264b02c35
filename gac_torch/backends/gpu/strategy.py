"""A strategy turns one `linalg.generic` on memrefs into one kernel: a matcher says whether the
op is its own (and returns what the emitter needs), the emitter writes the gpu.launch in place of
the op. A target hands the scheduler its limits and an ordered list of strategies; the first whose
matcher accepts an op owns it (its emitter may still decline, e.g. when the grid would not fit:
the op then becomes a `loops` kernel). Ops no strategy owns become `loops` kernels.

To add a strategy: a module in backends/gpu/strategies/ with `match(g, limits)` and
`emit(match, name, limits) -> bool` (its kernel template in gac_torch/kernels/), then one line in
the target's strategy list.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from mlir import ir
from mlir.dialects import arith

from gac_torch.backends.gpu.analysis import Generic
from gac_torch.backends.gpu.irutil import block_ops, func_block, run_passes, set_kernel_name


@dataclass(frozen=True)
class GpuLimits:
    """What the scheduler needs to know about the device (filled from the target's data block)."""

    warp_size: int = 32
    max_threads_per_block: int = 1024
    max_static_shared_bytes: int = 48 * 1024
    max_dynamic_shared_bytes: int = 0  # per block, with the launch's opt-in (0: none)
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    threads_per_block: int = 256  # `loops` strategy block size
    coarsen: int = 4  # `loops`: points per thread for large elementwise spaces
    coarsen_min_points: int = 1 << 20
    # `loops`: a dim looped over inside each thread (invariant.py) only while the threads left
    # still fill the device
    serial_min_threads: int = 1 << 15
    # the `loops` kernels that only prepare inputs (e.g. weight casts) merged per level (combine.py)
    combine_prep: bool = False
    # `loops`: 16-byte accesses for large elementwise kernels (vectorize.py, GAC_LOOPS_VEC=1)
    vector_loops: bool = False
    # exact-f32 matmuls (no TF32): large ones may read transposed copies (relayout.py, opt-in)
    sgemm_relayout: bool = False


@dataclass(frozen=True)
class Strategy:
    """`name` is the kernel name's suffix (gac_k<i>_<name>) and the launch's `strategy`. `on`
    says what `match` is offered: "generic" (a bufferized Generic), "attention" (a call of a
    gac.attention function on tensors, an AttentionCall: attention.py), or "rows" (a RowGroup of
    generics on tensors: rows.py)."""

    name: str
    match: Callable[[Any, GpuLimits], Any | None]  # None: not this strategy's op
    emit: Callable[[Any, str, GpuLimits], bool]  # False: declined, the op becomes `loops`
    on: str = "generic"


_cache = threading.local()  # while template_cache runs: .parsed (text -> module), .texts (key -> text)


@contextlib.contextmanager
def template_cache() -> Iterator[None]:
    """Within it, each distinct template text is parsed once and cloned for its repeats (a
    model's repeated layers: BEVFormer-tiny splices 191 templates, 60 distinct, 21 MB of text),
    and `template_text` writes each distinct template once."""
    outer = getattr(_cache, "parsed", None), getattr(_cache, "texts", None)
    _cache.parsed, _cache.texts = {}, {}
    try:
        yield
    finally:
        _cache.parsed, _cache.texts = outer


def template_text(key: Hashable, make: Callable[[], str]) -> str:
    """`make()`, a kernel template's text, once per `key` (what it is made from: e.g. its
    spec and plan) while template_cache runs."""
    texts = getattr(_cache, "texts", None)
    try:
        hash(key)
    except TypeError:  # (a spec holding a list)
        texts = None
    if texts is None:
        return make()
    if key not in texts:
        texts[key] = make()
    return texts[key]


def _parse(text: str, context: ir.Context) -> ir.Module:
    """A template, folded: its constants and index math fold once per distinct template here
    rather than per copy in the host function (whose canonicalize, the costliest pass of the
    gpu stage, then finds them done; the kernels come out the same)."""
    m = ir.Module.parse(text, context)
    run_passes(m, "canonicalize, cse")
    return m


def splice_template(text: str, before: ir.Operation, args: list[ir.Value],
                     init: ir.Value | None, acc: str, name: str) -> None:
    """Parse a `func.func @tmpl(args..., %init)` holding one gpu.launch and move the launch
    before `before`, wiring the template's arguments to `args` (and `init`)."""
    parsed = getattr(_cache, "parsed", None)
    if parsed is None:
        tmpl = _parse(text, before.context)
        tfn = tmpl.body.operations[0].operation
    else:
        tmpl = parsed.get(text)  # (a cache lives in one compile: one context)
        if tmpl is None:
            tmpl = parsed[text] = _parse(text, before.context)
        tfn = tmpl.body.operations[0].operation.clone(ir.InsertionPoint(tmpl.body))
    tblock = func_block(tfn)
    if init is None:  # unused by the kernel; any value of the type will do
        t = ir.Type.parse(acc, before.context)
        with ir.InsertionPoint(before), before.location:
            init = arith.constant(t, 0.0 if isinstance(t, ir.FloatType) else 0)
    for targ, actual in zip(tblock.arguments, [*args, init]):
        targ.replace_all_uses_with(actual)
    for op in block_ops(tblock)[:-1]:  # constants and the launch; not the return
        op.move_before(before)
        if op.name == "gpu.launch":
            set_kernel_name(op, name)
    if parsed is not None:
        tfn.erase()  # the emptied clone


def splice_fused(text: str, g: Generic, fill: tuple[ir.Operation, ir.Value] | None, acc: str,
                 name: str) -> None:
    """splice_template for a generic with inputs (A, B) and output C whose fill right before
    (`fill_before`) the template folds in: the generic and its fill are erased."""
    splice_template(text, g.op, [*g.inputs, g.outputs[0]], fill[1] if fill is not None else None, acc, name)
    if fill is not None:
        fill[0].erase()
    g.op.erase()
