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

Opt-in (GAC_GPU_KERNELS_ASIDE=1): BEVFormer-tiny's cuda stages and every cuda stage of
benchmarks/ptx_fingerprint.py come out the same (the gpu stage's main-thread CPU -1.0 s of 6.5
offline), but 5 vortex "gpu" stage texts do not: the host's constants, hoisted by canonicalize
in another order without the kernels' ops, are sunk into the kernels in that order (their
LLVM IR is the same). Exact needs that order kept.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from mlir import ir

from gac_torch.backends.gpu.irutil import VIEW_OPS, block_ops, defining_op, top_level

FOLDED = "gac.folded_template"  # on a gpu.launch spliced from a folded template (strategy._splice)
ANCHOR = "gac_aside.anchor"  # (an unregistered op: nothing folds, moves or erases it)
# host producers a kernel's ops may fold with (besides views consumed by views, and casts)
_MEETS = ("arith.", "affine.", "index.")


def enabled() -> bool:
    return os.environ.get("GAC_GPU_KERNELS_ASIDE", "0").strip() == "1"


def _captured(block: ir.Block, ops: list[ir.Operation], launches: set) -> dict:
    """Per launch of `launches`: the host values its body uses, in a stable order."""
    out: dict = {launch: {} for launch in launches}
    for v in [*block.arguments, *(r for op in ops if op.name != "gpu.launch" for r in op.results)]:
        for use in v.uses:
            owner = use.owner.operation if hasattr(use.owner, "operation") else use.owner
            top = top_level(owner, block)
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
