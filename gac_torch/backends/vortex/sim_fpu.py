"""RV32F for the functional simulator, vectorised over the threads of a warp.

FP registers are stored as bits: w.f (32, T) uint32 with w.ff its float32 view. numpy's float32
arithmetic is IEEE round-to-nearest-even, like SimX's softfloat for add/sub/mul/div/sqrt.
Known differences (documented, not hidden): arithmetic ignores a static non-RNE rounding mode
(clang emits only dyn/rne for arithmetic; conversions honour rm); fused multiply-add is computed
in float64 then rounded (a double rounding can differ in the last bit in rare halfway cases);
fflags are not kept. NaN results are canonicalised (0x7fc00000) like RISC-V's (x86 would
keep payloads and signs), so results stay bit-identical to SimX.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

U32 = np.uint32
F32, F64 = np.float32, np.float64
OPCODES = (0x07, 0x27, 0x43, 0x47, 0x4B, 0x4F, 0x53)
SIGN = U32(0x8000_0000)
CANONICAL_NAN = U32(0x7FC0_0000)


def _wf(w, rd: int, bits) -> None:
    """f[rd] <- bits (uint32 row) on the active lanes."""
    if w.full:
        w.f[rd] = bits
    else:
        w.f[rd, w.lanes] = bits[w.lanes]


def _wff(w, rd: int, vals) -> None:
    """f[rd] <- arithmetic result, NaNs canonicalised."""
    vals = np.asarray(vals, dtype=F32)
    nan = vals != vals
    bits = vals.view(U32)
    _wf(w, rd, np.where(nan, CANONICAL_NAN, bits) if nan.any() else bits)


def _wx(w, rd: int, vals) -> None:
    if not rd:
        return
    if w.full:
        w.x[rd] = vals
    else:
        w.x[rd, w.lanes] = vals[w.lanes]


def _round(v, rm: int, frm: int):
    """Round float64 values to integers with RISC-V rounding mode rm (7: dynamic = frm)."""
    rm = frm if rm == 7 else rm
    if rm == 1:
        return np.trunc(v)
    if rm == 2:
        return np.floor(v)
    if rm == 3:
        return np.ceil(v)
    if rm == 4:
        return np.sign(v) * np.floor(np.abs(v) + 0.5)
    return np.rint(v)


def _cvt_to_int(v32, rm: int, frm: int, signed: bool):
    v = _round(v32.astype(F64), rm, frm)
    lo, hi = (-2.0**31, 2.0**31 - 1) if signed else (0.0, 2.0**32 - 1)
    r = np.clip(np.nan_to_num(v, nan=hi, posinf=hi, neginf=lo), lo, hi)
    return r.astype(np.int64)


def _minmax(a_bits, b_bits, a, b, is_max: bool):
    r = (np.fmax if is_max else np.fmin)(a, b).view(U32)
    both_nan = (a != a) & (b != b)
    if both_nan.any():
        r = np.where(both_nan, CANONICAL_NAN, r)
    zeros = (a == 0) & (b == 0)          # -0.0 < +0.0 for RISC-V
    if zeros.any():
        both = (a_bits & b_bits) if is_max else (a_bits | b_bits)
        r = np.where(zeros, both, r)
    return r


def _fclass(bits, v):
    neg = (bits & SIGN) != 0
    exp = (bits >> U32(23)) & U32(0xFF)
    man = bits & U32(0x7F_FFFF)
    inf, zero = np.isinf(v), v == 0
    sub = (exp == 0) & (man != 0)
    nan = np.isnan(v)
    qnan = nan & ((man & U32(0x40_0000)) != 0)
    norm = ~(inf | zero | sub | nan)
    classes = [neg & inf, neg & norm, neg & sub, neg & zero, ~neg & zero, ~neg & sub,
               ~neg & norm, ~neg & inf, nan & ~qnan, qnan]
    out = np.zeros(bits.shape, U32)
    for i, c in enumerate(classes):
        out |= c.astype(U32) << U32(i)
    return out


def _op(fn: Callable, nxt: int) -> Callable:
    def op(w):
        fn(w)
        return nxt
    return op


def decode(word: int, pc: int, nxt: int):
    from .sim_isa import IllegalInstruction, sext  # noqa: PLC0415 (cycle)

    opc, rd, rm = word & 0x7F, (word >> 7) & 31, (word >> 12) & 7
    rs1, rs2, f7 = (word >> 15) & 31, (word >> 20) & 31, word >> 25
    rs3, fmt = word >> 27, (word >> 25) & 3
    if opc == 0x07 and rm == 2:                                  # flw
        imm = sext(word >> 20, 12)
        off = U32(imm & 0xFFFF_FFFF)

        def flw(w):
            a = w.x[rs1] + off
            v = w.core.load(a if w.full else a[w.lanes], 4, False)
            if w.full:
                w.f[rd] = v
            else:
                w.f[rd, w.lanes] = v
        return _op(flw, nxt), f"flw f{rd}, {imm}(x{rs1})"
    if opc in (0x43, 0x47, 0x4B, 0x4F) and fmt == 0:             # fmadd/fmsub/fnmsub/fnmadd
        neg_prod, neg_add = opc in (0x4B, 0x4F), opc in (0x47, 0x4F)
        name = {0x43: "fmadd", 0x47: "fmsub", 0x4B: "fnmsub", 0x4F: "fnmadd"}[opc]

        def fma(w):
            p = w.ff[rs1].astype(F64) * w.ff[rs2]
            c = w.ff[rs3].astype(F64)
            _wff(w, rd, (-p if neg_prod else p) + (-c if neg_add else c))
        return _op(fma, nxt), f"{name}.s f{rd}, f{rs1}, f{rs2}, f{rs3}"
    if opc != 0x53:
        raise IllegalInstruction(f"illegal FP instruction {word:#010x} at {pc:#x}")
    f5 = f7 >> 2
    binary = {0: ("fadd", np.add), 1: ("fsub", np.subtract), 2: ("fmul", np.multiply),
              3: ("fdiv", np.divide)}
    if fmt != 0:
        raise IllegalInstruction(f"non-single FP format at {pc:#x} (rv32imf only)")
    if f5 in binary:
        name, fn = binary[f5]
        return _op(lambda w: _wff(w, rd, fn(w.ff[rs1], w.ff[rs2])), nxt), f"{name}.s f{rd}, f{rs1}, f{rs2}"
    if f5 == 0x0B:
        return _op(lambda w: _wff(w, rd, np.sqrt(w.ff[rs1])), nxt), f"fsqrt.s f{rd}, f{rs1}"
    if f5 == 0x04 and rm <= 2:                                   # fsgnj / fsgnjn / fsgnjx
        def sgn(w):
            a, b = w.f[rs1], w.f[rs2]
            s = b if rm == 0 else (~b if rm == 1 else a ^ b)
            _wf(w, rd, (a & ~SIGN) | (s & SIGN))
        return _op(sgn, nxt), f"fsgnj{('', 'n', 'x')[rm]}.s f{rd}, f{rs1}, f{rs2}"
    if f5 == 0x05 and rm <= 1:
        return (_op(lambda w: _wf(w, rd, _minmax(w.f[rs1], w.f[rs2], w.ff[rs1], w.ff[rs2], rm == 1)),
                    nxt), f"f{('min', 'max')[rm]}.s f{rd}, f{rs1}, f{rs2}")
    if f5 == 0x18 and rs2 <= 1:                                  # fcvt.w[u].s
        signed = rs2 == 0
        return (_op(lambda w: _wx(w, rd, _cvt_to_int(w.ff[rs1], rm, w.frm, signed)), nxt),
                f"fcvt.w{'' if signed else 'u'}.s x{rd}, f{rs1}, rm={rm}")
    if f5 == 0x1A and rs2 <= 1:                                  # fcvt.s.w[u]
        signed = rs2 == 0
        return (_op(lambda w: _wff(w, rd, (w.xs if signed else w.x)[rs1].astype(F32)), nxt),
                f"fcvt.s.w{'' if signed else 'u'} f{rd}, x{rs1}")
    if f5 == 0x1C and rs2 == 0 and rm == 0:
        return _op(lambda w: _wx(w, rd, w.f[rs1]), nxt), f"fmv.x.w x{rd}, f{rs1}"
    if f5 == 0x1C and rs2 == 0 and rm == 1:
        return _op(lambda w: _wx(w, rd, _fclass(w.f[rs1], w.ff[rs1])), nxt), f"fclass.s x{rd}, f{rs1}"
    if f5 == 0x1E and rs2 == 0 and rm == 0:
        return _op(lambda w: _wf(w, rd, w.x[rs1]), nxt), f"fmv.w.x f{rd}, x{rs1}"
    if f5 == 0x14 and rm <= 2:                                   # fle / flt / feq
        cmp = (np.less_equal, np.less, np.equal)[rm]
        return (_op(lambda w: _wx(w, rd, cmp(w.ff[rs1], w.ff[rs2]).astype(U32)), nxt),
                f"f{('le', 'lt', 'eq')[rm]}.s x{rd}, f{rs1}, f{rs2}")
    raise IllegalInstruction(f"illegal FP instruction {word:#010x} at {pc:#x}")
