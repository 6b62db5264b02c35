"""The vortex target: stages gpu -> llvm -> vxbin, a loader over SimX or the functional
simulator, and what the compiler assumes about the device (the data block below).

Tensors live on the host (device_type "cpu"); the executable copies them to the device.
Options: `vortex_mode` ("simx" | "functional"; default simx when `vortex_home` or VORTEX_HOME
is set, else functional) and `vortex_home` (a Vortex build with runtime/lib/libvortex.so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gac_torch.backends.base import Signature, Stage, Target
from gac_torch.errors import GacCompilerWarning
from gac_torch.backends.vortex.target import DEFAULT_CONFIG, VortexConfig

if TYPE_CHECKING:
    from gac_torch.backends.gpu.strategy import GpuLimits

# --- data block ------------------------------------------------------------------------------
# What the compiler assumes about the device, from its configuration (option `vortex_config`:
# "CxWxT", "device" = what SimX reports; runtime.resolve_config). Below: the default, 1x4x4.
THREADS_PER_WARP = DEFAULT_CONFIG.threads
WARPS_PER_CORE = DEFAULT_CONFIG.warps
CTA_THREADS = THREADS_PER_WARP * WARPS_PER_CORE  # a CTA that synchronises must fit one core
GEMM_THREADS = (4, 4)                            # tiled GEMM CTA: thread rows x columns
LMEM_BYTES = DEFAULT_CONFIG.lmem_size            # local memory per core (shared by its CTAs)
DEVICE_THREADS = DEFAULT_CONFIG.cores * CTA_THREADS   # hardware threads (warp reductions below this many outputs)
MAX_GRID = (2**31 - 1, 65535, 65535)
# `loops` elementwise kernels: points per thread once a space still fills every hardware thread
# with them (LOOPS_COARSEN x cores x CTA threads points: 256 on 1x4x4). A core runs one 16-thread
# CTA at a time and every warp pays the start-up (~40 instructions), so few long CTAs win
# (functional simulator, 8192-point relu*b+1: 84k -> 39k warp instructions; BEVFormer test_tiny's
# encoder on SimX with the threshold at 4096 -> 2048 -> 1024 -> 256 points: 8.50M -> 7.82M ->
# 6.89M -> 6.85M cycles).
LOOPS_COARSEN = 16
# Cost table for the GEMM strategy's choice (staged tiles, direct tiles or `loops`,
# tiled_gemm.GemmCosts): a warp-instruction model fitted to the functional simulator (matmuls
# 32^3..128^3, convs 1x1, 3x3, 7x7/2 of BEVFormer test_tiny) times cycles per warp-instruction
# measured on SimX 1x4x4 (BEVFormer's 7x7/2 stem conv: staged 3.79, direct 2.69, loops 3.15;
# benchmarks/results/vortex_bevformer.md).
GEMM_COSTS = dict(gemm_cpi=3.8, loops_cpi=3.15, direct_cpi=2.7, gemm_cta=490, gemm_mac=0.375, stage_plain=1.1,
                  stage_conv=3.0, stage_conv_dim=1.0, stage_k_over=3.0, loops_out=15, loops_mac=1.16,
                  direct_cta=300, direct_load=1.5, direct_k=0.5)


def limits_for(cfg: VortexConfig) -> tuple[GpuLimits, tuple[int, int], int]:
    """(scheduler limits, GEMM CTA (rows, cols), device threads) for a configuration; the
    default configuration gives the constants above."""
    from gac_torch.backends.gpu.strategy import GpuLimits

    cta = cfg.warps * cfg.threads
    lim = GpuLimits(warp_size=cfg.threads, max_threads_per_block=cta,
                    max_static_shared_bytes=cfg.lmem_size, max_grid=MAX_GRID,
                    threads_per_block=cta, coarsen=LOOPS_COARSEN,
                    coarsen_min_points=LOOPS_COARSEN * cfg.cores * cta,
                    serial_min_threads=cfg.cores * cta)
    gemm = GEMM_THREADS if dataclasses.replace(cfg, tcu=False) == DEFAULT_CONFIG else (cfg.warps, cfg.threads)
    return lim, gemm, cfg.cores * cta
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
    from gac_torch.backends.gpu.strategies import flat_fill, implicit_gemm, tcu_gemm, tiled_gemm, warp_reduce
    from gac_torch.backends.vortex import pipeline, runtime
    from gac_torch.backends.vortex.target import WMMA

    flags = _flags or pipeline.CompileFlags()
    cfg = runtime.resolve_config(options, *runtime.resolve_mode(options))
    limits, gemm_threads, device_threads = limits_for(cfg)
    # Tried in order on each linalg op; what none takes becomes `loops`.
    costs = tiled_gemm.GemmCosts(**GEMM_COSTS, lanes=cfg.threads)
    # (`fused` first: it erases the elementwise consumers a GEMM took into its store step)
    strategies = ((implicit_gemm.fused_strategy(),
                   tiled_gemm.strategy(threads=gemm_threads, costs=costs, epilogue=flags.gemm_epilogue,
                                       padding=flags.gemm_padding))
                  if flags.tiled_gemm else ())
    if cfg.tcu and cfg.threads == WMMA.threads:   # opt-in (vortex_tcu): f16/bf16 matmuls on the TCU
        strategies = (tcu_gemm.strategy(WMMA, cfg.warps, epilogue=flags.tiled_gemm and flags.gemm_epilogue),
                      ) + strategies
    elif cfg.tcu:
        warnings.warn(f"vortex_tcu: the WMMA fragment map is for {WMMA.threads}-thread warps, the "
                      f"configuration has {cfg.threads}; matmuls stay off the tensor-core unit",
                      GacCompilerWarning, stacklevel=2)
    if flags.flat_fill and not flags.gemm_padding:   # (they would take the padding's fill and copy
        strategies += (flat_fill.strategy(), flat_fill.copy_strategy())   # before the GEMM sees them)
    if flags.warp_reduce:
        strategies += (warp_reduce.strategy(device_threads, limits.max_threads_per_block),)
    return [
        Stage("gpu", lambda linalg_module: pipeline.map_stage(linalg_module, limits, strategies, flags),
              "mlir", parse=lambda text: pipeline.parse_gpu_stage(text, flags)),
        Stage("llvm", pipeline.lower_stage, "text"),
        Stage("vxbin", pipeline.vxbin_stage, "bytes"),
    ]


def _config_key(options: dict) -> str | None:
    from gac_torch.backends.vortex import runtime

    if options.get("vortex_config") != "device":
        return options.get("vortex_config")
    cfg = runtime.resolve_config(options, *runtime.resolve_mode(options))
    return f"{cfg.cores}x{cfg.warps}x{cfg.threads}"


def _load(program: Any, signature: Signature, options: dict) -> Any:
    from gac_torch.backends.vortex import runtime

    mode, home = runtime.resolve_mode(options)
    return runtime.VortexExecutable(program, signature, mode, home, runtime.resolve_config(options, mode, home))


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
    return runtime.VortexExecutable(dataclasses.replace(program, vxbin=blobs["vxbin"]), signature, mode, home,
                                    runtime.resolve_config(options, mode, home))


TARGET = Target(
    name="vortex",
    device_type="cpu",
    stages=_stages,
    load=_load,
    pack=_pack,
    unpack=_unpack,
    # the internal switches and the configuration change the code; the mode and home only
    # where it runs
    cache_key=lambda options: {"flags": repr(_flags), "config": _config_key(options)},
    requires=("ziglang", "elftools"),
    extra="vortex",
)
