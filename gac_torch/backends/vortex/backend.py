"""The vortex target: stages gpu -> llvm -> vxbin, a loader over SimX or the functional
simulator, and what the compiler assumes about the device (the data block below).

Tensors live on the host (device_type "cpu"); the executable copies them to the device.
Options: `vortex_mode` ("simx" | "functional"; default simx when `vortex_home` or VORTEX_HOME
is set, else functional) and `vortex_home` (a Vortex build with runtime/lib/libvortex.so).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from gac_torch.backends.base import Signature, Stage, Target
from gac_torch.backends.vortex.target import DEFAULT_CONFIG

# --- data block ------------------------------------------------------------------------------
THREADS_PER_WARP = DEFAULT_CONFIG.threads        # SimX default build: 1 core x 4 warps x 4 threads
WARPS_PER_CORE = DEFAULT_CONFIG.warps
CTA_THREADS = THREADS_PER_WARP * WARPS_PER_CORE  # a CTA that synchronises must fit one core
GEMM_THREADS = (4, 4)                            # tiled GEMM CTA: thread rows x columns
LMEM_BYTES = DEFAULT_CONFIG.lmem_size            # local memory per core (shared by its CTAs)
DEVICE_THREADS = DEFAULT_CONFIG.cores * CTA_THREADS   # hardware threads (warp reductions below this many outputs)
# `loops` elementwise kernels: points per thread once a space has LOOPS_COARSEN_MIN points. A
# core runs one 16-thread CTA at a time and every warp pays the start-up (~40 instructions), so
# few long CTAs win (functional simulator, 8192-point relu*b+1: 84k -> 39k warp instructions).
LOOPS_COARSEN = 16
LOOPS_COARSEN_MIN = 4096
# Cost table for the GEMM strategy's choice (tiled template vs `loops`), tiled_gemm.GemmCosts:
# warp-instruction model fitted to the functional simulator (matmuls 32^3..128^3, convs 1x1,
# 3x3, 7x7/2 of BEVFormer test_tiny), cycles per warp-instruction measured on SimX 1c x 4w x 4t.
GEMM_COSTS = dict(gemm_cpi=3.2, loops_cpi=2.8, gemm_cta=490, gemm_mac=0.375, stage_plain=1.1,
                  stage_conv=3.0, stage_conv_dim=1.0, stage_k_over=3.0, loops_out=15, loops_mac=1.16,
                  direct_cta=300, direct_load=1.5, direct_k=0.5, lanes=THREADS_PER_WARP)
MAX_GRID = (2**31 - 1, 65535, 65535)
# ----------------------------------------------------------------------------------------------

_flags: Any = None   # pipeline.CompileFlags while compile_flags() is active


@contextlib.contextmanager
def compile_flags(**changes: bool) -> Iterator[None]:
    """Internal switches for tests and benchmarks, e.g. `compile_flags(divergence=False)`
    (no SPLIT/JOIN), `compile_flags(tiled_gemm=False)` (the scalar matmul baseline) or
    `compile_flags(warp_reduce=False)` (reductions one thread per output)."""
    from gac_torch.backends.vortex.pipeline import CompileFlags

    global _flags
    saved, _flags = _flags, dataclasses.replace(_flags or CompileFlags(), **changes)
    try:
        yield
    finally:
        _flags = saved


def _stages(options: dict) -> list[Stage]:
    from gac_torch.backends.gpu.strategies import tiled_gemm, warp_reduce
    from gac_torch.backends.gpu.strategy import GpuLimits
    from gac_torch.backends.vortex import pipeline

    flags = _flags or pipeline.CompileFlags()
    limits = GpuLimits(warp_size=THREADS_PER_WARP, max_threads_per_block=CTA_THREADS,
                       max_static_shared_bytes=LMEM_BYTES, max_grid=MAX_GRID,
                       threads_per_block=CTA_THREADS, coarsen=LOOPS_COARSEN,
                       coarsen_min_points=LOOPS_COARSEN_MIN)
    # Tried in order on each linalg op; what none takes (reductions too) becomes `loops`.
    costs = tiled_gemm.GemmCosts(**GEMM_COSTS)
    strategies = (tiled_gemm.strategy(threads=GEMM_THREADS, costs=costs),) if flags.tiled_gemm else ()
    if flags.warp_reduce:
        strategies += (warp_reduce.strategy(DEVICE_THREADS, CTA_THREADS),)
    return [
        Stage("gpu", lambda linalg_module: pipeline.map_stage(linalg_module, limits, strategies, flags),
              "mlir", parse=lambda text: pipeline.parse_gpu_stage(text, flags)),
        Stage("llvm", pipeline.lower_stage, "text"),
        Stage("vxbin", pipeline.vxbin_stage, "bytes"),
    ]


def _load(program: Any, signature: Signature, options: dict) -> Any:
    from gac_torch.backends.vortex import runtime

    mode, home = runtime.resolve_mode(options)
    return runtime.VortexExecutable(program, signature, mode, home)


def _pack(program: Any, options: dict, required: bool = False) -> tuple[dict, dict[str, bytes]]:
    """The launch plan as plain data, the .vxbin as a blob (the LLVM IR is not needed to run)."""
    from gac_torch.runtime.plain import encode

    return {"program": encode(dataclasses.replace(program, vxbin=b"", llvm_ir=""))}, {"vxbin": program.vxbin}


def _unpack(meta: dict, blobs: dict[str, bytes], signature: Signature, options: dict) -> Any:
    from gac_torch.backends.gpu.program import PLAIN_TYPES
    from gac_torch.backends.vortex import runtime
    from gac_torch.backends.vortex.kernel_abi import KernelAbi
    from gac_torch.backends.vortex.pipeline import VortexProgram
    from gac_torch.runtime.plain import decode

    program = decode(meta["program"], (VortexProgram, KernelAbi, *PLAIN_TYPES))
    if not isinstance(program, VortexProgram):
        raise ValueError(f"not a VortexProgram: {type(program).__name__}")
    mode, home = runtime.resolve_mode(options)
    return runtime.VortexExecutable(dataclasses.replace(program, vxbin=blobs["vxbin"]), signature, mode, home)


TARGET = Target(
    name="vortex",
    device_type="cpu",
    stages=_stages,
    load=_load,
    pack=_pack,
    unpack=_unpack,
    # the internal switches change the code; the mode and home only where it runs
    cache_key=lambda options: {"flags": repr(_flags)},
    requires=("ziglang", "elftools"),
    extra="vortex",
)
