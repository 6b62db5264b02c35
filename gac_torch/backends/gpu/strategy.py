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
import logging
import os
import re
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

from mlir import ir
from mlir.dialects import arith, func

from gac_torch.backends.gpu import aside, fold_pool, irutil
from gac_torch.backends.gpu.analysis import Generic
from gac_torch.errors import CompileError
from gac_torch.backends.gpu.irutil import PENDING, VIEW_OPS, block_ops, func_block, run_passes, set_kernel_name


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
    # exact-f32 matmuls (no TF32): large ones may read K-outer copies of their operands
    # (strategies/sgemm_relayout.py's transposes, relayout.py's epilogue copies)
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


log = logging.getLogger("gac_torch")
_cache = threading.local()  # while template_cache runs: .parsed (text -> module), .texts (key -> text);
# while deferred_splices runs: .pool (fold_pool.FoldPool), .pending (key -> (stand-in op, text, Future, name,
# args, refs); the key: the stand-in's STAND_IN attribute), .refs and .views (per text), .resolved (a count)


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
    before `before`, wiring the template's arguments to `args` (and `init`). Within
    deferred_splices, a template not folded yet is folded by a worker meanwhile (fold_pool.py)."""
    parsed = getattr(_cache, "parsed", None)
    if init is None:  # unused by the kernel; any value of the type will do
        t = ir.Type.parse(acc, before.context)
        with ir.InsertionPoint(before), before.location:
            init = arith.constant(t, 0.0 if isinstance(t, ir.FloatType) else 0)
    pool = getattr(_cache, "pool", None)
    refs = _referenced(text, len(args) + 1) if pool is not None and parsed is not None and text not in parsed else None
    if refs is not None:  # the kernel's place until it is folded: a stand-in using what it uses
        with ir.InsertionPoint(before), before.location:
            stand_in = func.CallOp([], PENDING, [v for v, r in zip([*args, init], refs) if r]).operation
        key = len(_cache.pending) + _cache.resolved  # (an Operation's hash changes with its operands)
        stand_in.attributes[STAND_IN] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), key)
        _cache.pending[key] = (stand_in, text, pool.submit(text), name, [*args, init], refs)
        return
    if parsed is None:
        tmpl = _parse(text, before.context)
    else:
        tmpl = parsed.get(text)  # (a cache lives in one compile: one context)
        if tmpl is None:
            tmpl = parsed[text] = _parse(text, before.context)
    _splice(tmpl, parsed is not None, before, [*args, init], name)


def _splice(tmpl: ir.Module, clone: bool, before: ir.Operation, args: list[ir.Value], name: str,
            refs: list[bool] | None = None, viewed: list[bool] | None = None) -> None:
    tfn = tmpl.body.operations[0].operation
    if clone:
        tfn = tfn.clone(ir.InsertionPoint(tmpl.body))
    tblock = func_block(tfn)
    inert = aside.inert_args(tblock.arguments, args)  # (before the wiring)
    for k, (targ, actual) in enumerate(zip(tblock.arguments, args)):
        if refs is not None and refs[k] != bool(list(targ.uses)):  # (what the stand-in told)
            why = (f"kernel {name}: its template's argument {k} is {'un' if refs[k] else ''}used once "
                   "folded, unlike its text: the kernels may differ from GAC_GPU_STAGE_WORKERS=0's")
            if os.environ.get("GAC_STRICT_INTERNAL", "") not in ("", "0"):
                raise CompileError(why)
            log.warning("gac: %s", why)  # (still a valid program: only what was decided meanwhile)
        if viewed is not None and not viewed[k] and not static_views_only(targ):
            why = (f"kernel {name}: its template views argument {k} dynamically once folded, unlike its text: "
                   "an answer given meanwhile (views_pending) may differ from GAC_GPU_LAZY_SETTLE=0's")
            if os.environ.get("GAC_STRICT_INTERNAL", "") not in ("", "0"):
                raise CompileError(why)
            log.warning("gac: %s", why)
        if refs is None or refs[k]:  # (an unused one may be gone already)
            targ.replace_all_uses_with(actual)
    for op in block_ops(tblock)[:-1]:  # constants and the launch; not the return
        op.move_before(before)
        if op.name == "gpu.launch":
            set_kernel_name(op, name)
            if inert:
                op.attributes[aside.FOLDED] = ir.UnitAttr.get()  # (aside.kernels_aside)
    if clone:
        tfn.erase()  # the emptied clone


@contextlib.contextmanager
def deferred_splices(generics: int) -> Iterator[None]:
    """Within template_cache: templates not folded yet are folded by fold_pool's workers
    (GAC_GPU_STAGE_WORKERS) while the caller goes on; every kernel is in place on exit."""
    n = fold_pool.worker_count(generics)
    if n <= 0 or getattr(_cache, "parsed", None) is None:
        yield
        return
    _cache.pool, _cache.pending, _cache.refs, _cache.views = fold_pool.FoldPool(n), {}, {}, {}
    _cache.resolved = 0
    irutil.SETTLE.append(settle)
    try:
        yield
        for key in list(_cache.pending):  # (in program order: the dict keeps it)
            _resolve(_cache.pending[key][0])
    finally:
        irutil.SETTLE.remove(settle)
        _cache.pool.close()
        _cache.pool = _cache.pending = _cache.refs = _cache.views = None


def settle(v: ir.Value) -> None:
    """Kernels still pending that use `v` (directly or through views) put in place: an
    analysis asking who uses a buffer then sees them as the serial path would."""
    pending = getattr(_cache, "pending", None)
    if not pending:
        return
    for use in list(v.uses):
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name in VIEW_OPS and op.operands[0] == v:
            settle(op.results[0])
        elif op.name == "func.call" and _key(op) in pending:
            _resolve(op, wait=False)


def _referenced(text: str, n: int) -> list[bool] | None:
    """Per argument of the template `func.func @tmpl(%a: .., ...)`: does its text use it? (None
    where the header does not read as n arguments: then it is spliced at once.) An argument
    the text never names is unused once folded; one it names stays used (checked by _splice)."""
    refs = getattr(_cache, "refs", None)
    if refs is None:
        refs = _cache.refs = {}
    if text not in refs:
        m = _HEADER.search(text)
        names = _ARG.findall(m.group(1)) if m else []
        refs[text] = ([len(re.findall(re.escape(a) + r"(?![\w$.\-])", text)) > 1 for a in names]
                      if len(names) == n else None)
    return refs[text]


def views_pending(op: ir.Operation, operand: int) -> bool | None:
    """Where `op` is a kernel's stand-in: might its kernel, once in place, apply a view op
    (irutil.VIEW_OPS) with operands besides the viewed buffer (a dynamic view) to the value it
    uses as its operand number `operand`, directly or through views of it? Read off the template's
    text, so that the kernel need not be put in place (and its template folded here rather than
    by a worker) to answer a no; _splice checks the answer against the folded template. None:
    `op` is no stand-in."""
    pending = getattr(_cache, "pending", None)
    entry = pending.get(_key(op)) if pending else None
    if entry is None:
        return None
    _, text, _, _, _, refs = entry
    viewed = _dynamic_views(text, len(refs))
    return viewed is None or viewed[[k for k, r in enumerate(refs) if r][operand]]


def _dynamic_views(text: str, n: int) -> list[bool] | None:
    """Per argument of the template: may its text view it dynamically (views_pending)? Every
    line holding a view op counts: one naming an argument (or a view of it) and any other
    value makes a yes. (None where the header does not read as n arguments.)"""
    views = getattr(_cache, "views", None)  # (while deferred_splices runs: once per text)
    if views is None:
        views = {}
    if (text, n) not in views:
        m = _HEADER.search(text)
        names = _ARG.findall(m.group(1)) if m else []
        lines = []  # (results, operands) of each line holding a view op
        for line in text.splitlines():
            if any(v in line for v in VIEW_OPS):
                lhs, eq, rhs = line.partition("=")
                named = lhs.strip().startswith("%") and eq
                lines.append((_NAME.findall(lhs) if named else [], _NAME.findall(rhs if named else line)))

        def dynamic(v: str, seen: set[str]) -> bool:
            seen.add(v)
            for results, operands in lines:
                if v in operands and (operands != [v] or any(dynamic(r, seen) for r in results if r not in seen)):
                    return True
            return False

        views[text, n] = [dynamic(a, set()) for a in names] if len(names) == n else None
    return views[text, n]


def static_views_only(v: ir.Value) -> bool:
    """Is every view op over `v` (and over those views) one of `v` alone (no other operand)?"""
    for use in v.uses:
        o = _owner(use)
        if o.name in VIEW_OPS and (len(o.operands) != 1 or not static_views_only(o.results[0])):
            return False
    return True


STAND_IN = "gac.stand_in"  # a stand-in's key in _cache.pending


def _key(op: ir.Operation) -> int | None:
    return ir.IntegerAttr(op.attributes[STAND_IN]).value if STAND_IN in op.attributes else None


def _owner(use) -> ir.Operation:
    o = use.owner
    return o.operation if hasattr(o, "operation") else o


_NAME = re.compile(r"%[\w$.\-]+")
_HEADER = re.compile(r"func\.func @[\w$.\-]+\((.*?)\)\s*\{", re.S)
_ARG = re.compile(r"(%[\w$.\-]+)\s*:")


def _resolve(stand_in: ir.Operation, wait: bool = True) -> None:
    """The kernel of `stand_in` in its place; `wait=False` (an analysis needs it now): a
    template no worker has started to fold yet is folded here (the same module: fold_worker.py)."""
    _, text, fut, name, args, refs = _cache.pending.pop(_key(stand_in))
    _cache.resolved += 1
    now = iter(stand_in.operands)  # (what it uses now: an operand may have been redirected
    args = [next(now) if r else v for v, r in zip(args, refs)]  # meanwhile, epilogue.rename_from)
    parsed = _cache.parsed
    tmpl = parsed.get(text)
    if tmpl is None and not wait and fut.cancel():  # (still queued: taken back)
        tmpl = parsed[text] = _parse(text, stand_in.context)
    elif tmpl is None:
        tmpl = parsed[text] = ir.Module.parse(fut.result(), stand_in.context)  # (CompileError: a worker failed)
    _splice(tmpl, True, stand_in, args, name, refs, _dynamic_views(text, len(refs)))
    stand_in.erase()


def splice_fused(text: str, g: Generic, fill: tuple[ir.Operation, ir.Value] | None, acc: str,
                 name: str) -> None:
    """splice_template for a generic with inputs (A, B) and output C whose fill right before
    (`fill_before`) the template folds in: the generic and its fill are erased."""
    splice_template(text, g.op, [*g.inputs, g.outputs[0]], fill[1] if fill is not None else None, acc, name)
    if fill is not None:
        fill[0].erase()
    g.op.erase()
