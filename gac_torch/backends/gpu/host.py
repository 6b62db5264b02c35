"""The host side after scheduling, read into data: the function's arguments (`arg_spec`), each
kernel's buffer accesses, and the launch list + temporaries + memory plan (`read_host_program`),
with the index math over run-time sizes as HostOps. Also the kernel-side rewrites both GPU
targets need before their LLVM lowering (`store_i1_as_bytes`, `annotate_noalias`)."""

from __future__ import annotations

import math
from dataclasses import replace

from mlir import ir

from gac_torch.errors import GacUnsupportedError
from gac_torch.backends.gpu import i1_bytes, in_place
from gac_torch.backends.gpu.irutil import (
    DYN, VIEW_OPS, block_ops, buffer_root, defining_op, func_block, is_size_math, main_func,
)
from gac_torch.backends.gpu.program import (
    HOST_OPS, ArgSpec, BufferRef, Dyn, GpuProgram, HostOp, KernelArg, KernelLaunch, ScalarArg, TempBuffer,
    TensorMapArg,
)
from gac_torch.passes.memory_plan import BufferUse, MemoryPlan, plan_memory


_ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "i16": 2, "i32": 4,
               "i64": 8}


def arg_spec(t: ir.Type) -> ArgSpec:
    if t == ir.IndexType.get():
        return ArgSpec((), "index")
    mt = ir.MemRefType(t)
    return ArgSpec(tuple(-1 if n == DYN else n for n in mt.shape), str(mt.element_type))


def count_inputs(fn: ir.Operation) -> int:
    """Inputs precede outputs in the ABI; outputs are the materialize_in_destination targets."""
    block = func_block(fn)
    params = list(block.arguments)
    outs = [params.index(op.operands[1]) for op in block_ops(block)
            if op.name == "bufferization.materialize_in_destination" and op.operands[1] in params]
    return min(outs, default=len(params))


def kernel_funcs(module: ir.Module) -> dict[str, ir.Operation]:
    out = {}
    for op in module.body.operations:
        if op.operation.name == "gpu.module":
            for f in op.regions[0].blocks[0].operations:
                if f.operation.name == "gpu.func":
                    out[ir.StringAttr(f.attributes["sym_name"]).value] = f.operation
    return out


def annotate_noalias(module: ir.Module) -> None:
    """Mark kernel pointer arguments `llvm.noalias` when no other argument of the same launch
    views the same allocation: LLVM may then keep accumulators in registers across loops. An
    output that may be written over an input (in_place.py) counts as that input's buffer: no
    noalias, so no read-only (ld.global.nc) loads of a buffer the kernel writes."""
    fn = main_func(module)
    funcs = kernel_funcs(module)
    params = list(func_block(fn).arguments)
    shared = {params[o]: params[i] for i, o in in_place.recorded(fn)}  # (may be one buffer at run time)
    for op in block_ops(func_block(fn)):
        if op.name != "gpu.launch_func":
            continue
        launch = op.opview
        kfunc = funcs[kernel_name(op)]
        operands = list(launch.kernelOperands)
        roots = [buffer_root(v) if isinstance(v.type, ir.MemRefType) else None for v in operands]
        roots = [shared.get(r, r) if r is not None else None for r in roots]
        attrs = []
        for v, r in zip(operands, roots):
            entries = {}
            if r is not None and sum(1 for x in roots if x is not None and x == r) == 1:
                entries["llvm.noalias"] = ir.UnitAttr.get()
            attrs.append(ir.DictAttr.get(entries))
        kfunc.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)


def kernel_name(launch_func: ir.Operation) -> str:
    # `@gac_kernels::@name`: the leaf reference is the kernel's symbol and PTX entry name.
    text = str(launch_func.attributes["kernel"])
    return text.rsplit("::@", 1)[-1].strip('"')


# How kernel-body ops touch memref operands: operand positions read / written.
_READS = {"memref.load": (0,), "vector.load": (0,), "vector.transfer_read": (0,),
          "vector.maskedload": (0,), "nvgpu.ldmatrix": (0,), "memref.copy": (0,)}


_WRITES = {"memref.store": (1,), "vector.store": (1,), "vector.transfer_write": (1,),
           "vector.maskedstore": (0,), "memref.copy": (1,)}


def _kernel_access(kfunc: ir.Operation) -> list[str]:
    """Per kernel parameter: "r" if the body loads from it, "w" if it stores to it (through
    in-kernel views too); any other op using a parameter counts as both. Follows the uses of
    each memref parameter: a kernel body is mostly index math no buffer flows through."""
    acc: list[set[str]] = []
    for param in kfunc.regions[0].blocks[0].arguments:
        acc.append(set())
        if isinstance(param.type, ir.MemRefType):
            _uses_of_buffer(param, acc[-1])
        elif _is_tensor_map(param):
            _uses_of_tensor_map(param, acc[-1])
    return [("r" if "r" in a else "") + ("w" if "w" in a else "") for a in acc]


def _uses_of_tensor_map(v: ir.Value, acc: set[str]) -> None:
    """A TMA descriptor reads its buffer (a load into shared memory), or writes it where an
    inline asm using it copies shared memory to global (a bulk tensor store); through casts."""
    for use in v.uses:
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name == "llvm.inline_asm":
            acc.add("w" if "global.shared::cta" in str(op.attributes["asm_string"]) else "r")
        elif op.name == "builtin.unrealized_conversion_cast":
            for res in op.results:
                _uses_of_tensor_map(res, acc)
    if not acc:
        acc.add("r")


def _uses_of_buffer(v: ir.Value, acc: set[str]) -> None:
    """Add "r" / "w" to `acc` for each use of memref `v` and of the views of it (buffer_root's
    chains: a view op's operand 0); views and memref.dim move no data."""
    for use in v.uses:
        if len(acc) == 2:  # (read and written: nothing more to learn)
            return
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        pos = use.operand_number
        if op.name in VIEW_OPS or op.name == "memref.dim":  # metadata, no data
            if op.name in VIEW_OPS and pos == 0:
                for res in op.results:
                    if isinstance(res.type, ir.MemRefType):
                        _uses_of_buffer(res, acc)
            continue
        r, w = pos in _READS.get(op.name, ()), pos in _WRITES.get(op.name, ())
        if op.name == "memref.extract_aligned_pointer_as_index":  # an address for inline asm
            _uses_of_pointer(op.results[0], acc)
            continue
        if op.name == "nvgpu.device_async_copy":  # (dst, dst indices..., src, ...)
            r, w = pos > 0, pos == 0
        if not r and not w:
            r = w = True  # unknown: assume both
        if r:
            acc.add("r")
        if w:
            acc.add("w")


def _uses_of_pointer(v: ir.Value, acc: set[str], depth: int = 0) -> None:
    """A buffer's address (row's cache-hinted accesses): "r" for an inline asm `ld.`, "w" for
    an `st.`, through the address arithmetic; any other use (or none): both."""
    uses = list(v.uses)
    if not uses:
        acc.update("rw")
    for use in uses:
        op = use.owner.operation if hasattr(use.owner, "operation") else use.owner
        if op.name == "llvm.inline_asm":
            text = str(op.attributes["asm_string"]).strip('"')
            acc.update("r" if text.startswith("ld.") else "w" if text.startswith("st.") else "rw")
        elif depth < 8 and (op.name.startswith("arith.") or op.name == "llvm.inttoptr"):
            for res in op.results:
                _uses_of_pointer(res, acc, depth + 1)
        else:
            acc.update("rw")


def _whole(v: ir.Value) -> bool:
    """`v` covers its whole allocation: only reshaping views, no subviews or offsets."""
    root = buffer_root(v)
    if v == root:
        return True
    t, rt = ir.MemRefType(v.type), ir.MemRefType(root.type)
    op = defining_op(v)
    while op is not None and op.name in VIEW_OPS:
        if op.name not in ("memref.expand_shape", "memref.collapse_shape", "memref.cast"):
            return False
        op = defining_op(op.operands[0])
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
        op = defining_op(v)
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
        if t.shape[dim] != DYN:
            return t.shape[dim]
        op = defining_op(buf)
        if op is None and buf in self.args:
            return self._emit("dim", (self.args[buf], dim))
        if op is not None and op.name in ("memref.alloc", "memref.reinterpret_cast"):
            dynamic_sizes = list(op.operands) if op.name == "memref.alloc" else list(op.opview.sizes)
            return self.ref(dynamic_sizes[sum(1 for n in t.shape[:dim] if n == DYN)])
        raise GacUnsupportedError(f"run-time size of a buffer defined by {op.name if op else 'a block argument'}")

    def _translate(self, v: ir.Value, op: ir.Operation | None) -> Dyn:
        if op is None:
            if v in self.args and v.type == ir.IndexType.get():
                return self._emit("size", (self.args[v],))
            raise GacUnsupportedError(f"host index value from an unknown block argument: {v}")
        name = op.name
        if name == "memref.dim":
            return self.ref_of(self.size(op.operands[0], int(self.value(op.operands[1]))))
        if name == "memref.extract_strided_metadata":
            # of a function argument or an allocation (expand-strided-metadata folded every
            # view into these): dense row-major at offset 0
            src = op.operands[0]
            root = defining_op(src)
            if not (src in self.args or root is not None and root.name == "memref.alloc"):
                raise GacUnsupportedError(f"run-time metadata of a view made by {root.name if root else src}")
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
        if name.startswith("arith.") and short in HOST_OPS and is_size_math(op):
            refs = tuple(self.ref(x).ref for x in op.operands)
            if short == "cmpi":
                names = ["eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge"]
                return self._emit("cmpi", refs, names[ir.IntegerAttr(op.attributes["predicate"]).value])
            ty = str(v.type)
            return self._emit(short, refs, type="i1" if ty == "i1" else ty)
        raise GacUnsupportedError(f"host index value computed by {name}")

    def ref_of(self, x: int | Dyn) -> Dyn:
        return x if isinstance(x, Dyn) else self.const(x)

    def _mul(self, a: int | Dyn, b: int | Dyn) -> int | Dyn:
        if isinstance(a, int) and isinstance(b, int):
            return a * b
        return self._emit("muli", (self.ref_of(a).ref, self.ref_of(b).ref))

    def nbytes(self, alloc: ir.Operation) -> int | Dyn:
        t = ir.MemRefType(alloc.results[0].type)
        n: int | Dyn = _ELEM_BYTES[str(t.element_type)]
        for d in range(t.rank):
            n = self._mul(n, self.size(alloc.results[0], d))
        return n


def read_host_program(module: ir.Module, args: list[ArgSpec], arch: str,
                       dynamic: bool = False) -> GpuProgram:
    """Turn the host function (constants, allocs, views, launch_funcs, and the index math over
    run-time sizes) into data."""
    fn = main_func(module)
    block = func_block(fn)
    funcs = kernel_funcs(module)
    arg_index = {a: i for i, a in enumerate(block.arguments)}
    temps: dict[ir.Value, int] = {}
    temp_list: list[TempBuffer] = []
    live: dict[int, list[int]] = {}
    launches: list[KernelLaunch] = []
    sizes = _SizeMath(block)

    def const(v: ir.Value) -> int | float | Dyn:
        x = sizes.value(v)
        if isinstance(x, Dyn) and not dynamic:
            raise GacUnsupportedError(f"kernel argument is not a constant: {v}")
        return x

    for op in block_ops(block):
        name = op.name
        if name == "memref.alloc":
            temps[op.results[0]] = len(temp_list)
            temp_list.append(TempBuffer(f"t{len(temp_list)}", sizes.nbytes(op)))
        elif name == "gpu.launch_func":
            lf = op.opview
            kargs: list[KernelArg] = []
            body_access = _kernel_access(funcs[kernel_name(op)])
            access: list[str] = []
            for v, m in zip(lf.kernelOperands, body_access):
                if (isinstance(v.type, ir.MemRefType) and "w" in m and _whole(v)
                        and not kernel_name(op).endswith("_serial")):
                    # a kernel mapped from a linalg op writes each element of its output; a
                    # serial kernel (host scalar code) may store single elements
                    m = m.replace("w", "W")
                access.append(m if isinstance(v.type, ir.MemRefType) or _is_tensor_map(v) else "")

            def buffer_ref(v: ir.Value) -> BufferRef:
                root = buffer_root(v)
                if root in arg_index:
                    return BufferRef("arg", arg_index[root])
                if root in temps:
                    live.setdefault(temps[root], []).append(len(launches))
                    return BufferRef("temp", temps[root])
                raise GacUnsupportedError(f"kernel argument views an unsupported buffer: {root}")

            for v in lf.kernelOperands:
                if isinstance(v.type, ir.MemRefType):
                    kargs.append(buffer_ref(v))
                elif _is_tensor_map(v):
                    kargs.append(_tensor_map(v, buffer_ref, const))
                else:
                    kargs.append(ScalarArg(_scalar_ctype(v.type), const(v)))
            grid = tuple(x if isinstance(x := const(v), Dyn) else int(x)
                         for v in (lf.gridSizeX, lf.gridSizeY, lf.gridSizeZ))
            blk = tuple(int(_static(const(v))) for v in (lf.blockSizeX, lf.blockSizeY, lf.blockSizeZ))
            smem = int(_static(const(lf.dynamicSharedMemorySize))) if lf.dynamicSharedMemorySize else 0
            kname = kernel_name(op)
            launches.append(KernelLaunch(kname, grid, blk, smem, tuple(kargs),  # type: ignore[arg-type]
                                         kname.rsplit("_", 1)[-1], tuple(access)))
        elif (name in ("arith.constant", "ub.poison", "memref.dealloc", "func.return", TMA_CREATE)
              or name in VIEW_OPS or is_size_math(op)):
            continue  # (size math is translated where a launch or an allocation uses it)
        else:
            raise GacUnsupportedError(f"op left on the host after GPU mapping: {name}")

    used = [temp_list[t] for t in sorted(live)]
    renumber = {t: i for i, t in enumerate(sorted(live))}  # drop allocations no kernel touches

    def renumbered(a: KernelArg) -> KernelArg:
        if isinstance(a, TensorMapArg) and a.buffer.kind == "temp":
            return replace(a, buffer=BufferRef("temp", renumber[a.buffer.index]))
        return BufferRef("temp", renumber[a.index]) if isinstance(a, BufferRef) and a.kind == "temp" else a

    launches = [replace(k, args=tuple(renumbered(a) for a in k.args)) for k in launches]
    spans = [(min(steps), max(steps)) for _, steps in sorted(live.items())]
    if dynamic:
        return GpuProgram(arch=arch, ptx="", launches=launches, temps=used, plan=MemoryPlan({}, 0, 0),
                           args=args, dynamic=True, host_ops=sizes.ops, temp_live=spans,
                           in_place=in_place.recorded(fn))
    uses = [BufferUse(t.name, t.nbytes, first, last) for t, (first, last) in zip(used, spans)]
    return GpuProgram(arch=arch, ptx="", launches=launches, temps=used, plan=plan_memory(uses),
                       args=args, in_place=in_place.recorded(fn))


TMA_CREATE = "nvgpu.tma.create.descriptor"  # a TMA descriptor, made by the runtime (data here)
_SWIZZLE = {"swizzle_none": 0, "swizzle_32b": 32, "swizzle_64b": 64, "swizzle_128b": 128}


def _is_tensor_map(v: ir.Value) -> bool:
    return str(v.type).startswith("!nvgpu.tensormap.descriptor")


def _tensor_map(v: ir.Value, buffer_ref, const) -> TensorMapArg:
    """A launch operand made by nvgpu.tma.create.descriptor (on a memref.cast of a static
    buffer view to unranked): the descriptor's fields as data."""
    op = defining_op(v)
    if op is None or op.name != TMA_CREATE:
        raise GacUnsupportedError(f"tensor map not made by {TMA_CREATE}: {v}")
    cast = defining_op(op.operands[0])
    if cast is None or cast.name != "memref.cast":
        raise GacUnsupportedError("a TMA descriptor's source must be a memref.cast of a buffer view")
    src = cast.operands[0]
    mt = ir.MemRefType(src.type)
    strides, offset = mt.get_strides_and_offset()
    if any(n == DYN for n in mt.shape) or offset < 0 or strides[-1] != 1:
        raise GacUnsupportedError("a TMA descriptor needs a static, innermost-contiguous view")
    es = _ELEM_BYTES[str(mt.element_type)]
    box = tuple(int(_static(const(x))) for x in op.operands[1:])
    swizzle = next((n for k, n in _SWIZZLE.items() if f"swizzle = {k}" in str(v.type)), 0)
    return TensorMapArg(buffer_ref(src), str(mt.element_type), tuple(mt.shape[::-1]),
                        tuple(s * es for s in strides[::-1][1:]), offset, box[::-1], swizzle)


def _static(x: int | float | Dyn) -> int | float:
    if isinstance(x, Dyn):
        raise GacUnsupportedError("a launch's block size or shared memory depends on run-time sizes")
    return x


def _scalar_ctype(t: ir.Type) -> str:
    s = str(t)
    if s == "index":
        return "i64"  # index lowers to i64 in kernels
    if s in ("f16", "bf16", "f32", "f64", "i8", "i16", "i32", "i64"):
        return s
    if s == "i1":
        return "i8"
    raise GacUnsupportedError(f"scalar kernel argument of type {s}")


def store_i1_as_bytes(kernel: ir.Operation) -> None:
    """Kernel buffers of i1 hold one byte per element (torch.bool): i1_bytes.py."""
    try:
        i1_bytes.store_i1_as_bytes(kernel)
    except i1_bytes.I1Unsupported as e:
        raise GacUnsupportedError(str(e)) from e
