"""gpu.module kernels -> plain `func.func`s that call Vortex's device helpers.

The toolchain (README: "Handing over kernels") takes external `void` functions whose parameters
are pointers and scalars and which `declare` helpers such as `@vx_thread_id_x`. So each
`gpu.func` of `@gac_kernels` becomes a `func.func` in a fresh riscv32 module:

- gpu.thread_id / block_id / block_dim / grid_dim  -> `vx_<op>_<dim>()` (i32 -> index)
- gpu.barrier                                      -> `vx_syncthreads()`
- gpu.shuffle (32-bit values, constant width)      -> `vx_shfl_{up,down,bfly,idx}` with
  clamp = width - 1 (lanes past the width keep their value, `valid` says which)
- workgroup attributions                           -> views of `vx_local_mem()` at fixed
  offsets (one CTA's local memory; the launch asks for their total as `lmem_size`)
- i1 buffers                                       -> i8 (torch.bool storage; cuda pipeline helper)
- memref arguments keep their static shapes: with the bare-pointer calling convention each
  becomes one `ptr` parameter (KernelSpec kind "ptr"), a view's offset compiled in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import arith, func

from gac_torch.backends.gpu.host import store_i1_as_bytes
from gac_torch.backends.gpu.irutil import clone_into
from gac_torch.backends.vortex import target as vt

_GPU_ID_OPS = {"gpu.thread_id": "thread_id", "gpu.block_id": "block_id",
               "gpu.block_dim": "block_dim", "gpu.grid_dim": "grid_dim"}
_ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8}
_PARAM_KIND = {"index": "i32", "i32": "i32", "f32": "f32", "i64": "i64"}


@dataclass(frozen=True)
class KernelAbi:
    """How the host calls one kernel: parameter kinds (target.ARG_KINDS) and local memory."""

    name: str
    params: tuple[str, ...]
    lmem_size: int


def riscv_module(ctx: ir.Context) -> ir.Module:
    with ctx, ir.Location.unknown():
        m = ir.Module.create()
        m.operation.attributes["llvm.target_triple"] = ir.StringAttr.get(vt.TRIPLE)
        m.operation.attributes["llvm.data_layout"] = ir.StringAttr.get(vt.DATA_LAYOUT)
    return m


def kernels_to_funcs(module: ir.Module) -> tuple[ir.Module, list[KernelAbi]]:
    """The gpu.module's kernels (and globals) as func.funcs in a new riscv32 module (same context)."""
    out = riscv_module(module.context)
    abis: list[KernelAbi] = []
    helpers: set[str] = set()
    with module.context, ir.Location.unknown():
        for top in list(module.body.operations):
            if top.operation.name != "gpu.module":
                continue
            for op in list(top.regions[0].blocks[0].operations):
                if op.operation.name == "gpu.func":
                    abis.append(_convert(op.operation, out, helpers))
                else:                                   # memref.global constants
                    out.body.append(op.operation)
        # declarations only: the toolchain substitutes each helper's inline-asm definition
        with ir.InsertionPoint.at_block_begin(out.body):
            types = {"i32": ir.IntegerType.get_signless(32), "ptr": ir.Type.parse("!llvm.ptr")}
            for name in sorted(helpers):
                h = vt.HELPERS[name]
                res = [] if h.ret == "void" else [types[h.ret]]
                func.FuncOp(name, ir.FunctionType.get([types[p] for p in h.params], res),
                            visibility="private")
    return out, abis


def _convert(g: ir.Operation, out: ir.Module, helpers: set[str]) -> KernelAbi:
    name = ir.StringAttr(g.attributes["sym_name"]).value
    store_i1_as_bytes(g)
    n_wg = ir.IntegerAttr(g.attributes["workgroup_attributions"]).value \
        if "workgroup_attributions" in g.attributes else 0
    entry = g.regions[0].blocks[0]
    n_args = len(entry.arguments) - n_wg
    arg_types = [a.type for a in list(entry.arguments)[:n_args]]
    params = tuple(_param_kind(t) for t in arg_types)
    with ir.InsertionPoint(out.body):
        f = func.FuncOp(name, ir.FunctionType.get(arg_types, []))
    if "arg_attrs" in g.attributes:
        f.attributes["arg_attrs"] = g.attributes["arg_attrs"]
    entry.append_to(f.regions[0])
    wg_types = [ir.MemRefType(a.type) for a in list(entry.arguments)[n_args:]]
    offsets, lmem = _lmem_layout([math.prod(t.shape) * _ELEM_BYTES[str(t.element_type)] for t in wg_types])
    if wg_types:
        with ir.InsertionPoint.at_block_begin(entry):
            helpers.add("vx_local_mem")
            base = func.CallOp([ir.Type.parse("!llvm.ptr")], "vx_local_mem", []).result
            for k, (t, off) in enumerate(zip(wg_types, offsets)):
                entry.arguments[n_args + k].replace_all_uses_with(_lmem_view(base, off, t))
        for k in reversed(range(len(wg_types))):
            entry.erase_argument(n_args + k)
    _replace_gpu_ops(f.operation, helpers)
    g.erase()
    return KernelAbi(name, params, lmem)


def _param_kind(t: ir.Type) -> str:
    if isinstance(t, ir.MemRefType):
        return "ptr"
    kind = _PARAM_KIND.get(str(t))
    if kind is None:
        raise NotImplementedError(f"vortex: scalar kernel parameter of type {t}")
    return kind


def _lmem_layout(sizes: list[int], align: int = 16) -> tuple[list[int], int]:
    """Offsets of the workgroup buffers in one CTA's local memory, and the total."""
    offs, off = [], 0
    for s in sizes:
        off = -(-off // align) * align
        offs.append(off)
        off += s
    return offs, -(-off // align) * align


def _lmem_view(base: ir.Value, offset: int, t: ir.MemRefType) -> ir.Value:
    """A memref (identity layout, no address space) over local memory at base + offset, built
    as the LLVM descriptor it lowers to; reconcile-unrealized-casts removes the cast."""
    plain = ir.MemRefType.get(t.shape, t.element_type)
    rank = len(t.shape)
    strides = [math.prod(t.shape[i + 1:]) for i in range(rank)]
    arr = f", array<{rank} x i32>, array<{rank} x i32>" if rank else ""
    desc = f"!llvm.struct<(ptr, ptr, i32{arr})>"
    lines = [f"%off = llvm.mlir.constant({offset} : i32) : i32",
             "%p = llvm.getelementptr %base[%off] : (!llvm.ptr, i32) -> !llvm.ptr, i8",
             f"%d0 = llvm.mlir.poison : {desc}",
             f"%d1 = llvm.insertvalue %p, %d0[0] : {desc}",
             f"%d2 = llvm.insertvalue %p, %d1[1] : {desc}",
             "%zero = llvm.mlir.constant(0 : i32) : i32",
             f"%d3 = llvm.insertvalue %zero, %d2[2] : {desc}"]
    last = "%d3"
    for pos, vals in ((3, t.shape), (4, strides)):
        for i, v in enumerate(vals):
            lines += [f"%v{pos}_{i} = llvm.mlir.constant({v} : i32) : i32",
                      f"%d{pos}_{i} = llvm.insertvalue %v{pos}_{i}, {last}[{pos}, {i}] : {desc}"]
            last = f"%d{pos}_{i}"
    lines.append(f"%m = builtin.unrealized_conversion_cast {last} : {desc} to {plain}")
    text = (f"func.func @view(%base: !llvm.ptr) -> {plain} {{\n" + "\n".join(lines)
            + f"\nreturn %m : {plain}\n}}")
    tmpl = ir.Module.parse(text, base.context)
    body = tmpl.body.operations[0].regions[0].blocks[0]
    mapping: dict[ir.Value, ir.Value] = {body.arguments[0]: base}
    clone_into([op.operation for op in body.operations][:-1], mapping)
    return mapping[[op for op in body.operations][-1].operands[0]]


def _replace_gpu_ops(f: ir.Operation, helpers: set[str]) -> None:
    found: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name.startswith("gpu."):
            found.append(op)
        return ir.WalkResult.ADVANCE

    f.walk(collect, ir.WalkOrder.PRE_ORDER)
    i32 = ir.IntegerType.get_signless(32)
    for op in found:
        with ir.InsertionPoint(op), op.location:
            if op.name in _GPU_ID_OPS:
                dim = str(op.attributes["dimension"]).removeprefix("#gpu<dim ").strip(">")
                helper = f"vx_{_GPU_ID_OPS[op.name]}_{dim}"
                helpers.add(helper)
                v = func.CallOp([i32], helper, []).result
                op.results[0].replace_all_uses_with(arith.index_castui(ir.IndexType.get(), v))
            elif op.name == "gpu.barrier":
                helpers.add("vx_syncthreads")
                func.CallOp([], "vx_syncthreads", [])
            elif op.name == "gpu.shuffle":
                _shuffle(op, helpers)
            elif op.name == "gpu.return":
                func.ReturnOp([])
            else:
                raise NotImplementedError(f"vortex: no lowering for {op.name} in a kernel")
        op.erase()


_SHFL = {"xor": "bfly", "up": "up", "down": "down", "idx": "idx"}


def _shuffle(op: ir.Operation, helpers: set[str]) -> None:
    """gpu.shuffle -> vx_shfl_* on the value's bits. The control word is (mask << 12) |
    (clamp << 6) | offset (sim/simx/alu_unit.cpp): mask 0, clamp width - 1 (one segment)."""
    i32 = ir.IntegerType.get_signless(32)
    value, offset, width = op.operands
    mode = str(op.attributes["mode"]).removeprefix("#gpu<shuffle_mode ").strip(">")
    w = _const_int(width)
    if w is None or value.type not in (i32, ir.F32Type.get()):
        raise NotImplementedError(f"vortex: gpu.shuffle of {value.type} with a run-time width")
    helper = f"vx_shfl_{_SHFL[mode]}"
    helpers.add(helper)
    bits = value if value.type == i32 else arith.bitcast(i32, value)
    off = offset if offset.type == i32 else arith.index_cast(i32, offset)
    ctl = arith.ori(off, arith.constant(i32, (w - 1) << 6))
    got = func.CallOp([i32], helper, [bits, ctl]).result
    op.results[0].replace_all_uses_with(got if value.type == i32 else arith.bitcast(value.type, got))
    if mode == "xor":          # valid: the source lane is inside the width
        lane = arith.xori(func.CallOp([i32], "vx_thread_id", []).result, off)
        helpers.add("vx_thread_id")
        valid = arith.cmpi(arith.CmpIPredicate.ult, lane, arith.constant(i32, w))
    else:
        valid = arith.constant(ir.IntegerType.get_signless(1), 1) if not list(op.results[1].uses) else None
        if valid is None:
            raise NotImplementedError(f"vortex: gpu.shuffle {mode} whose `valid` is used")
    op.results[1].replace_all_uses_with(valid)


def _const_int(v: ir.Value) -> int | None:
    o = v.owner
    if isinstance(o, ir.Block) or o.name != "arith.constant":
        return None
    return ir.IntegerAttr(o.attributes["value"]).value
