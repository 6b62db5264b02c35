"""The cuda target: stages gpu -> llvm -> ptx, a driver-API loader, and the device data.

Everything the compiler assumes about NVIDIA GPUs is in the data block below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gac_torch.backends.base import Signature, Stage, Target
from gac_torch.backends.cuda import ptxas, runtime
from gac_torch.backends.gpu import tuning
from gac_torch.backends.gpu.program import GpuProgram


@dataclass(frozen=True)
class CudaArch:
    ptx_isa: str  # LLVM feature selecting the PTX ISA version: the lowest that supports the arch
    smem_per_block_optin: int  # bytes of shared memory a block may use (with opt-in)


# --- data block --------------------------------------------------------------------------------
WARP_SIZE = 32
MAX_THREADS_PER_BLOCK = 1024
MAX_STATIC_SHARED_BYTES = 48 * 1024  # static __shared__ limit on every arch; more needs opt-in
MAX_GRID = (2**31 - 1, 65535, 65535)
DEFAULT_ARCH = "sm_90"  # when no GPU is visible (CI compiles for the H200)
MMA_MIN_ARCH = 80  # mma.sync m16n8k16 f16/bf16 and m16n8k8 tf32 with f32 accumulators
ACCEL_ARCH = {"sm_90": "sm_90a", "sm_90a": "sm_90a"}  # wgmma + TMA + setmaxnreg (strategies/wgmma.py)
OPT_LEVEL = 3
ARCHS = {
    "sm_70": CudaArch("+ptx60", 96 * 1024),
    "sm_75": CudaArch("+ptx63", 64 * 1024),
    "sm_80": CudaArch("+ptx70", 163 * 1024),
    "sm_86": CudaArch("+ptx71", 99 * 1024),
    "sm_87": CudaArch("+ptx74", 163 * 1024),
    "sm_89": CudaArch("+ptx78", 99 * 1024),
    "sm_90": CudaArch("+ptx78", 227 * 1024),
    "sm_90a": CudaArch("+ptx80", 227 * 1024),
    "sm_100": CudaArch("+ptx86", 227 * 1024),
    "sm_120": CudaArch("+ptx87", 99 * 1024),
}
# ------------------------------------------------------------------------------------------------


def default_arch() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return DEFAULT_ARCH


def compile_options(options: Any) -> Any:
    """Target options (options.CudaOptions, or a dict resolved into one) -> pipeline.CudaCodegen
    (the import is deferred: loading needs no MLIR)."""
    from gac_torch.backends.cuda import pipeline
    from gac_torch.backends.gpu.strategies import (
        conv_wgmma, flash_attention, flash_wgmma, implicit_gemm, mma, reduce, row, sgemm_relayout, simt_matmul, wgmma,
    )
    from gac_torch.backends.gpu.strategy import GpuLimits
    from gac_torch.options import CudaOptions, resolve
    from gac_torch.runtime import cache

    opts = options
    if not isinstance(options, CudaOptions):  # a plain dict (tests, benchmarks): TF32 as given
        opts = resolve(options, target="cuda")
        exact = {k: v for k, v in (options or {}).items() if k.startswith("allow_tf32") and v is not None}
        opts = opts.replace(**exact) if exact else opts
    arch, allow_tf32, conv_tf32 = opts.arch, opts.allow_tf32, opts.allow_tf32_conv  # validated there
    limits = GpuLimits(warp_size=WARP_SIZE, max_threads_per_block=MAX_THREADS_PER_BLOCK,
                       max_static_shared_bytes=MAX_STATIC_SHARED_BYTES, max_grid=MAX_GRID,
                       max_dynamic_shared_bytes=ARCHS[arch].smem_per_block_optin, combine_prep=True,
                       sgemm_relayout=not allow_tf32)
    # Tried in order on each linalg op (flash: on each gac.attention call); what none takes
    # becomes a `loops` kernel (a gac.attention call: inlined first). igemm / sgemm take convs
    # and multi-dim contractions; plain matmuls go on to wgmma / mma, except static exact-f32
    # ones, which sgemm takes too (matmul keeps dynamic shapes, ints and casts).
    mma_ok = int(arch.removeprefix("sm_").rstrip("a")) >= MMA_MIN_ARCH
    igemm = implicit_gemm.Params(mma=mma_ok, allow_tf32=bool(allow_tf32), conv_allow_tf32=bool(conv_tf32))
    strategies = (
        # (flash_wgmma: f16/bf16 attention on sm_90a, GAC_FLASH_WGMMA=1; flash takes the rest)
        *([flash_wgmma.strategy()] if arch in ACCEL_ARCH else []),
        *([flash_attention.strategy(allow_tf32=bool(allow_tf32))] if mma_ok else []),
        row.strategy(row.RowParams(stream_min_bytes=64 * 2**20, row_reciprocal=True)),
        implicit_gemm.fused_strategy(),
        sgemm_relayout.copy_strategy(),  # (gpu/relayout.py's K-outer copy where no epilogue took it)
        # (wgmma before igemm: it also takes a GEMM whose M is several dims, nn.Linear on 3-D)
        *([wgmma.strategy(allow_tf32=bool(allow_tf32), conv_allow_tf32=bool(conv_tf32))]
          if arch in ACCEL_ARCH else []),
        # (conv_wgmma: the convs whose channels come in 16-byte vectors; igemm the rest)
        *([conv_wgmma.strategy(igemm)] if arch in ACCEL_ARCH else []),
        *([implicit_gemm.strategy(igemm, simt=False)] if mma_ok else []),
        implicit_gemm.strategy(igemm, simt=True),
        *([mma.strategy(allow_tf32=bool(allow_tf32))] if mma_ok else []),
        simt_matmul.strategy(big_tile_min_blocks=256),
        reduce.strategy(reduce.ReduceParams(threads=256, warp_max=1024, min_extent=128)),
    )
    accel = ACCEL_ARCH.get(arch)
    return pipeline.CudaCodegen(arch, ARCHS[arch].ptx_isa, OPT_LEVEL, limits, strategies, bool(allow_tf32),
                                accel, ARCHS[accel].ptx_isa if accel else "", cache.enabled(opts))


def _stages(options: dict) -> list[Stage]:
    from gac_torch.backends.cuda import pipeline

    opts = compile_options(options)
    return [
        Stage("gpu", lambda linalg_module: pipeline.map_stage(linalg_module, opts), "mlir",
              parse=lambda text: pipeline.parse_gpu_stage(text, opts)),
        Stage("llvm", pipeline.lower_stage, "mlir"),
        Stage("ptx", pipeline.ptx_stage, "text"),
    ]


def _load(program: GpuProgram, signature: Signature, options: dict) -> runtime.CudaExecutable:
    return runtime.CudaExecutable(program, signature, (options or {}).get("cuda_graphs"))


def _tune(build, signature: Signature, options: dict) -> None:
    """options["autotune"]: time each tile candidate on this GPU (backends/cuda/autotune.py)."""
    from gac_torch.backends.cuda import autotune

    if not torch.cuda.is_available():
        autotune.log.warning("gac autotune: no GPU visible; kernels keep the heuristic tiles")
        return
    inputs = autotune.random_inputs(signature)
    if inputs is None:
        autotune.log.info("gac autotune: skipped (run-time sizes or non-float inputs)")
        return
    def measure(exe: runtime.CudaExecutable) -> dict[str, float]:
        exe.use_graphs = False  # kernel by kernel: each launch is the profiler's own event
        return autotune.kernel_times(lambda: exe.call(inputs))

    autotune.tune(build, measure, options.get("arch") or default_arch())


def _pack(program: GpuProgram, options: dict, required: bool = False) -> tuple[dict, dict[str, bytes]]:
    """The host program as JSON; its PTX (zlib'd: BEVFormer-tiny's is 7 MB, JSON-escaped in
    every entry holding it before) and each cubin as binary blobs."""
    import zlib
    from dataclasses import replace

    from gac_torch.backends.gpu.program import to_json

    cubins = [{"arch": c.arch, "kernels": list(c.kernels), "entry": c.entry} for c in program.cubins]
    return ({"program": to_json(replace(program, cubins=[], ptx="")), "cubins": cubins},
            {"ptx": zlib.compress(program.ptx.encode(), 1),
             **{f"cubin:{i}": c.data for i, c in enumerate(program.cubins)}})


def _unpack(meta: dict, blobs: dict[str, bytes], signature: Signature, options: dict) -> runtime.CudaExecutable:
    import zlib

    from gac_torch.backends.gpu.program import Cubin, from_json

    program = from_json(meta["program"])
    program.ptx = zlib.decompress(blobs["ptx"]).decode()
    program.cubins = [Cubin(c["arch"], blobs[f"cubin:{i}"], tuple(c["kernels"]), c["entry"])
                      for i, c in enumerate(meta.get("cubins", []))]
    return runtime.CudaExecutable(program, signature, (options or {}).get("cuda_graphs"))


TARGET = Target(
    name="cuda",
    device_type="cuda",
    stages=_stages,
    load=_load,
    check_available=runtime.check_available,
    dynamic_shapes=True,
    channels_last=True,  # the implicit GEMM reads NHWC channels in 16-byte vectors
    pack=_pack,
    unpack=_unpack,
    cache_key=lambda options: {"arch": (arch := options.get("arch") or default_arch()),
                               "tuning": tuning.digest(arch), "ptxas": ptxas.cubin_key()},
    tune=_tune,
)
