"""Number formats the device has no instructions for, made branch-free (or lane-serial).

Stock LLVM lowers them to compiler_rt calls that branch on the data (SimX would follow the last
active thread): f16 <-> f32 conversions (`__extendhfsf2`, `__truncsfhf2`), bf16 truncation
(`__truncsfbf2`, not even in our compiler_rt), 64-bit division (`__divdi3`, ...) and all
double-precision arithmetic (`__adddf3`, ...: the device has no D extension). So, before the
LLVM lowering:

- arithmetic on f16/bf16 is done in f32 (`arith-emulate-unsupported-floats`), leaving only
  extf/truncf; bf16 ones become integer ops (`arith-expand{include-bf16}`), f16 ones are
  expanded here: extension by rescaling the shifted bits (denormals included), truncation
  with round-to-nearest-even (F. Giesen's float_to_half_fast3_rtne), every case a select;
- i64 <-> f32 conversions (`__floatdisf`, `__fixsfdi`) use 32-bit conversions: exact while
  the value fits in i32; beyond, i64 -> f32 may round twice (1 ulp);
- a float turned into an i64 that only becomes a memory index (grid_sample's corners:
  fptosi, add/sub/mul/select/compare with small constants, index_cast) is computed in i32
  (`narrow_index_chains`): the index is 32-bit on this target, add/sub/mul/select commute with
  the truncation, and a compare differs only for values whose index is out of bounds anyway;
- i64 divisions and all f64 arithmetic, comparisons and conversions call
  `gac_serial_<compiler_rt name>` (simt_ir.SERIAL_RT): compiler_rt one lane at a time.
  Correct, ~T times slower; f64 appears in scalar bookkeeping, not in hot loops.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, func

PASSES = ("func.func(arith-emulate-unsupported-floats{source-types=f16,bf16 target-type=f32}), "
          "func.func(arith-expand{include-bf16=true})")
_I64_DIVISIONS = {"arith.divsi": "__divdi3", "arith.remsi": "__moddi3",
                  "arith.divui": "__udivdi3", "arith.remui": "__umoddi3"}
_CONVERSIONS = ("arith.sitofp", "arith.uitofp", "arith.fptosi", "arith.fptoui")


def _c(t: ir.Type, v: int) -> ir.Value:
    return arith.constant(t, v)


def _select(c: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.select(c, a, b)


def _ult(a: ir.Value, b: ir.Value) -> ir.Value:
    return arith.cmpi(arith.CmpIPredicate.ult, a, b)


def f16_to_f32(h: ir.Value) -> ir.Value:
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    x = arith.extui(i32, arith.bitcast(ir.IntegerType.get_signless(16), h))
    sign = arith.shli(arith.andi(x, _c(i32, 0x8000)), _c(i32, 16))
    em = arith.andi(x, _c(i32, 0x7FFF))
    shifted = arith.shli(em, _c(i32, 13))
    # exponent 15 -> 127: scale by 2^112 (exact; half denormals become f32 normals)
    finite = arith.bitcast(i32, arith.mulf(arith.bitcast(f32, shifted), arith.constant(f32, 2.0**112)))
    special = arith.ori(shifted, _c(i32, 0x7F800000))             # inf / nan payload
    bits = _select(_ult(em, _c(i32, 0x7C00)), finite, special)
    return arith.bitcast(f32, arith.ori(bits, sign))


def f32_to_f16(x: ir.Value) -> ir.Value:
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    f = arith.bitcast(i32, x)
    sign = arith.andi(f, _c(i32, 0x80000000 - (1 << 32)))
    a = arith.xori(f, sign)                                        # |x| bits
    inf_or_nan = _select(arith.cmpi(arith.CmpIPredicate.ugt, a, _c(i32, 255 << 23)),
                         _c(i32, 0x7E00), _c(i32, 0x7C00))
    magic = _c(i32, ((127 - 15) + (23 - 10) + 1) << 23)            # denormal: let the FPU round
    sub = arith.subi(arith.bitcast(i32, arith.addf(arith.bitcast(f32, a), arith.bitcast(f32, magic))), magic)
    odd = arith.andi(arith.shrui(a, _c(i32, 13)), _c(i32, 1))      # normal: round half to even
    norm = arith.shrui(arith.addi(arith.addi(a, _c(i32, ((15 - 127) << 23) + 0xFFF)), odd), _c(i32, 13))
    o = _select(_ult(a, _c(i32, 113 << 23)), sub, norm)
    o = _select(_ult(a, _c(i32, (127 + 16) << 23)), o, inf_or_nan)
    o = arith.ori(o, arith.shrui(sign, _c(i32, 16)))
    return arith.bitcast(ir.F16Type.get(), arith.trunci(ir.IntegerType.get_signless(16), o))


def i64_to_f32(x: ir.Value, signed: bool) -> ir.Value:
    i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
    lo = arith.trunci(i32, x)
    hi = arith.trunci(i32, (arith.shrsi if signed else arith.shrui)(x, _c(i64, 32)))
    wide = arith.addf(arith.mulf((arith.sitofp if signed else arith.uitofp)(f32, hi),
                                 arith.constant(f32, 2.0**32)), arith.uitofp(f32, lo))
    fits = arith.cmpi(arith.CmpIPredicate.eq, (arith.extsi if signed else arith.extui)(i64, lo), x)
    return _select(fits, (arith.sitofp if signed else arith.uitofp)(f32, lo), wide)


def f32_to_i64(x: ir.Value, signed: bool) -> ir.Value:
    i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
    narrow = (arith.extsi(i64, arith.fptosi(i32, x)) if signed else arith.extui(i64, arith.fptoui(i32, x)))
    limit = 2.0**31 if signed else 2.0**32
    small = arith.cmpf(arith.CmpFPredicate.OLT, _fabs(x) if signed else x, arith.constant(f32, limit))
    # |x| >= 2^31 is an integer: x = hi * 2^32 + lo with lo in [0, 2^32), both exact
    q = arith.mulf(x, arith.constant(f32, 2.0**-32))
    qt = arith.sitofp(f32, arith.fptosi(i32, q))
    hi_f = _select(arith.cmpf(arith.CmpFPredicate.OGT, qt, q), arith.subf(qt, arith.constant(f32, 1.0)), qt)
    lo = arith.fptoui(i32, arith.subf(x, arith.mulf(hi_f, arith.constant(f32, 2.0**32))))
    wide = arith.ori(arith.shli(arith.extsi(i64, arith.fptosi(i32, hi_f)), _c(i64, 32)), arith.extui(i64, lo))
    return _select(small, narrow, wide)


def _fabs(x: ir.Value) -> ir.Value:
    from mlir.dialects import math as mmath
    return mmath.absf(x)


_F64_BINARY = {"arith.addf": "__adddf3", "arith.subf": "__subdf3", "arith.mulf": "__muldf3",
               "arith.divf": "__divdf3"}
# arith.cmpf predicate (enum value) -> (compiler_rt comparison, integer test of its result vs 0)
_F64_CMP = {1: ("__eqdf2", "eq"), 2: ("__gtdf2", "sgt"), 3: ("__gedf2", "sge"), 4: ("__ltdf2", "slt"),
            5: ("__ledf2", "sle"), 7: ("__unorddf2", "eq"), 9: ("__ledf2", "sgt"),
            10: ("__ltdf2", "sge"), 11: ("__gedf2", "slt"), 12: ("__gtdf2", "sle"),
            13: ("__nedf2", "ne"), 14: ("__unorddf2", "ne")}
_C_TYPES = {"double": "f64", "float": "f32", "int": "i32", "unsigned": "i32", "long long": "i64",
            "unsigned long long": "i64"}


class _Runtime:
    """Calls of lane-serialised compiler_rt routines, declared once per module."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def call(self, fn: str, *args: ir.Value) -> ir.Value:
        from gac_torch.backends.vortex.simt_ir import SERIAL_RT

        ret, _ = SERIAL_RT[fn]
        self.used.add(fn)
        return func.CallOp([ir.Type.parse(_C_TYPES[ret])], f"gac_serial_{fn}", list(args)).result

    def declare(self, module: ir.Module) -> None:
        from gac_torch.backends.vortex.simt_ir import SERIAL_RT

        with ir.InsertionPoint.at_block_begin(module.body):
            for fn in sorted(self.used):
                ret, params = SERIAL_RT[fn]
                ftype = ir.FunctionType.get([ir.Type.parse(_C_TYPES[p]) for p in params],
                                            [ir.Type.parse(_C_TYPES[ret])])
                func.FuncOp(f"gac_serial_{fn}", ftype, visibility="private")


def _walk(module: ir.Module, names: tuple[str, ...]) -> list[ir.Operation]:
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in names:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _op(o: ir.Operation | ir.OpView) -> ir.Operation:
    return o.operation if isinstance(o, ir.OpView) else o


_NARROW_OPS = ("arith.addi", "arith.subi", "arith.muli", "arith.select", "arith.cmpi")


def _i64_slice(root: ir.Value) -> list[ir.Operation] | None:
    """The ops an fptosi's i64 result flows through to index_casts (see the module doc), in
    program order, or None if it goes anywhere else or meets an i64 that is not a small
    constant or from the slice."""
    i64 = ir.IntegerType.get_signless(64)
    inside, ops, work = {root}, [], [root]

    def small_const(v: ir.Value) -> bool:
        o = v.owner
        return (not isinstance(o, ir.Block) and o.name == "arith.constant"
                and abs(ir.IntegerAttr(o.attributes["value"]).value) < 2**31)

    while work:
        for use in list(work.pop().uses):
            user = _op(use.owner)
            if user.name == "arith.index_cast" and isinstance(user.results[0].type, ir.IndexType):
                continue
            if user.name not in _NARROW_OPS:
                return None
            if user not in ops:
                ops.append(user)
                if user.results[0].type == i64:
                    inside.add(user.results[0])
                    work.append(user.results[0])
    for o in ops:
        if any(v.type == i64 and v not in inside and not small_const(v) for v in o.operands):
            return None
        if o.name == "arith.cmpi" and any(   # a condition only for selects of the slice
                _op(u.owner).name != "arith.select" or u.operand_number != 0 or _op(u.owner) not in ops
                for u in o.results[0].uses):
            return None
    if not all(o.block == ops[0].block for o in ops):
        return None
    order = [x.operation for x in ops[0].block.operations]   # program order (one block)
    return sorted(ops, key=lambda o: next(i for i, x in enumerate(order) if x == o))


def narrow_index_chains(module: ir.Module) -> int:
    """fptosi f32 -> i64 chains that end in index_casts, computed in i32 (module doc)."""
    f32, i32, i64 = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    count = 0
    for op in _walk(module, ("arith.fptosi",)):
        if op.operands[0].type != f32 or op.results[0].type != i64:
            continue
        ops = _i64_slice(op.results[0])
        if ops is None:
            continue
        with ir.InsertionPoint(op), op.location:
            new: dict = {op.results[0]: arith.fptosi(i32, op.operands[0])}

        def get(v: ir.Value) -> ir.Value:
            if v in new:
                return new[v]
            if v.type != i64:
                return v
            return arith.constant(i32, ir.IntegerAttr(v.owner.attributes["value"]).value)

        for o in ops:
            with ir.InsertionPoint(o), o.location:
                a = [get(v) for v in o.operands]
                if o.name == "arith.select":
                    r = arith.select(*a)
                elif o.name == "arith.cmpi":
                    r = arith.cmpi(ir.IntegerAttr(o.attributes["predicate"]).value, *a)
                else:
                    r = {"arith.addi": arith.addi, "arith.subi": arith.subi, "arith.muli": arith.muli}[o.name](*a)
            new[o.results[0]] = r
        for v, r in list(new.items()):
            for use in list(v.uses):
                if _op(use.owner).name == "arith.index_cast":
                    _op(use.owner).operands[0] = r
        for o in reversed(ops):
            o.erase()
        op.erase()
        count += 1
    return count


def _width(t: ir.Type) -> int:
    return ir.IntegerType(t).width


def _f64_op(op: ir.Operation, rt: _Runtime) -> ir.Value | None:
    """The serialised replacement of an f64 op, or None if `op` does not involve f64."""
    f32, f64, i32 = ir.F32Type.get(), ir.F64Type.get(), ir.IntegerType.get_signless(32)
    name, src, dst = op.name, op.operands[0].type, op.results[0].type
    if name in _F64_BINARY and dst == f64:
        return rt.call(_F64_BINARY[name], *op.operands)
    if name == "arith.cmpf" and src == f64:
        pred = ir.IntegerAttr(op.attributes["predicate"]).value
        if pred in (6, 8):                           # one = ord & une, ueq = uno | oeq
            a, b = (_f64_cmp(p, op.operands, rt) for p in ((7, 13) if pred == 6 else (14, 1)))
            return arith.andi(a, b) if pred == 6 else arith.ori(a, b)
        if pred in (0, 15):
            return arith.constant(ir.IntegerType.get_signless(1), int(pred == 15))
        return _f64_cmp(pred, op.operands, rt)
    if name == "arith.extf" and dst == f64:
        return rt.call("__extendsfdf2", op.operands[0] if src == f32 else arith.extf(f32, op.operands[0]))
    if name == "arith.truncf" and src == f64:
        narrow = rt.call("__truncdfsf2", op.operands[0])
        return narrow if dst == f32 else arith.truncf(dst, narrow)
    if name in ("arith.sitofp", "arith.uitofp") and dst == f64:
        signed, x = name == "arith.sitofp", op.operands[0]
        if _width(src) < 32:
            x = arith.extsi(i32, x) if signed else arith.extui(i32, x)
        wide = _width(src) > 32
        fn = {(True, False): "__floatsidf", (False, False): "__floatunsidf",
              (True, True): "__floatdidf", (False, True): "__floatundidf"}[(signed, wide)]
        return rt.call(fn, x)
    if name in ("arith.fptosi", "arith.fptoui") and src == f64:
        signed, wide = name == "arith.fptosi", _width(dst) > 32
        fn = {(True, False): "__fixdfsi", (False, False): "__fixunsdfsi",
              (True, True): "__fixdfdi", (False, True): "__fixunsdfdi"}[(signed, wide)]
        r = rt.call(fn, op.operands[0])
        return r if _width(dst) in (32, 64) else arith.trunci(dst, r)
    if name == "arith.remf" and dst == f64:
        raise NotImplementedError("vortex: remainder on f64")
    return None


def _f64_cmp(pred: int, operands, rt: _Runtime) -> ir.Value:
    fn, test = _F64_CMP[pred]
    r = rt.call(fn, *operands)
    return arith.cmpi(getattr(arith.CmpIPredicate, test), r, _c(ir.IntegerType.get_signless(32), 0))


def expand_numerics(module: ir.Module) -> None:
    """f16 and i64<->f32 conversions -> integer ops; i64 division and f64 ops -> serialised
    compiler_rt calls (module doc)."""
    f16, f32, i64 = ir.F16Type.get(), ir.F32Type.get(), ir.IntegerType.get_signless(64)
    narrow_index_chains(module)
    rt = _Runtime()
    for op in _walk(module, ("arith.extf", "arith.truncf", *_CONVERSIONS, *_I64_DIVISIONS)):
        src, dst = op.operands[0].type, op.results[0].type
        with ir.InsertionPoint(op), op.location:
            if op.name == "arith.extf" and src == f16:
                new = f16_to_f32(op.operands[0])
                new = new if dst == f32 else arith.extf(dst, new)      # f64: serialised below
            elif op.name == "arith.truncf" and dst == f16:
                narrow = op.operands[0] if src == f32 else arith.truncf(f32, op.operands[0])
                new = f32_to_f16(narrow)
            elif op.name in ("arith.sitofp", "arith.uitofp") and src == i64 and dst == f32:
                new = i64_to_f32(op.operands[0], signed=op.name == "arith.sitofp")
            elif op.name in ("arith.fptosi", "arith.fptoui") and src == f32 and dst == i64:
                new = f32_to_i64(op.operands[0], signed=op.name == "arith.fptosi")
            elif op.name in _I64_DIVISIONS and dst == i64:
                new = rt.call(_I64_DIVISIONS[op.name], *op.operands)
            else:
                continue
        op.results[0].replace_all_uses_with(new)
        op.erase()
    f64_ops = ("arith.extf", "arith.truncf", "arith.cmpf", "arith.remf", *_CONVERSIONS, *_F64_BINARY)
    for op in _walk(module, f64_ops):
        with ir.InsertionPoint(op), op.location:
            new = _f64_op(op, rt)
        if new is not None:
            op.results[0].replace_all_uses_with(new)
            op.erase()
    rt.declare(module)
