"""Vortex (v3.0, KMU/CTA mode) target facts in one place: ISA flags, CSRs, custom instructions,
memory map, default configuration and the device helper functions our kernels may call.

Everything else in this package (toolchain, .vxbin writer, functional simulator, bridge) reads
these tables; nothing here runs code. Sources of the numbers: /work/shared/docs/vortex.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Compilation target. No `a` (SimX's default build has VX_CFG_EXT_A_ENABLE = false) and no `c`
# (the KMU rewinds a reused warp by exactly 20 bytes into the dispatch window, so the start-up
# must be fixed-size 4-byte instructions). Zicond is on in SimX's default build and lets LLVM
# lower integer `select`s without branches, which matters on a SIMT machine (see toolchain.py).
TRIPLE = "riscv32-unknown-elf"
MARCH = "rv32imf_zicond"
MABI = "ilp32f"
DATA_LAYOUT = "e-m:e-p:32:32-i64:64-n32-S128"

# ---------------------------------------------------------------------------------------------
# Memory map (XLEN 32).
STARTUP_ADDR = 0x8000_0000          # code; the image's lowest address is where every warp starts
STACK_BASE_ADDR = 0xFFFF_0000       # sp = STACK_BASE_ADDR - (mhartid << STACK_LOG2_SIZE)
STACK_LOG2_SIZE = 13                # 8 KiB per hardware thread
LMEM_BASE_ADDR = 0xFFFF_0000        # per-core local (shared) memory; CTA slot s at base + s*stride
LMEM_LOG2_SIZE = 14                 # 16 KiB per core (default build)
MEM_BLOCK_SIZE = 64                 # CTA local-memory stride is rounded up to this
KMU_REWIND_BYTES = 20               # a reused warp restarts at (PC after `tmc x0`) - 20

# ---------------------------------------------------------------------------------------------
# CSRs.
CSR = {
    "fflags": 0x001, "frm": 0x002, "fcsr": 0x003,
    "mscratch": 0x340, "mhartid": 0xF14,
    "mcycle": 0xB00, "mcycle_h": 0xB80, "minstret": 0xB02, "minstret_h": 0xB82,
    "thread_id": 0xCC0, "warp_id": 0xCC1, "core_id": 0xCC2,
    "active_warps": 0xCC3, "active_threads": 0xCC4,
    "num_threads": 0xFC0, "num_warps": 0xFC1, "num_cores": 0xFC2,
    "local_mem_base": 0xFC3, "num_barriers": 0xFC4,
    "cta_id": 0xCD0, "cta_rank": 0xCD1, "cta_size": 0xCD2,
    "thread_id_x": 0xCD3, "thread_id_y": 0xCD4, "thread_id_z": 0xCD5,
    "block_id_x": 0xCD6, "block_id_y": 0xCD7, "block_id_z": 0xCD8,
    "block_dim_x": 0xCD9, "block_dim_y": 0xCDA, "block_dim_z": 0xCDB,
    "grid_dim_x": 0xCDC, "grid_dim_y": 0xCDD, "grid_dim_z": 0xCDE,
    "cta_lmem_addr": 0xCDF, "cluster_size": 0xCE0, "cta_entry": 0xCE1,
}

# ---------------------------------------------------------------------------------------------
# Custom instructions: R-type, opcode CUSTOM0 (0x0B); key = (funct7, funct3).
OPCODE_VX = 0x0B
VX_INSN = {
    (0, 0): "tmc", (0, 1): "wspawn", (0, 2): "split", (0, 3): "join", (0, 4): "bar",
    (0, 5): "pred", (0, 6): "bar_async", (0, 7): "wsync",
    (1, 0): "vote_all", (1, 1): "vote_any", (1, 2): "vote_uni", (1, 3): "vote_ballot",
    (1, 4): "shfl_up", (1, 5): "shfl_down", (1, 6): "shfl_bfly", (1, 7): "shfl_idx",
    (2, 0): "wmma",                  # only on a device with a TCU (Wmma below)
}


def vx_insn(funct3: int, funct7: int = 0, rd: str = "x0", rs1: str = "x0", rs2: str = "x0") -> str:
    """Assembler text for one Vortex instruction (`.insn r` is understood by clang 14+)."""
    return f".insn r {OPCODE_VX:#x}, {funct3}, {funct7}, {rd}, {rs1}, {rs2}"


# ---------------------------------------------------------------------------------------------
# Device configuration (fixed when SimX is built; kernels read the counts from CSRs).
@dataclass(frozen=True)
class VortexConfig:
    cores: int = 1
    warps: int = 4
    threads: int = 4
    barriers: int = 8
    lmem_log2_size: int = LMEM_LOG2_SIZE
    tcu: bool = False          # a tensor-core unit (WMMA; see Wmma below)

    @property
    def lmem_size(self) -> int:
        return 1 << self.lmem_log2_size

    @property
    def ipdom_depth(self) -> int:
        # SimX: a divergent SPLIT with this many entries already pushed aborts ("IPDOM stack is
        # full"); each divergent level splits off at least one thread, so threads - 1 suffice.
        return self.threads - 1


DEFAULT_CONFIG = VortexConfig()

# ---------------------------------------------------------------------------------------------
# Tensor-core unit (SimX built with -DVX_CFG_EXT_TCU_ENABLE; device ISA flag VX_ISA_EXT_TCU).
# Read from sim/simx/decode.cpp, sim/simx/tcu/tcu_unit.cpp and sw/kernel/include/vx_tensor.h +
# sw/common/tensor_cfg.h (wmma_config_t<4>) of the tree the bridge is checked against.
ISA_EXT_TCU = 1 << (32 + 9)          # bit of the VX_CAPS_ISA_FLAGS query


@dataclass(frozen=True)
class Wmma:
    """WMMA_SYNC on a 4-thread warp: D[8x4] = C + A[8x8] @ B[8x4], A and B f16 or bf16 (two per
    32-bit register, the lower k in the low half), C and D f32; one macro instruction that SimX
    expands into 16 micro-ops (m_steps 4 x n_steps 2 x k_steps 2, k outermost), each a 2x2x4
    FEDP. Encoding `.insn r CUSTOM0, 0, 2, x<fmt_d>, x<fmt_s>, x0`; operands are fixed FP
    registers: C/D f0-f7, A f10-f17, B f28-f31, at SimX's bank-conflict-free offsets (a_reg,
    b_reg, c_reg). Lane l holds, of micro-tile (m, n, k): A row 2m + l/2, k-word 2k + l%2; B
    column 2n + l/2, k-word 2k + l%2; C row 2m + l/2, column 2n + l%2. FEDP per output: the
    k-word products summed in f32 in order (p = a0*b0; p = p + a1*b1; acc = p0 + 0; acc = p1 +
    acc) then d = c + acc, each step rounded (sim_tcu.wmma does the same)."""

    threads: int = 4
    tile_m: int = 8
    tile_n: int = 4
    tile_k: int = 8                  # elements (4 k-words of 2)
    uops: int = 16                   # micro-ops SimX retires (and counts) per WMMA
    fmts: tuple[tuple[str, int], ...] = (("f32", 0), ("f16", 2), ("bf16", 3))
    c_base: int = 0
    a_base: int = 10
    b_base: int = 28

    def fmt(self, elem: str) -> int:
        return dict(self.fmts)[elem]

    @staticmethod
    def a_reg(m: int, k: int) -> int:
        return ((m & 1) << 2) | ((1 - (m >> 1)) << 1) | k

    @staticmethod
    def b_reg(n: int, k: int) -> int:
        return ((n ^ k) << 1) | (1 - k)

    @staticmethod
    def c_reg(m: int, n: int) -> int:
        return ((m & 1) << 2) | ((1 - (m >> 1)) << 1) | (1 - ((m >> 1) ^ n))

    def asm(self, elem: str) -> tuple[str, str]:
        """(template, constraints) of one WMMA with `elem` inputs and f32 accumulators, for an
        inline asm whose operands are A's 8 and B's 4 registers (physical order) then C's 8
        (tied to the 8 results)."""
        outs = [f"={{f{self.c_base + r}}}" for r in range(8)]
        ins = [f"{{f{self.a_base + r}}}" for r in range(8)] + [f"{{f{self.b_base + r}}}" for r in range(4)]
        return (vx_insn(0, 2, rd=f"x{self.fmt('f32')}", rs1=f"x{self.fmt(elem)}"),
                ",".join(outs + ins + [str(i) for i in range(8)]))


WMMA = Wmma()

# ---------------------------------------------------------------------------------------------
# Device helpers a kernel may call (C: #include "vx_gac.h"; LLVM IR: `declare` them and the
# toolchain substitutes an inlined definition). name -> (ret, params, asm, constraints, convergent)
# Types are LLVM types; "ptr" returns are addresses. `$N` are inline-asm operands in IR order.
@dataclass(frozen=True)
class Helper:
    ret: str                   # "i32", "ptr" or "void"
    params: tuple[str, ...]    # LLVM types ("i32")
    asm: str                   # LLVM inline-asm template (lines joined with "\n")
    constraints: str
    convergent: bool = False   # warp-control: LLVM must neither duplicate nor hoist it
    doc: str = ""


def _csr_reader(csr: str, ret: str = "i32") -> Helper:
    return Helper(ret, (), f"csrr $0, {CSR[csr]:#x}", "=r", doc=f"read CSR {csr}")


HELPERS: dict[str, Helper] = {
    **{f"vx_{n}": _csr_reader(n) for n in (
        "thread_id_x", "thread_id_y", "thread_id_z", "block_id_x", "block_id_y", "block_id_z",
        "block_dim_x", "block_dim_y", "block_dim_z", "grid_dim_x", "grid_dim_y", "grid_dim_z",
        "cta_id", "cta_rank", "cta_size", "warp_id", "core_id", "thread_id", "active_threads",
        "num_threads", "num_warps", "num_cores")},
    "vx_hart_id": _csr_reader("mhartid"),
    "vx_local_mem": Helper("ptr", (), f"csrr $0, {CSR['cta_lmem_addr']:#x}", "=r",
                           doc="this CTA's local (shared) memory base"),
    "vx_barrier": Helper("void", ("i32", "i32"), vx_insn(4, rs1="$0", rs2="$1"),
                         "r,r,~{memory}", True, "raw BAR: id = (bar_no << 8) | cta_id, count = warps"),
    "vx_syncthreads": Helper(
        "void", (),
        f"csrr t0, {CSR['cta_id']:#x}\ncsrr t1, {CSR['cta_size']:#x}\n" + vx_insn(4, rs1="t0", rs2="t1"),
        "~{t0},~{t1},~{memory}", True, "__syncthreads(): BAR(CTA_ID, CTA_SIZE)"),
    "vx_split": Helper("i32", ("i32",), vx_insn(2, rd="$0", rs1="$1"), "=r,r,~{memory}", True,
                       "divergence token for `if (pred)`; bit 0 of pred is tested"),
    "vx_split_n": Helper("i32", ("i32",), vx_insn(2, rd="$0", rs1="$1", rs2="x1"), "=r,r,~{memory}",
                         True, "split on !pred"),
    "vx_join": Helper("void", ("i32",), vx_insn(3, rs1="$0"), "r,~{memory}", True,
                      "reconverge; argument is the token from vx_split"),
    "vx_pred": Helper("void", ("i32", "i32"), vx_insn(5, rs1="$0", rs2="$1"), "r,r,~{memory}", True,
                      "mask off threads whose cond is 0; if none is true, the mask becomes arg 2"),
    "vx_pred_n": Helper("void", ("i32", "i32"), vx_insn(5, rd="x1", rs1="$0", rs2="$1"),
                        "r,r,~{memory}", True, "vx_pred on !cond"),
    "vx_tmc": Helper("void", ("i32",), vx_insn(0, rs1="$0"), "r,~{memory}", True, "set thread mask"),
    "vx_wsync": Helper("void", (), vx_insn(7), "~{memory}", True, "drain the warp"),
    "vx_fence": Helper("void", (), "fence iorw, iorw", "~{memory}", False, "memory fence"),
    **{f"vx_vote_{n}": Helper("i32", ("i32",), vx_insn(f3, 1, rd="$0", rs1="$1"), "=r,r", True,
                              f"warp vote {n} over bit 0 of the argument")
       for f3, n in enumerate(("all", "any", "uni", "ballot"))},
    **{f"vx_shfl_{n}": Helper("i32", ("i32", "i32"), vx_insn(4 + i, 1, rd="$0", rs1="$1", rs2="$2"),
                              "=r,r,r", True, "warp shuffle; arg 2 = (mask << 12) | (c << 6) | b")
       for i, n in enumerate(("up", "down", "bfly", "idx"))},
}


# ---------------------------------------------------------------------------------------------
# Kernel argument blob (what the host hands vx_enqueue_launch; the kernel gets its address in a0).
# Device pointers are u64 fields even on rv32 (Vortex's convention); natural alignment.
ARG_KINDS: dict[str, tuple[int, str]] = {      # kind -> (size, struct format)
    "ptr": (8, "Q"), "i32": (4, "i"), "u32": (4, "I"), "f32": (4, "f"), "i64": (8, "q"),
}


def arg_offsets(params: "tuple[str, ...] | list[str]") -> tuple[list[int], int]:
    """Byte offset of each field and the blob size (a multiple of 8)."""
    offs, off = [], 0
    for kind in params:
        if kind not in ARG_KINDS:
            raise ValueError(f"unknown kernel parameter kind {kind!r}; known: {sorted(ARG_KINDS)}")
        size = ARG_KINDS[kind][0]
        off = (off + size - 1) // size * size
        offs.append(off)
        off += size
    return offs, (off + 7) // 8 * 8


def pack_args(params: "tuple[str, ...] | list[str]", values: "list | tuple") -> bytes:
    """Build the argument blob for `params` (pointers: device addresses as ints)."""
    import struct  # noqa: PLC0415

    if len(params) != len(values):
        raise ValueError(f"{len(params)} parameters but {len(values)} values")
    offs, size = arg_offsets(params)
    blob = bytearray(size)
    for kind, off, v in zip(params, offs, values):
        struct.pack_into("<" + ARG_KINDS[kind][1], blob, off, v)
    return bytes(blob)
