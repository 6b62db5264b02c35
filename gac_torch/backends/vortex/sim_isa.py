"""Decoder for the functional simulator: RV32IM + Zicond + CSRs + branches, dispatching F to
sim_fpu and the Vortex custom opcode to the warp object (sim_core.Warp).

`decode(word, pc)` returns (op, text): `op(w) -> next_pc` runs one instruction for every active
thread of warp `w` at once (numpy rows of shape (threads,)); `text` is a disassembly line.
Registers: w.x (32, T) uint32 with w.xs its int32 view. Only active lanes are written.
SimX semantics kept on purpose: a conditional branch and JALR use the LAST active thread.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import sim_fpu, sim_tcu
from .target import OPCODE_VX, VX_INSN, WMMA
from gac_torch.errors import GacError

Op = Callable[["object"], int]
U32 = np.uint32
M32 = 0xFFFF_FFFF
ABI = ("zero ra sp gp tp t0 t1 t2 s0 s1 a0 a1 a2 a3 a4 a5 a6 a7 s2 s3 s4 s5 s6 s7 s8 s9 s10 "
       "s11 t3 t4 t5 t6").split()


class IllegalInstruction(GacError):
    pass


def sext(v: int, bits: int) -> int:
    m = 1 << (bits - 1)
    return (v & (m - 1)) - (v & m)


def write_x(w, rd: int, v) -> None:
    """rd <- v on the active lanes (v: row array or int)."""
    if not rd:
        return
    if isinstance(v, (int, np.integer)):
        v = U32(int(v) & M32)
        if w.full:
            w.x[rd] = v
        else:
            w.x[rd, w.lanes] = v
    elif w.full:
        w.x[rd] = v
    else:
        w.x[rd, w.lanes] = v[w.lanes]


def _alu(rd: int, fn: Callable, nxt: int) -> Op:
    if rd == 0:
        return lambda w: nxt
    def op(w):
        write_x(w, rd, fn(w.x, w.xs))
        return nxt
    return op


def _div(a, b, signed: bool, rem: bool):
    """RISC-V division: truncating, /0 -> -1 (rem: dividend), INT_MIN/-1 wraps."""
    if signed:
        a, b = a.astype(np.int64), b.astype(np.int64)
    else:
        a, b = a.astype(np.uint64), b.astype(np.uint64)
    zero = b == 0
    bb = np.where(zero, 1, b)
    if signed:
        q = np.sign(a) * np.sign(bb) * (np.abs(a) // np.abs(bb))
        r = a - q * bb
        return np.where(zero, a, r) if rem else np.where(zero, -1, q)
    return np.where(zero, a, a % bb) if rem else np.where(zero, M32, a // bb)


# funct3/funct7 -> (mnemonic, fn(x, xs, r1, r2)) for OP (0x33)
_R_OPS: dict[tuple[int, int], tuple[str, Callable]] = {
    (0, 0): ("add", lambda x, s, a, b: x[a] + x[b]),
    (0, 0x20): ("sub", lambda x, s, a, b: x[a] - x[b]),
    (1, 0): ("sll", lambda x, s, a, b: x[a] << (x[b] & U32(31))),
    (2, 0): ("slt", lambda x, s, a, b: s[a] < s[b]),
    (3, 0): ("sltu", lambda x, s, a, b: x[a] < x[b]),
    (4, 0): ("xor", lambda x, s, a, b: x[a] ^ x[b]),
    (5, 0): ("srl", lambda x, s, a, b: x[a] >> (x[b] & U32(31))),
    (5, 0x20): ("sra", lambda x, s, a, b: s[a] >> (s[b] & 31)),
    (6, 0): ("or", lambda x, s, a, b: x[a] | x[b]),
    (7, 0): ("and", lambda x, s, a, b: x[a] & x[b]),
    (0, 1): ("mul", lambda x, s, a, b: x[a] * x[b]),
    (1, 1): ("mulh", lambda x, s, a, b: (s[a].astype(np.int64) * s[b]) >> 32),
    (2, 1): ("mulhsu", lambda x, s, a, b: (s[a].astype(np.int64) * x[b].astype(np.int64)) >> 32),
    (3, 1): ("mulhu", lambda x, s, a, b: (x[a].astype(np.uint64) * x[b]) >> U32(32)),
    (4, 1): ("div", lambda x, s, a, b: _div(s[a], s[b], True, False)),
    (5, 1): ("divu", lambda x, s, a, b: _div(x[a], x[b], False, False)),
    (6, 1): ("rem", lambda x, s, a, b: _div(s[a], s[b], True, True)),
    (7, 1): ("remu", lambda x, s, a, b: _div(x[a], x[b], False, True)),
    (5, 7): ("czero.eqz", lambda x, s, a, b: np.where(x[b] == 0, U32(0), x[a])),
    (7, 7): ("czero.nez", lambda x, s, a, b: np.where(x[b] != 0, U32(0), x[a])),
}
_BRANCH = {0: ("beq", lambda a, b: a == b), 1: ("bne", lambda a, b: a != b),
           4: ("blt", lambda a, b: a < b), 5: ("bge", lambda a, b: a >= b),
           6: ("bltu", lambda a, b: a < b), 7: ("bgeu", lambda a, b: a >= b)}
_LOADS = {0: ("lb", 1, True), 1: ("lh", 2, True), 2: ("lw", 4, False), 4: ("lbu", 1, False),
          5: ("lhu", 2, False)}
_STORES = {0: ("sb", 1), 1: ("sh", 2), 2: ("sw", 4)}


def _branch(f3: int, rs1: int, rs2: int, target: int, pc: int) -> Op:
    nxt = pc + 4
    _, cmp = _BRANCH[f3]
    signed = f3 in (4, 5)

    def op(w):
        regs = w.xs if signed else w.x
        c = cmp(regs[rs1], regs[rs2])
        if w.nactive > 1:          # threads disagree and no SPLIT: SimX follows the last one
            n = int(np.count_nonzero(c if w.full else c[w.lanes]))
            if 0 < n < w.nactive:
                w.core.sim.note_divergent_branch(w, pc)
        return target if c[w.last] else nxt
    return op


def _load(rd: int, rs1: int, imm: int, size: int, signed: bool, nxt: int) -> Op:
    off = U32(imm & M32)

    def op(w):
        a = w.x[rs1] + off
        v = w.core.load(a if w.full else a[w.lanes], size, signed)
        if rd:
            if w.full:
                w.x[rd] = v
            else:
                w.x[rd, w.lanes] = v
        return nxt
    return op


def _store(rs1: int, rs2: int, imm: int, size: int, nxt: int, fp: bool = False) -> Op:
    off = U32(imm & M32)

    def op(w):
        a = w.x[rs1] + off
        v = (w.f if fp else w.x)[rs2]
        if not w.full:
            a, v = a[w.lanes], v[w.lanes]
        w.core.store(a, v, size)
        return nxt
    return op


def _csr(rd: int, rs1: int, f3: int, csr: int, nxt: int) -> Op:
    kind, imm = f3 & 3, f3 >= 4      # 1 rw, 2 rs, 3 rc; imm: rs1 is a 5-bit immediate

    def op(w):
        old = w.read_csr(csr)
        src = U32(rs1) if imm else w.x[rs1]
        if kind == 1 or rs1:         # csrrs/csrrc with rs1 = x0 / zimm 0 do not write
            new = src if kind == 1 else (old | src if kind == 2 else old & ~src)
            w.write_csr(csr, new)
        write_x(w, rd, old)
        return nxt
    return op


def decode(word: int, pc: int) -> tuple[Op, str]:
    opc, rd, f3 = word & 0x7F, (word >> 7) & 31, (word >> 12) & 7
    rs1, rs2, f7 = (word >> 15) & 31, (word >> 20) & 31, word >> 25
    i_imm = sext(word >> 20, 12)
    nxt = (pc + 4) & M32
    r = ABI
    if opc == 0x37 or opc == 0x17:                       # lui / auipc
        v = (word & 0xFFFFF000) + (pc if opc == 0x17 else 0)
        return _alu(rd, lambda x, s: v & M32, nxt), f"{'lui' if opc == 0x37 else 'auipc'} {r[rd]}, {word >> 12:#x}"
    if opc == 0x6F:                                      # jal
        imm = sext(((word >> 31) << 20) | (((word >> 12) & 0xFF) << 12)
                   | (((word >> 20) & 1) << 11) | (((word >> 21) & 0x3FF) << 1), 21)
        target = (pc + imm) & M32

        def jal(w):
            write_x(w, rd, nxt)
            return target
        return jal, f"jal {r[rd]}, {target:#x}"
    if opc == 0x67 and f3 == 0:                          # jalr: target from the last lane

        def jalr(w):
            t = (int(w.x[rs1, w.last]) + i_imm) & ~1 & M32
            write_x(w, rd, nxt)
            return t
        return jalr, f"jalr {r[rd]}, {i_imm}({r[rs1]})"
    if opc == 0x63 and f3 in _BRANCH:
        imm = sext(((word >> 31) << 12) | (((word >> 7) & 1) << 11)
                   | (((word >> 25) & 0x3F) << 5) | (((word >> 8) & 0xF) << 1), 13)
        target = (pc + imm) & M32
        return _branch(f3, rs1, rs2, target, pc), f"{_BRANCH[f3][0]} {r[rs1]}, {r[rs2]}, {target:#x}"
    if opc == 0x03 and f3 in _LOADS:
        name, size, signed = _LOADS[f3]
        return _load(rd, rs1, i_imm, size, signed, nxt), f"{name} {r[rd]}, {i_imm}({r[rs1]})"
    if opc == 0x23 and f3 in _STORES:
        imm = sext(((word >> 25) << 5) | ((word >> 7) & 31), 12)
        name, size = _STORES[f3]
        return _store(rs1, rs2, imm, size, nxt), f"{name} {r[rs2]}, {imm}({r[rs1]})"
    if opc == 0x13:
        sh = U32(rs2)
        imm_u, imm_s = U32(i_imm & M32), np.int32(i_imm)
        ops = {0: ("addi", lambda x, s: x[rs1] + imm_u), 2: ("slti", lambda x, s: s[rs1] < imm_s),
               3: ("sltiu", lambda x, s: x[rs1] < imm_u), 4: ("xori", lambda x, s: x[rs1] ^ imm_u),
               6: ("ori", lambda x, s: x[rs1] | imm_u), 7: ("andi", lambda x, s: x[rs1] & imm_u)}
        if f3 == 1 and f7 == 0:
            ops[1] = ("slli", lambda x, s: x[rs1] << sh)
        elif f3 == 5 and f7 == 0:
            ops[5] = ("srli", lambda x, s: x[rs1] >> sh)
        elif f3 == 5 and f7 == 0x20:
            ops[5] = ("srai", lambda x, s: s[rs1] >> np.int32(rs2))
        if f3 in ops:
            name, fn = ops[f3]
            arg = rs2 if f3 in (1, 5) else i_imm
            return _alu(rd, fn, nxt), f"{name} {r[rd]}, {r[rs1]}, {arg}"
    if opc == 0x33 and (f3, f7) in _R_OPS:
        name, fn = _R_OPS[(f3, f7)]
        return _alu(rd, lambda x, s: fn(x, s, rs1, rs2), nxt), f"{name} {r[rd]}, {r[rs1]}, {r[rs2]}"
    if opc == 0x0F:                                      # fence / fence.i
        return (lambda w: nxt), "fence"
    if opc == 0x73:
        if f3 == 0:
            raise IllegalInstruction(f"ecall/ebreak/xret at {pc:#x} (no trap handler on Vortex)")
        if f3 != 4:
            csr = word >> 20
            return _csr(rd, rs1, f3, csr, nxt), f"csr{('', 'rw', 'rs', 'rc')[f3 & 3]}{'i' if f3 >= 4 else ''} {r[rd]}, {csr:#x}, {rs1 if f3 >= 4 else r[rs1]}"
    if opc == OPCODE_VX and (f7, f3) in VX_INSN:
        name = VX_INSN[(f7, f3)]
        return _vortex(name, rd, rs1, rs2, pc, nxt), f"vx.{name} {r[rd]}, {r[rs1]}, {r[rs2]}"
    if opc in sim_fpu.OPCODES:
        if opc == 0x27 and f3 == 2:                      # fsw
            imm = sext(((word >> 25) << 5) | ((word >> 7) & 31), 12)
            return _store(rs1, rs2, imm, 4, nxt, fp=True), f"fsw f{rs2}, {imm}(x{rs1})"
        return sim_fpu.decode(word, pc, nxt)
    raise IllegalInstruction(f"illegal instruction {word:#010x} at {pc:#x}")


def _vortex(name: str, rd: int, rs1: int, rs2: int, pc: int, nxt: int) -> Op:
    """Warp-control and warp-collective instructions (semantics in sim_core.Warp.vx_*)."""
    if name.startswith(("vote", "shfl")):
        kind = name.split("_")[1]
        vote = name.startswith("vote")

        def coll(w):
            write_x(w, rd, w.vx_vote(kind, rs1) if vote else w.vx_shfl(kind, rs1, rs2))
            return nxt
        return coll
    fn = getattr(_WarpOps, name)
    return lambda w: fn(w, rd, rs1, rs2, pc, nxt)


class _WarpOps:
    """Adapters from decoded operands to the warp's control methods."""

    @staticmethod
    def tmc(w, rd, rs1, rs2, pc, nxt):
        w.set_tmask(int(w.x[rs1, w.last]))
        return nxt

    @staticmethod
    def wspawn(w, rd, rs1, rs2, pc, nxt):
        w.core.wspawn(w, int(w.x[rs1, w.last]), int(w.x[rs2, w.last]))
        return nxt

    @staticmethod
    def split(w, rd, rs1, rs2, pc, nxt):
        w.vx_split(w.x[rs1], rs2 != 0, nxt, rd)
        return nxt

    @staticmethod
    def join(w, rd, rs1, rs2, pc, nxt):
        return w.vx_join(int(w.x[rs1, w.last]), nxt)

    @staticmethod
    def bar(w, rd, rs1, rs2, pc, nxt):
        w.core.barrier_arrive(w, int(w.x[rs1, w.last]), int(w.x[rs2, w.last]), sync=True)
        return nxt

    @staticmethod
    def bar_async(w, rd, rs1, rs2, pc, nxt):
        bar_id, arg = int(w.x[rs1, w.last]), int(w.x[rs2, w.last])
        if rd:           # arrive: returns the phase before arriving
            write_x(w, rd, w.core.barrier_phase(bar_id) & 1)
            w.core.barrier_arrive(w, bar_id, arg, sync=False)
        else:            # wait(id, phase)
            w.core.barrier_wait(w, bar_id, arg)
        return nxt

    @staticmethod
    def pred(w, rd, rs1, rs2, pc, nxt):
        w.vx_pred(w.x[rs1], negate=rd != 0, restore=int(w.x[rs2, w.last]))
        return nxt

    @staticmethod
    def wsync(w, rd, rs1, rs2, pc, nxt):
        return nxt

    @staticmethod
    def wmma(w, rd, rs1, rs2, pc, nxt):
        """rd = output format (f32 only), rs1 = input format, rs2 bit 0 = sparse (unsupported)."""
        cfg = w.core.sim.config
        fmts = {v: k for k, v in WMMA.fmts}
        if not cfg.tcu or cfg.threads != WMMA.threads:
            raise IllegalInstruction(f"WMMA at {pc:#x}: the configuration has no tensor-core unit "
                                     f"for {cfg.threads}-thread warps (VortexConfig.tcu)")
        if fmts.get(rd) != "f32" or fmts.get(rs1) not in ("f16", "bf16") or rs2:
            raise IllegalInstruction(f"WMMA at {pc:#x}: formats d={rd} s={rs1} sparse={rs2 & 1} "
                                     "not modelled (f16/bf16 -> f32 dense only)")
        if not w.full:
            raise IllegalInstruction(f"WMMA at {pc:#x} with a partial thread mask")
        sim_tcu.wmma(w.f, fmts[rs1])
        # SimX retires the macro instruction as its micro-ops: count them, as it does
        extra = WMMA.uops - 1
        w.core.sim.counters["instructions"] += extra
        w.core.sim.counters["thread_instructions"] += extra * w.nactive
        return nxt
