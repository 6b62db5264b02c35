"""`reduce` for narrow-warp targets (Vortex): the row-reduction kernel of `reduce.py` with one warp
per output only (no gpu.all_reduce) and only where it pays. A `loops` kernel already gives each
output its own thread, so a warp per output costs more instructions once the outputs fill the
device; it wins when they do not (a few long rows: `loops` leaves most threads idle and runs the
row serially) — here when the outputs are fewer than the device's hardware threads and the
reduced dims are innermost (a warp's lanes read consecutive elements). SimX 1x4x4, cycles
loops / warp: sum of 3 x 1000 rows 1.35, amax 5 x 300 1.14, mean of 64 x 37 1.22, but a column
sum of 500 x 6 0.64 (strided lanes) — hence the innermost rule; the warp version runs ~2x the
instructions. 32-bit accumulators only (the shuffle moves one register)."""

from __future__ import annotations

import math

from mlir import ir

from gac_torch.backends.gpu.analysis import Generic
from gac_torch.backends.gpu.strategies import reduce
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy


def strategy(device_threads: int, block_threads: int, min_extent: int = 16) -> Strategy:
    """`device_threads`: cores x warps x threads of the device; `block_threads`: threads of a
    CTA (warps x threads of a core); `min_extent`: shorter rows stay serial per thread."""
    inner = reduce.strategy(reduce.ReduceParams(threads=block_threads, warp_max=1 << 62,
                                                min_extent=min_extent))

    def match(g: Generic, limits: GpuLimits) -> Generic | None:
        if g.dynamic or len(g.outputs) != 1:
            return None
        elem = ir.MemRefType(g.outputs[0].type).element_type
        if (ir.FloatType(elem).width if isinstance(elem, ir.FloatType) else ir.IntegerType(elem).width) > 32:
            return None
        red = [r for r, t in zip(g.ranges, g.iters) if t == "reduction"]
        par = [r for r, t in zip(g.ranges, g.iters) if t == "parallel"]
        if not red or math.prod(red) < min_extent or math.prod(par) >= device_threads:  # type: ignore[arg-type]
            return None
        if g.iters[-1] != "reduction":       # strided lanes: slower than a thread per output
            return None
        return inner.match(g, limits)

    def emit(g: Generic, name: str, limits: GpuLimits) -> bool:
        return inner.emit(g, name, limits)

    return Strategy("reduce", match, emit)
