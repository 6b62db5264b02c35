"""The vortex target's stages: linalg -> "gpu" -> "llvm" -> "vxbin".

- "gpu":   backends/gpu with Vortex's strategies (one kernel per linalg op; the tiled GEMM for
           matmuls and convolutions where the cost table says it pays, with the elementwise
           consumers in its store step; flat fills and row copies; a warp per output for
           reductions with fewer outputs than hardware threads (shuffles, never gpu.all_reduce),
           else `loops`); the host function left over is read into data (launch list + static
           buffer plan).
- "llvm":  kernel_abi turns the kernels into func.funcs calling vx_* helpers; math is expanded
           into polynomials (math_expand), f16/bf16/i64 corner cases made branch-free or
           lane-serial (numerics); divergent scf.ifs get SPLIT/JOIN (divergence);
           upstream passes lower to the LLVM dialect with 32-bit indices and bare-pointer
           memrefs; `mlirTranslateModuleToLLVMIRToString` gives LLVM IR text.
- "vxbin": the toolchain (ziglang clang/lld) links the kernels into one .vxbin.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
from dataclasses import dataclass, field, replace
from typing import Any

from mlir import ir

from gac_torch.backends.gpu.irutil import run_passes
from gac_torch.backends.gpu.program import ArgSpec, BufferRef, KernelLaunch, TempBuffer
from gac_torch.backends.gpu.stage import read_scheduled, schedule_module
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.backends.vortex import divergence, kernel_abi, math_expand, numerics
from gac_torch.backends.vortex.kernel_abi import KernelAbi
from gac_torch.errors import CompileError
from gac_torch.passes.memory_plan import MemoryPlan


@dataclass(frozen=True)
class CompileFlags:
    """Internal switches (tests and benchmarks), not user options."""

    divergence: bool = True       # False: no SPLIT/JOIN (wrong on SimX; the tests prove it)
    tiled_gemm: bool = True       # False: matmuls use the scalar `loops` kernel
    gemm_epilogue: bool = True    # False: a GEMM's elementwise consumers stay their own kernels
    gemm_padding: bool = False    # True: a GEMM reads a zero padding's source through guards
    warp_reduce: bool = True      # False: reductions use one thread per output (`loops`)
    flat_fill: bool = True        # False: fills of dense buffers are `loops` kernels


@dataclass
class VortexProgram:
    """Everything the runtime needs: the .vxbin and the host side as data."""

    launches: list[KernelLaunch]
    temps: list[TempBuffer]
    plan: MemoryPlan
    args: list[ArgSpec]                                   # inputs then outputs
    kernels: dict[str, KernelAbi] = field(default_factory=dict)
    llvm_ir: str = ""
    vxbin: bytes = b""
    split_joins: int = 0                                  # divergent branches bracketed
    in_place: tuple = ()                                  # (input, output) args that may share a buffer

    @property
    def binary(self) -> bytes:                            # what GAC_DUMP_DIR writes as .vxbin
        return self.vxbin

    def describe(self) -> str:
        lines = [(f"workspace {self.plan.workspace_size} B; {len(self.launches)} launches; "
                  f"{self.split_joins} divergent branches bracketed with split/join")]
        lines += [f"temp{i} {t.name}: {t.nbytes} B at +{self.plan.offsets[t.name]}"
                  for i, t in enumerate(self.temps)]
        lines += [f"arg{i}: {a.elem}{list(a.shape)}" for i, a in enumerate(self.args)]
        for k in self.launches:
            args = ", ".join(f"{a.kind}{a.index}" if isinstance(a, BufferRef) else f"{a.ctype}({a.value})"
                             for a in k.args)
            lines.append(f"launch {k.kernel} grid={k.grid} block={k.block} lmem={k.shared_mem} ({args})")
        return "\n".join(lines)

    @property
    def text(self) -> str:                                # the "vxbin" stage's recorded text
        if not self.vxbin:
            return self.describe()
        digest = hashlib.sha256(self.vxbin).hexdigest()[:16]
        return f"// .vxbin: {len(self.vxbin)} bytes, sha256 {digest}\n{self.describe()}"

    def __str__(self) -> str:
        return self.text


@dataclass
class GpuStage:
    module: ir.Module
    program: VortexProgram
    flags: CompileFlags

    @property
    def text(self) -> str:
        host = "\n".join("// " + ln for ln in self.program.describe().splitlines())
        return f"{host}\n{self.module}"


@dataclass
class LlvmStage:
    program: VortexProgram
    flags: CompileFlags

    @property
    def text(self) -> str:
        return self.program.llvm_ir


# --------------------------------------------------------------------------------------------
def map_stage(artifact: Any, limits: GpuLimits, strategies: tuple[Strategy, ...],
              flags: CompileFlags) -> GpuStage:
    # in place (the driver has recorded its text); text (a dumped stage) into a fresh context
    module = artifact if isinstance(artifact, ir.Module) else ir.Module.parse(artifact, ir.Context())
    host = schedule_module(module, limits, strategies, "vortex", "vortex")
    program = VortexProgram(host.launches, host.temps, host.plan, host.args, in_place=host.in_place)
    return GpuStage(module, program, flags)


def parse_gpu_stage(text: str, flags: CompileFlags) -> GpuStage:
    """A dumped (possibly edited) "gpu" stage back: the module, its host program read again."""
    module = ir.Module.parse(text, ir.Context())
    host = read_scheduled(module, "vortex")
    return GpuStage(module, VortexProgram(host.launches, host.temps, host.plan, host.args, in_place=host.in_place),
                    flags)


# Why each step: index ops get 32-bit; memref.copy and affine leftovers go away; memrefs become
# bare pointers with static shapes baked in; math left after math_expand maps to instructions.
TO_LLVM = ",".join([
    "lower-affine", "convert-scf-to-cf", "canonicalize", "cse",
    "expand-strided-metadata", "lower-affine",
    "finalize-memref-to-llvm{index-bitwidth=32}",
    "convert-math-to-llvm",
    "convert-arith-to-llvm{index-bitwidth=32}",
    "convert-index-to-llvm{index-bitwidth=32}",
    "convert-func-to-llvm{use-bare-ptr-memref-call-conv=1 index-bitwidth=32}",
    "convert-cf-to-llvm{index-bitwidth=32}",
    "reconcile-unrealized-casts",
])


def lower_stage(stage: GpuStage) -> LlvmStage:
    module = stage.module  # in place: the "gpu" stage's text is recorded already
    with module.context, ir.Location.unknown():
        for op in list(module.body.operations):           # the host side is data already
            if op.operation.name == "func.func":
                op.operation.erase()
        # thread ids are bounded by known_block_size: folds bounds checks that always hold
        run_passes(module, "int-range-optimizations, canonicalize, cse")
        out, abis = kernel_abi.kernels_to_funcs(module)
        run_passes(out, "func.func(math-extend-to-supported-types{target-type=f32}, "
                           f"math-expand-ops{{ops={math_expand.UPSTREAM_EXPANDED}}})")
        math_expand.expand_math(out.operation)
        run_passes(out, numerics.PASSES)      # f16/bf16 in f32, i64 division serialised
        numerics.expand_numerics(out)
        splits = 0
        if stage.flags.divergence:
            divergence.declare_helpers(out, ["vx_split", "vx_join"])
            for op in out.body.operations:
                if op.operation.name == "func.func" and len(op.operation.regions[0].blocks):
                    splits += divergence.insert_split_join(op.operation)
        run_passes(out, "canonicalize, cse")
        run_passes(out, TO_LLVM)
        text = translate_to_llvm_ir(out)
    lmem = {a.name: a.lmem_size for a in abis}
    prog = replace(stage.program, kernels={a.name: a for a in abis}, llvm_ir=text, split_joins=splits,
                   launches=[replace(k, shared_mem=lmem[k.kernel]) for k in stage.program.launches])
    return LlvmStage(prog, stage.flags)


def vxbin_stage(stage: LlvmStage) -> VortexProgram:
    from gac_torch.backends.vortex.toolchain import KernelSpec, build

    prog = stage.program
    if not prog.launches:
        return prog
    specs = [KernelSpec(a.name, a.params) for a in prog.kernels.values()]
    return replace(prog, vxbin=build(ir=[prog.llvm_ir], kernels=specs).vxbin)


# --------------------------------------------------------------------------------------------
def translate_to_llvm_ir(module: ir.Module) -> str:
    """LLVM IR text of an LLVM-dialect module, through the bindings' C API (docs/stack.md)."""
    import mlir._mlir_libs as libs

    global _TRANSLATE
    if _TRANSLATE is None:
        lib = glob.glob(os.path.join(os.path.dirname(libs.__file__), "libMLIRPythonCAPI.so*"))[0]
        fn = ctypes.CDLL(lib).mlirTranslateModuleToLLVMIRToString
        fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        _TRANSLATE = fn
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    cap = module.operation._CAPIPtr
    ptr = _TRANSLATE(api.PyCapsule_GetPointer(cap, api.PyCapsule_GetName(cap)))
    if not ptr:
        raise CompileError("MLIR -> LLVM IR translation failed (see stderr)")
    text = ctypes.string_at(ptr).decode()
    ctypes.CDLL(None).free(ctypes.c_void_p(ptr))
    return text


_TRANSLATE: Any = None
