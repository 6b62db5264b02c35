"""gac-fusion-report: which gac ops share a kernel.

The fusion itself happens once, on linalg (linalg-fuse-elementwise-ops in the shared lowering:
elementwise chains become one loop nest, elementwise producers fold into reductions and
contractions' consumers, never into a contraction: gac_torch/lowering/fusion.py). Each linalg op created for gac op #i is located at "gac<i>", and fusion
merges locations, so every structured op left after fusion names the gac ops it computes. This
pass writes that back onto the gac module as `gac.kernel = <k>`, so the groups are visible in
`compiled.ir("gac")` and dumps, and they are what targets turn into kernels.
"""

from __future__ import annotations

import re

from mlir import ir

_GAC_LOC = re.compile(r'"gac(\d+)"')
# Not kernels of their own: body bookkeeping, and fills (an accumulator's initial value, which
# targets fold into the kernel that accumulates).
_NOT_KERNELS = ("linalg.yield", "linalg.index", "linalg.fill")


def kernel_groups(linalg_module: ir.Module) -> list[list[int]]:
    """For each kernel (a structured op after fusion), the indices of the gac ops it computes."""
    groups: list[list[int]] = []

    def visit(op):
        name = op.name
        if name.startswith("linalg.") and name not in _NOT_KERNELS:
            locs = [str(op.location)]

            def body(inner):
                locs.append(str(inner.location))
                return ir.WalkResult.ADVANCE

            op.walk(body)  # fused bodies keep each original op's location
            ids = sorted({int(m) for loc in locs for m in _GAC_LOC.findall(loc)})
            if ids:
                groups.append(ids)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    linalg_module.operation.walk(visit)
    return groups


def annotate_kernels(gac_module: ir.Module, linalg_module: ir.Module) -> list[list[int]]:
    """Sets `gac.kernel` (the kernel numbers) on every gac op that some kernel computes."""
    groups = kernel_groups(linalg_module)
    fn = next(o for o in gac_module.body.operations if o.operation.name == "func.func")
    ops = list(fn.regions[0].blocks[0].operations)
    owners: dict[int, list[int]] = {}
    for k, ids in enumerate(groups):
        for i in ids:
            owners.setdefault(i, []).append(k)
    with gac_module.context:
        for i, op in enumerate(ops):
            if i in owners:
                op.attributes["gac.kernel"] = ir.DenseI64ArrayAttr.get(owners[i])
    return groups
