"""Kernels spliced from folded templates kept out of the host function's big pipeline.

Once every op is scheduled, the host function holds every kernel body (BEVFormer-tiny: ~300k
ops, most of them in the 191 spliced templates) and `convert-linalg-to-parallel-loops,
canonicalize, cse` walks all of it on one thread (~1.7 s of an ~8 s "gpu" stage). A template
was folded already (strategy._parse), so that pipeline changes its kernel only where the body
meets the host: a view op in the kernel over a view of the host (folded into one), a memref.cast
(folded into its users), index arithmetic of the host. `kernels_aside` lifts the other template
kernels out of the function while the pipeline runs (an anchor op holding the values each uses
keeps them alive and in place) and puts them back where they were; outlining and the kernels'
own canonicalize follow as before.

A constant argument the kernel folds with (e.g. an init added to itself) keeps it in too
(inert_args): the new constant would be hoisted into the host in another order (seen on the
vortex MLP's gpu stage before this rule). Checked: BEVFormer-tiny's five cuda stage hashes and
the 295 fingerprints of benchmarks/ptx_fingerprint.py (cuda sm_90/sm_80, vortex, pipeline
cases) are the same as without it; the gpu stage's main-thread CPU -0.9 to -1.0 s of ~6.5
offline. GAC_GPU_KERNELS_ASIDE=0: every kernel stays in, as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from mlir import ir

from gac_torch.backends.gpu.irutil import VIEW_OPS, Tops, block_ops, defining_op, top_level

FOLDED = "gac.folded_template"  # on a gpu.launch spliced from a folded template (strategy._splice)
ANCHOR = "gac_aside.anchor"  # (an unregistered op: nothing folds, moves or erases it)
# host producers a kernel's ops may fold with (besides views consumed by views, and casts)
_MEETS = ("arith.", "affine.", "index.")


# ops of a template that take a constant argument (e.g. an accumulator's init) without folding
# with it into a new constant (which canonicalize would hoist into the host, in its own order)
_INERT_USERS = ("scf.for", "scf.yield", "llvm.inline_asm", "memref.store", "vector.store")


def inert_args(params, args) -> bool:
    """Can a kernel be set aside, as far as what a template's parameters `params` are wired to
    (`args`) goes: every constant among them used only by ops that cannot fold with it?"""
    for p, a in zip(params, args):
        users = [u.owner.operation if hasattr(u.owner, "operation") else u.owner for u in p.uses]
        if not users:  # (unused: its value may be gone already, strategy.splice_template)
            continue
        d = defining_op(a)
        if d is not None and d.name == "arith.constant" and any(u.name not in _INERT_USERS for u in users):
            return False
    return True


def enabled() -> bool:
    return os.environ.get("GAC_GPU_KERNELS_ASIDE", "1").strip() != "0"


def _captured(block: ir.Block, ops: list[ir.Operation], launches: set) -> dict:
    """Per launch of `launches`: the host values its body uses, in a stable order."""
    out: dict = {launch: {} for launch in launches}
    top_of = Tops(block)
    for v in [*block.arguments, *(r for op in ops if op.name != "gpu.launch" for r in op.results)]:
        for use in v.uses:
            top = top_of(use.owner.operation if hasattr(use.owner, "operation") else use.owner)
            if top in out:
                out[top][v] = None
    return out


def _meets_host(launch: ir.Operation, values, block: ir.Block) -> bool:
    """Might canonicalize fold one of the kernel's ops together with a host op it uses?"""
    for v in values:
        d = defining_op(v)
        if d is None or d.name == "arith.constant":
            continue
        if d.name == "memref.cast" or d.name.startswith(_MEETS):
            return True
        if d.name in VIEW_OPS:
            for use in v.uses:
                o = use.owner.operation if hasattr(use.owner, "operation") else use.owner
                if o.name in VIEW_OPS and top_level(o, block) == launch:
                    return True
    return False


@contextlib.contextmanager
def kernels_aside(module: ir.Module, block: ir.Block) -> Iterator[None]:
    """Within: the template kernels of `block` that do not meet the host are out of it."""
    ops = block_ops(block)
    marked = [op for op in ops if op.name == "gpu.launch" and FOLDED in op.attributes]
    for op in marked:
        del op.attributes[FOLDED]
    if not enabled() or not marked:
        yield
        return
    captured = _captured(block, ops, set(marked))
    aside = [op for op in marked if not _meets_host(op, captured[op], block)]
    ctx = module.context
    allowed = ctx.allow_unregistered_dialects
    ctx.allow_unregistered_dialects = True
    anchors = []
    try:
        for launch in aside:
            with ir.InsertionPoint(launch), launch.location:
                anchors.append(ir.Operation.create(ANCHOR, operands=list(captured[launch])))
            launch.detach_from_parent()
        yield
    finally:
        for launch, anchor in zip(aside, anchors):
            ir.InsertionPoint(anchor).insert(launch)
            anchor.erase()
        ctx.allow_unregistered_dialects = allowed
