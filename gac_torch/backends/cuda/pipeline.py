"""The CUDA target's stages: linalg -> "gpu" -> "llvm" -> "ptx".

- "gpu":  mapping.map_to_gpu (one kernel per linalg op, outlined into `gpu.module @gac_kernels`);
          the host function that is left is read into data (launch list + buffer plan).
- "llvm": the gpu.module lowered to the NVVM/LLVM dialect (bare-pointer memref arguments, so a
          kernel takes one pointer per buffer and bakes static shapes/strides/offsets in).
- "ptx":  `gpu-module-to-binary{format=isa}` in-process; libdevice is linked for math functions.

Everything here runs without a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlir import ir
from mlir.dialects import gpu

from gac_torch.backends.cuda import mapping
from gac_torch.backends.cuda.program import (
    ArgSpec,
    BufferRef,
    CudaProgram,
    HOST_OPS,
    Dyn,
    HostOp,
    KernelArg,
    KernelLaunch,
    ScalarArg,
    TempBuffer,
)
from gac_torch.backends.base import StaticShapesOnly
from gac_torch.passes.memory_plan import BufferUse, MemoryPlan, plan_memory

_ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "i16": 2, "i32": 4,
               "i64": 8}


@dataclass
class CudaOptions:
    arch: str  # "sm_90"
    ptx_features: str  # "+ptx80": the PTX ISA version LLVM emits
    opt_level: int
    limits: mapping.MappingLimits


@dataclass
class GpuStage:
    """Artifact of the "gpu" and "llvm" stages: the module plus the host program read from it."""

    module: ir.Module
    program: CudaProgram  # ptx still empty
    options: CudaOptions

    @property
    def text(self) -> str:  # what the driver records for this stage
        host = "\n".join("// " + line for line in self.program.describe().splitlines())
        return f"{host}\n{self.module}"

    def __str__(self) -> str:
        return self.text


# --------------------------------------------------------------------------------------------
# stage "gpu"


def _as_module(artifact: str | ir.Module | ir.Operation | Any) -> ir.Module:
    """A private copy in a fresh context: stages must not mutate the driver's artifact."""
    text = artifact if isinstance(artifact, str) else str(artifact)
    return ir.Module.parse(text, ir.Context())


def _elem_name(t: ir.Type) -> str:
    return str(t)


def map_stage(artifact: Any, options: CudaOptions) -> GpuStage:
    module = _as_module(artifact)
    with module.context, ir.Location.unknown():
        fn = mapping.main_func(module)
        args = [_arg_spec(a.type) for a in mapping._block(fn).arguments]
        dynamic = any(a.elem == "index" or -1 in a.shape for a in args)
        n_inputs = _count_inputs(fn)
        try:
            mapping.map_to_gpu(module, options.limits)
            if dynamic:  # views' run-time metadata as index math over their allocations' sizes
                mapping.run_passes(module, "func.func(expand-strided-metadata, lower-affine, canonicalize, cse)")
            _annotate_noalias(module)
            program = _read_host_program(module, args, options.arch, dynamic)
        except NotImplementedError as e:
            if dynamic:  # what the mapping handles for static shapes only
                raise StaticShapesOnly(f"cuda mapping: {e}") from e
            raise
    errors = program.dataflow_errors(n_inputs)
    if errors:  # a wrong program must not run: fail the compile, naming what is wrong
        raise RuntimeError("cuda target: the compiled launch list violates its dataflow "
                           "invariants (a compiler bug):\n  " + "\n  ".join(errors)
                           + "\n" + program.describe())
    return GpuStage(module, program, options)


def _arg_spec(t: ir.Type) -> ArgSpec:
    if t == ir.IndexType.get():
        return ArgSpec((), "index")
    mt = ir.MemRefType(t)
    return ArgSpec(tuple(-1 if n == mapping._DYN else n for n in mt.shape), _elem_name(mt.element_type))


def _count_inputs(fn: ir.Operation) -> int:
    """Inputs precede outputs in the ABI; outputs are the materialize_in_destination targets."""
    block = mapping._block(fn)
    params = list(block.arguments)
    outs = [params.index(op.operands[1]) for op in mapping._ops(block)
            if op.name == "bufferization.materialize_in_destination" and op.operands[1] in params]
    return min(outs, default=len(params))


def _kernel_funcs(module: ir.Module) -> dict[str, ir.Operation]:
    out = {}
    for op in module.body.operations:
        if op.operation.name == "gpu.module":
            for f in op.regions[0].blocks[0].operations:
                if f.operation.name == "gpu.func":
                    out[ir.StringAttr(f.attributes["sym_name"]).value] = f.operation
    return out


def _annotate_noalias(module: ir.Module) -> None:
    """Mark kernel pointer arguments `llvm.noalias` when no other argument of the same launch
    views the same allocation: LLVM may then keep accumulators in registers across loops."""
    fn = mapping.main_func(module)
    funcs = _kernel_funcs(module)
    for op in mapping._ops(mapping._block(fn)):
        if op.name != "gpu.launch_func":
            continue
        launch = op.opview
        kfunc = funcs[_kernel_name(op)]
        operands = list(launch.kernelOperands)
        roots = [mapping.buffer_root(v) if isinstance(v.type, ir.MemRefType) else None for v in operands]
        attrs = []
        for v, r in zip(operands, roots):
            entries = {}
            if r is not None and sum(1 for x in roots if x is not None and x == r) == 1:
                entries["llvm.noalias"] = ir.UnitAttr.get()
            attrs.append(ir.DictAttr.get(entries))
        kfunc.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)


def _kernel_name(launch_func: ir.Operation) -> str:
    # `@gac_kernels::@name`: the leaf reference is the kernel's symbol and PTX entry name.
    text = str(launch_func.attributes["kernel"])
    return text.rsplit("::@", 1)[-1].strip('"')


# How kernel-body ops touch memref operands: operand positions read / written.
_READS = {"memref.load": (0,), "vector.load": (0,), "vector.transfer_read": (0,),
          "vector.maskedload": (0,), "nvgpu.ldmatrix": (0,), "memref.copy": (0,),
          "nvgpu.device_async_copy": (1,)}
_WRITES = {"memref.store": (1,), "vector.store": (1,), "vector.transfer_write": (1,),
           "vector.maskedstore": (0,), "memref.copy": (1,), "nvgpu.device_async_copy": (0,)}


def _kernel_access(kfunc: ir.Operation) -> list[str]:
    """Per kernel parameter: "r" if the body loads from it, "w" if it stores to it (through
    in-kernel views too); any other op using a parameter counts as both."""
    body = kfunc.regions[0].blocks[0]
    params = list(body.arguments)
    acc = [set() for _ in params]

    def param_of(v: ir.Value) -> int | None:
        root = mapping.buffer_root(v)
        return params.index(root) if root in params else None

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in mapping._VIEW_OPS or op.name == "memref.dim":  # metadata, no data
            return ir.WalkResult.ADVANCE
        for pos, v in enumerate(op.operands):
            if not isinstance(v.type, ir.MemRefType):
                continue
            p = param_of(v)
            if p is None:
                continue
            r, w = pos in _READS.get(op.name, ()), pos in _WRITES.get(op.name, ())
            if not r and not w:
                r = w = True  # unknown: assume both
            if r:
                acc[p].add("r")
            if w:
                acc[p].add("w")
        return ir.WalkResult.ADVANCE

    kfunc.walk(visit, ir.WalkOrder.PRE_ORDER)
    return [("r" if "r" in a else "") + ("w" if "w" in a else "") for a in acc]


def _whole(v: ir.Value) -> bool:
    """`v` covers its whole allocation: only reshaping views, no subviews or offsets."""
    root = mapping.buffer_root(v)
    if v == root:
        return True
    t, rt = ir.MemRefType(v.type), ir.MemRefType(root.type)
    op = mapping._defining_op(v)
    while op is not None and op.name in mapping._VIEW_OPS:
        if op.name not in ("memref.expand_shape", "memref.collapse_shape", "memref.cast"):
            return False
        op = mapping._defining_op(op.operands[0])
    return math.prod(t.shape) == math.prod(rt.shape)


class _SizeMath:
    """The host's index values over run-time sizes -> HostOps (program.py), built on demand."""

    def __init__(self, block: ir.Block):
        self.block = block
        self.args = {a: i for i, a in enumerate(block.arguments)}
        self.ops: list[HostOp] = []
        self.refs: dict[ir.Value, Dyn] = {}
        self.consts: dict[tuple, Dyn] = {}

    def _emit(self, op: str, args: tuple[int, ...], pred: str = "", type: str = "index") -> Dyn:
        self.ops.append(HostOp(op, args, pred, type))
        return Dyn(len(self.ops) - 1)

    def const(self, value: int | float) -> Dyn:
        key = (type(value), value)
        if key not in self.consts:
            self.consts[key] = self._emit("const", (value,))
        return self.consts[key]

    def value(self, v: ir.Value) -> int | float | Dyn:
        """A constant as a number, anything else as a Dyn."""
        op = mapping._defining_op(v)
        if op is not None and op.name == "arith.constant":
            attr = op.attributes["value"]
            return ir.IntegerAttr(attr).value if isinstance(attr, ir.IntegerAttr) else ir.FloatAttr(attr).value
        if v not in self.refs:
            self.refs[v] = self._translate(v, op)
        return self.refs[v]

    def ref(self, v: ir.Value) -> Dyn:
        x = self.value(v)
        return x if isinstance(x, Dyn) else self.const(x)

    def size(self, buf: ir.Value, dim: int) -> int | Dyn:
        """Size `dim` of a buffer: static from its type, else from what defines it."""
        t = ir.MemRefType(buf.type)
        if t.shape[dim] != mapping._DYN:
            return t.shape[dim]
        op = mapping._defining_op(buf)
        if op is None and buf in self.args:
            return self._emit("dim", (self.args[buf], dim))
        if op is not None and op.name in ("memref.alloc", "memref.reinterpret_cast"):
            dynamic_sizes = list(op.operands) if op.name == "memref.alloc" else list(op.opview.sizes)
            return self.ref(dynamic_sizes[sum(1 for n in t.shape[:dim] if n == mapping._DYN)])
        raise NotImplementedError(f"run-time size of a buffer defined by {op.name if op else 'a block argument'}")

    def _translate(self, v: ir.Value, op: ir.Operation | None) -> Dyn:
        if op is None:
            if v in self.args and v.type == ir.IndexType.get():
                return self._emit("size", (self.args[v],))
            raise NotImplementedError(f"host index value from an unknown block argument: {v}")
        name = op.name
        if name == "memref.dim":
            return self.ref_of(self.size(op.operands[0], int(self.value(op.operands[1]))))
        if name == "memref.extract_strided_metadata":
            # of a function argument or an allocation (expand-strided-metadata folded every
            # view into these): dense row-major at offset 0
            src = op.operands[0]
            root = mapping._defining_op(src)
            if not (src in self.args or root is not None and root.name == "memref.alloc"):
                raise NotImplementedError(f"run-time metadata of a view made by {root.name if root else src}")
            rank = ir.MemRefType(src.type).rank
            k = list(op.results).index(v)
            if k == 1:
                return self.const(0)
            if 2 <= k < 2 + rank:
                return self.ref_of(self.size(src, k - 2))
            stride: int | Dyn = 1
            for d in range(rank - 1, k - 2 - rank, -1):
                stride = self._mul(stride, self.size(src, d))
            return self.ref_of(stride)
        short = name.removeprefix("arith.")
        if name.startswith("arith.") and short in HOST_OPS and mapping.is_size_math(op):
            refs = tuple(self.ref(x).ref for x in op.operands)
            if short == "cmpi":
                names = ["eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge"]
                return self._emit("cmpi", refs, names[ir.IntegerAttr(op.attributes["predicate"]).value])
            ty = str(v.type)
            return self._emit(short, refs, type="i1" if ty == "i1" else ty)
        raise NotImplementedError(f"host index value computed by {name}")

    def ref_of(self, x: int | Dyn) -> Dyn:
        return x if isinstance(x, Dyn) else self.const(x)

    def _mul(self, a: int | Dyn, b: int | Dyn) -> int | Dyn:
        if isinstance(a, int) and isinstance(b, int):
            return a * b
        return self._emit("muli", (self.ref_of(a).ref, self.ref_of(b).ref))

    def nbytes(self, alloc: ir.Operation) -> int | Dyn:
        t = ir.MemRefType(alloc.results[0].type)
        n: int | Dyn = _ELEM_BYTES[_elem_name(t.element_type)]
        for d in range(t.rank):
            n = self._mul(n, self.size(alloc.results[0], d))
        return n


def _read_host_program(module: ir.Module, args: list[ArgSpec], arch: str,
                       dynamic: bool = False) -> CudaProgram:
    """Turn the host function (constants, allocs, views, launch_funcs, and the index math over
    run-time sizes) into data."""
    fn = mapping.main_func(module)
    block = mapping._block(fn)
    funcs = _kernel_funcs(module)
    arg_index = {a: i for i, a in enumerate(block.arguments)}
    temps: dict[ir.Value, int] = {}
    temp_list: list[TempBuffer] = []
    live: dict[int, list[int]] = {}
    launches: list[KernelLaunch] = []
    sizes = _SizeMath(block)

    def const(v: ir.Value) -> int | float | Dyn:
        x = sizes.value(v)
        if isinstance(x, Dyn) and not dynamic:
            raise NotImplementedError(f"kernel argument is not a constant: {v}")
        return x

    for op in mapping._ops(block):
        name = op.name
        if name == "memref.alloc":
            temps[op.results[0]] = len(temp_list)
            temp_list.append(TempBuffer(f"t{len(temp_list)}", sizes.nbytes(op)))
        elif name == "gpu.launch_func":
            lf = op.opview
            kargs: list[KernelArg] = []
            body_access = _kernel_access(funcs[_kernel_name(op)])
            access: list[str] = []
            for v, m in zip(lf.kernelOperands, body_access):
                if (isinstance(v.type, ir.MemRefType) and "w" in m and _whole(v)
                        and not _kernel_name(op).endswith("_serial")):
                    # a kernel mapped from a linalg op writes each element of its output; a
                    # serial kernel (host scalar code) may store single elements
                    m = m.replace("w", "W")
                access.append(m if isinstance(v.type, ir.MemRefType) else "")
            for v in lf.kernelOperands:
                if isinstance(v.type, ir.MemRefType):
                    root = mapping.buffer_root(v)
                    if root in arg_index:
                        kargs.append(BufferRef("arg", arg_index[root]))
                    elif root in temps:
                        t = temps[root]
                        kargs.append(BufferRef("temp", t))
                        live.setdefault(t, []).append(len(launches))
                    else:
                        raise NotImplementedError(f"kernel argument views an unsupported buffer: {root}")
                else:
                    kargs.append(ScalarArg(_scalar_ctype(v.type), const(v)))
            grid = tuple(x if isinstance(x := const(v), Dyn) else int(x)
                         for v in (lf.gridSizeX, lf.gridSizeY, lf.gridSizeZ))
            blk = tuple(int(_static(const(v))) for v in (lf.blockSizeX, lf.blockSizeY, lf.blockSizeZ))
            smem = int(_static(const(lf.dynamicSharedMemorySize))) if lf.dynamicSharedMemorySize else 0
            kname = _kernel_name(op)
            launches.append(KernelLaunch(kname, grid, blk, smem, tuple(kargs),  # type: ignore[arg-type]
                                         kname.rsplit("_", 1)[-1], tuple(access)))
        elif (name in ("arith.constant", "ub.poison", "memref.dealloc", "func.return")
              or name in mapping._VIEW_OPS or mapping.is_size_math(op)):
            continue  # (size math is translated where a launch or an allocation uses it)
        else:
            raise NotImplementedError(f"op left on the host after GPU mapping: {name}")

    used = [temp_list[t] for t in sorted(live)]
    renumber = {t: i for i, t in enumerate(sorted(live))}  # drop allocations no kernel touches
    launches = [replace(k, args=tuple(BufferRef("temp", renumber[a.index])
                                      if isinstance(a, BufferRef) and a.kind == "temp" else a
                                      for a in k.args)) for k in launches]
    spans = [(min(steps), max(steps)) for _, steps in sorted(live.items())]
    if dynamic:
        return CudaProgram(arch=arch, ptx="", launches=launches, temps=used, plan=MemoryPlan({}, 0, 0),
                           args=args, dynamic=True, host_ops=sizes.ops, temp_live=spans)
    uses = [BufferUse(t.name, t.nbytes, first, last) for t, (first, last) in zip(used, spans)]
    return CudaProgram(arch=arch, ptx="", launches=launches, temps=used, plan=plan_memory(uses),
                       args=args)


def _static(x: int | float | Dyn) -> int | float:
    if isinstance(x, Dyn):
        raise NotImplementedError("a launch's block size or shared memory depends on run-time sizes")
    return x


def _scalar_ctype(t: ir.Type) -> str:
    s = str(t)
    if s == "index":
        return "i64"  # index lowers to i64 in kernels
    if s in ("f16", "bf16", "f32", "f64", "i8", "i16", "i32", "i64"):
        return s
    if s == "i1":
        return "i8"
    raise NotImplementedError(f"scalar kernel argument of type {s}")


# --------------------------------------------------------------------------------------------
# stage "llvm"


def lower_stage(stage: GpuStage) -> GpuStage:
    """Lower the kernels to NVVM. The host function is dropped: it is data in `program` now."""
    opts = stage.options
    module = ir.Module.parse(str(stage.module), ir.Context())
    with module.context, ir.Location.unknown():
        for op in list(module.body.operations):
            if op.operation.name == "func.func":
                op.operation.erase()
        if not _kernel_funcs(module):
            return GpuStage(module, stage.program, opts)
        for name, f in _kernel_funcs(module).items():
            _store_i1_as_bytes(f)
            _align_workgroup_buffers(f)
            if name.endswith(("_igemm", "_sgemm")):  # implicit GEMM (contraction.py): given
                # only .maxntid, sm_90's ptxas caps registers near 80 and spills; asking for 1
                # block per SM lifts the cap to 255 (at 2, 128, full-size tiles with a fused
                # epilogue spilled). Occupancy vs. registers is for tuning on the device.
                f.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1)
        mapping.run_passes(
            module,
            f"nvvm-attach-target{{chip={opts.arch} features={opts.ptx_features} O={opts.opt_level}}}, "
            "gpu.module(lower-affine, convert-scf-to-cf, expand-strided-metadata, lower-affine, "
            "convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1}, convert-vector-to-llvm, "
            # math ops libdevice does not cover (trunc, ...) map to LLVM intrinsics NVPTX selects
            "convert-math-to-llvm, canonicalize, cse), "
            "reconcile-unrealized-casts")
    return GpuStage(module, stage.program, opts)


SHARED_ALIGN = 16  # bytes: the mma template stages tiles with 16-byte shared-memory stores


def _align_workgroup_buffers(kernel: ir.Operation) -> None:
    """Static shared-memory buffers are otherwise aligned only to their element type."""
    if "workgroup_attributions" not in kernel.attributes:
        return
    n = ir.IntegerAttr(kernel.attributes["workgroup_attributions"]).value
    if n:
        align = ir.DictAttr.get({"llvm.align": ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                   SHARED_ALIGN)})
        kernel.attributes["workgroup_attrib_attrs"] = ir.ArrayAttr.get([align] * n)


def _store_i1_as_bytes(kernel: ir.Operation) -> None:
    """Kernel buffers of i1 hold one byte per element (torch.bool); the LLVM lowering has no
    i1 memory access. Retype such arguments to i8 and convert at each load and store."""
    from mlir.dialects import arith

    i1, i8 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(8)
    body = kernel.regions[0].blocks[0]
    retyped = []
    for arg in body.arguments:
        if isinstance(arg.type, ir.MemRefType) and ir.MemRefType(arg.type).element_type == i1:
            mt = ir.MemRefType(arg.type)
            arg.set_type(ir.MemRefType.get(mt.shape, i8, mt.layout, mt.memory_space))
            retyped.append(arg)
    if not retyped:
        return
    results = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value).results
    kernel.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in body.arguments], results))
    loads, stores = [], []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "memref.reinterpret_cast" and op.operands[0] in retyped:
            # a run-time-sized view rebuilt from its base pointer (mapping.py): bytes too
            mt = ir.MemRefType(op.results[0].type)
            op.results[0].set_type(ir.MemRefType.get(mt.shape, i8, mt.layout, mt.memory_space))
            retyped.append(op.results[0])
        elif op.name == "memref.load" and op.operands[0] in retyped:
            loads.append(op)
        elif op.name == "memref.store" and op.operands[1] in retyped:
            stores.append(op)
        elif any(v in retyped for v in op.operands) and op.name not in ("memref.load", "memref.store", "memref.dim"):
            raise NotImplementedError(f"i1 buffer used by {op.name} in a kernel")
        return ir.WalkResult.ADVANCE

    kernel.walk(collect, ir.WalkOrder.PRE_ORDER)
    for op in loads:
        res = op.results[0]
        users = [(u.owner, u.operand_number) for u in res.uses]
        res.set_type(i8)
        with ir.InsertionPoint.after(op), op.location:
            narrow = arith.trunci(i1, res)
        for owner, idx in users:
            owner.operands[idx] = narrow
    for op in stores:
        with ir.InsertionPoint(op), op.location:
            op.operands[0] = arith.extui(i8, op.operands[0])


# --------------------------------------------------------------------------------------------
# stage "ptx"


def find_cuda_toolkit() -> str | None:
    """A directory holding nvvm/libdevice/libdevice.10.bc (needed to link math functions):
    $GAC_CUDA_TOOLKIT, $CUDA_HOME, $CUDA_PATH, the nvidia-cuda-nvcc wheel, /usr/local/cuda."""
    candidates = [os.environ.get(k) for k in ("GAC_CUDA_TOOLKIT", "CUDA_HOME", "CUDA_PATH")]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        candidates += [str(Path(p) / "cuda_nvcc") for p in spec.submodule_search_locations]
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "nvvm" / "libdevice" / "libdevice.10.bc").is_file():
            return c
    return None


def ptx_stage(stage: GpuStage) -> CudaProgram:
    program = replace(stage.program)
    if not program.launches:
        program.ptx = ""
        return program
    module = ir.Module.parse(str(stage.module), ir.Context())
    toolkit = find_cuda_toolkit()
    opt = f"format=isa toolkit={toolkit}" if toolkit else "format=isa"
    with module.context:
        mapping.run_passes(module, f"gpu-module-to-binary{{{opt}}}")
        binaries = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
        ptx = gpu.ObjectAttr(binaries[0].attributes["objects"][0]).object.decode()
    if ".extern .func __nv_" in ptx:
        raise RuntimeError("kernels call libdevice math functions but no CUDA toolkit with "
                           "nvvm/libdevice was found: pip install nvidia-cuda-nvcc-cu12 or set "
                           "CUDA_HOME / GAC_CUDA_TOOLKIT")
    program.ptx = ptx
    return program


def compile_linalg(artifact: Any, options: CudaOptions) -> tuple[CudaProgram, dict[str, str]]:
    """All three stages at once; returns the program and each stage's text."""
    g = map_stage(artifact, options)
    llvm = lower_stage(g)
    prog = ptx_stage(llvm)
    return prog, {"gpu": str(g), "llvm": str(llvm), "ptx": prog.ptx}
