"""Builder 1 of the flash-attention kernel (gac_torch/kernels/flash_attention.py): `FlashText`
emits the body as MLIR text, `template` wraps it into `func.func @tmpl(%Q, %K, %V, [%M,] %O)`
holding one gpu.launch (which backends/gpu/strategies/flash_attention.py splices in)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gac_torch.kernels.builder import WORKGROUP
from gac_torch.kernels.flash_attention import ELEM_BYTES, Plan, Spec, kernel

_MMA = {"f16": (16, 8, 16, "f16"), "bf16": (16, 8, 16, "bf16"), "tf32": (16, 8, 8, "tf32"),
        "f32x3": (16, 8, 8, "tf32")}


class FlashText:
    def __init__(self, spec: Spec, p: Plan):
        self.spec, self.p = spec, p
        self.lines: list[str] = []
        self.n = 0
        self.consts: dict[tuple, str] = {}
        e = spec.elem
        self.smem = {"Q": f"memref<{p.bm}x{p.dp + p.pad}x{e}, {WORKGROUP}>",
                     "K": f"memref<{p.stages * p.bn}x{p.dp + p.pad}x{e}, {WORKGROUP}>",
                     "V": f"memref<{p.stages * p.bn}x{p.dvc + p.pad}x{e}, {WORKGROUP}>"}
        if p.stages == 2:  # (Q's fragments come from global memory)
            del self.smem["Q"]
        self.bufs = {"Q": spec.q, "K": spec.k, "V": spec.v}

    def _v(self) -> str:
        self.n += 1
        return f"%v{self.n}"

    def w(self, line: str) -> None:
        self.lines.append(line)

    def _const(self, x: Any, ty: str) -> str:
        key = (repr(x), ty)
        if key not in self.consts:
            r = self._v()
            lit = x if ty != "f32" else ("0xFF800000" if x == -math.inf else repr(float(x)))
            self.w(f"{r} = arith.constant {lit} : {ty}")
            self.consts[key] = r
        return self.consts[key]

    def const(self, x: int) -> str:
        return self._const(int(x), "index")

    def fconst(self, x: float) -> str:
        return self._const(float(x), "f32")

    def tid(self) -> str:
        return "%tid"

    def bid(self, axis: int) -> str:
        return ("%bx", "%by", "%bz")[axis]

    def _op(self, op: str, x: str, y: str, ty: str, flags: str = "") -> str:
        r = self._v()
        self.w(f"{r} = {op} {x}, {y}{flags} : {ty}")
        return r

    add = lambda s, x, y: s._op("arith.addi", x, y, "index")
    sub = lambda s, x, y: s._op("arith.subi", x, y, "index")
    mul = lambda s, x, y: s._op("arith.muli", x, y, "index")
    div = lambda s, x, y: s._op("arith.divui", x, y, "index")
    rem = lambda s, x, y: s._op("arith.remui", x, y, "index")
    min = lambda s, x, y: s._op("arith.minui", x, y, "index")
    lt = lambda s, x, y: s._op("arith.cmpi ult,", x, y, "index")
    ge = lambda s, x, y: s._op("arith.cmpi uge,", x, y, "index")
    gt = lambda s, x, y: s._op("arith.cmpi ugt,", x, y, "index")
    and_ = lambda s, x, y: s._op("arith.andi", x, y, "i1")
    or_ = lambda s, x, y: s._op("arith.ori", x, y, "i1")
    # (contract: LLVM may fuse a multiply and an add into one fma, as nvcc does by default)
    fadd = lambda s, x, y: s._op("arith.addf", x, y, "f32", " fastmath<contract>")
    fsub = lambda s, x, y: s._op("arith.subf", x, y, "f32", " fastmath<contract>")
    fmul = lambda s, x, y: s._op("arith.mulf", x, y, "f32", " fastmath<contract>")
    fdiv = lambda s, x, y: s._op("arith.divf", x, y, "f32")
    fmax = lambda s, x, y: s._op("arith.maximumf", x, y, "f32")
    feq = lambda s, x, y: s._op("arith.cmpf oeq,", x, y, "f32")
    fgt = lambda s, x, y: s._op("arith.cmpf ogt,", x, y, "f32")

    def warp_any(self, pred: str) -> str:
        """vote.sync.any over the warp: one i1, the same in every lane."""
        r = self._v()
        self.w(f'{r} = llvm.call_intrinsic "llvm.nvvm.vote.any.sync"({self._const(-1, "i32")}, {pred}) '
               ": (i32, i1) -> i1")
        return r

    def cond(self, pred: str, then: Callable[[], list[str]], other: list[str]) -> list[str]:
        """f32 values: then()'s where pred (warp-uniform: a branch), else `other`."""
        res, types = self._v(), ", ".join(["f32"] * len(other))
        self.w(f"{res}:{len(other)} = scf.if {pred} -> ({types}) {{")
        saved = self.consts
        self.consts = dict(saved)  # constants defined inside the branch stay inside
        out = then()
        self.consts = saved
        self.w(f"scf.yield {', '.join(out)} : {types}\n}} else {{\nscf.yield {', '.join(other)} : {types}\n}}")
        return [f"{res}#{i}" for i in range(len(other))]

    def fsel(self, cond: str, x: str, y: str) -> str:
        r = self._v()
        self.w(f"{r} = arith.select {cond}, {x}, {y} : f32")
        return r

    def fexp2(self, x: str) -> str:
        """ex2.approx.ftz: one MUFU.EX2 (math.exp2 becomes the non-ftz ex2.approx, which
        wraps each exp in a compare and two predicated multiplies for denormal results)."""
        r = self._v()
        self.w(f'{r} = llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"({x}) : (f32) -> f32')
        return r

    def shfl_xor(self, x: str, m: int) -> str:
        r = self._v()
        self.w(f"{r}, {r}_ok = gpu.shuffle xor {x}, {self._const(m, 'i32')}, {self._const(32, 'i32')} : f32")
        return r

    def _sptr(self, which: str, row: str, col: str, srow: str | None = None, roff: int = 0, coff: int = 0) -> str:
        """!llvm.ptr<3> of element (srow + row + roff, col + coff) of a shared buffer: the
        lane's (row, col) stays one loop-invariant offset, the stage's row srow adds once to
        the base and the constants (roff, coff) become the load's immediate offset."""
        st = {"Q": self.p.dp, "K": self.p.dp, "V": self.p.dvc}[which] + self.p.pad
        es = ELEM_BYTES[self.spec.elem]
        base, off, a, i, ptr = (self._v() for _ in range(5))
        self.w(f"{base} = memref.extract_aligned_pointer_as_index %S{which} : {self.smem[which]} -> index")
        if srow is not None:
            b0, soff, base = base, self._v(), self._v()
            self.w(f"{soff} = affine.apply affine_map<(d0) -> (d0 * {st * es})>({srow})")
            self.w(f"{base} = arith.addi {b0}, {soff} : index")
        self.w(f"{off} = affine.apply affine_map<(d0, d1) -> ((d0 * {st} + d1) * {es})>({row}, {col})")
        if roff or coff:
            a0 = self._v()
            self.w(f"{a0} = arith.addi {base}, {off} : index")
            base, off = a0, self.const((roff * st + coff) * es)
        self.w(f"{a} = arith.addi {base}, {off} : index\n{i} = arith.index_cast {a} : index to i64")
        self.w(f"{ptr} = llvm.inttoptr {i} : i64 to !llvm.ptr<3>")
        return ptr

    def copy_async(self, which: str, sidx: list[str], gidx: list[str], vec: int, ok: str) -> None:
        """cp.async of `vec` elements from global (gidx) to shared (sidx), zeros where not ok
        (no source element read; the indices are then clamped to 0)."""
        buf = self.bufs[which]
        n = vec * ELEM_BYTES[buf.elem]
        zero = self.const(0)
        gi = []
        for x in gidx:
            gi.append(self._v())
            self.w(f"{gi[-1]} = arith.select {ok}, {x}, {zero} : index")
        cnt, tok = self._v(), self._v()
        self.w(f"{cnt} = arith.select {ok}, {self.const(vec)}, {zero} : index")
        self.w(f"{tok} = nvgpu.device_async_copy %{which}[{', '.join(gi)}], %S{which}[{', '.join(sidx)}], {vec}, "
               f"{cnt}{' {bypassL1}' if n == 16 else ''} : {buf.type} to {self.smem[which]}")

    def wait_async(self) -> None:
        """This thread's cp.async copies have landed (other threads' after a barrier)."""
        self.w("nvvm.cp.async.commit.group\nnvvm.cp.async.wait.group 0")

    def load_pair(self, which: str, idx: list[str], ok: str) -> str:
        """Two adjacent elements of a global buffer as vector<2 x elem> (zeros where not ok)."""
        buf, e = self.bufs[which], self.spec.elem
        r, x, z = self._v(), self._v(), self._v()
        self.w(f"{r} = scf.if {ok} -> (vector<2x{e}>) {{\n  {x} = vector.load %{which}[{', '.join(idx)}] "
               f"{{alignment = {2 * ELEM_BYTES[e]}}} : {buf.type}, vector<2x{e}>\n  scf.yield {x} : vector<2x{e}>\n"
               f"}} else {{\n  {z} = arith.constant dense<0.0> : vector<2x{e}>\n  scf.yield {z} : vector<2x{e}>\n}}")
        return r

    def load_smem(self, which: str, idx: list[str], n: int) -> str:
        r = self._v()
        if n == 1:
            self.w(f"{r} = memref.load %S{which}[{', '.join(idx)}] : {self.smem[which]}")
        else:
            self.w(f"{r} = vector.load %S{which}[{', '.join(idx)}] {{alignment = {n * ELEM_BYTES[self.spec.elem]}}} : "
                   f"{self.smem[which]}, vector<{n}x{self.spec.elem}>")
        return r

    def pack(self, lo: str, hi: str) -> str:
        r = self._v()
        self.w(f"{r} = vector.from_elements {lo}, {hi} : vector<2x{self.spec.elem}>")
        return r

    def ldmatrix(self, which: str, row: str, col: str, num: int, trans: bool, srow: str | None = None,
                 roff: int = 0, coff: int = 0) -> list[str]:
        """ldmatrix.sync.x{num}[.trans] of 8x8 b16 matrices: this lane's row address is
        (srow + row + roff, col + coff) of the shared buffer (`_sptr`); returns num registers as
        vector<2 x elem>."""
        e = self.spec.elem
        ptr, r = self._sptr(which, row, col, srow, roff, coff), self._v()
        rt = "i32" if num == 1 else f"!llvm.struct<({', '.join(['i32'] * num)})>"
        self.w(f"{r} = nvvm.ldmatrix {ptr} {{num = {num} : i32, layout = #nvvm.mma_layout<{'col' if trans else 'row'}>, "
               f"shape = #nvvm.ld_st_matrix_shape<m = 8, n = 8>, eltType = #nvvm.ld_st_matrix_elt_type<b16>}} "
               f": (!llvm.ptr<3>) -> {rt}")
        out = []
        for q in range(num):
            x, y = self._v(), self._v()
            self.w(f"{x} = llvm.extractvalue {r}[{q}] : {rt}\n{y} = llvm.bitcast {x} : i32 to vector<2x{e}>")
            out.append(y)
        return out

    def pack_f32(self, lo: str, hi: str) -> str:
        e = self.spec.elem
        a, b = self._v(), self._v()
        self.w(f"{a} = arith.truncf {lo} : f32 to {e}\n{b} = arith.truncf {hi} : f32 to {e}")
        return self.pack(a, b)

    def barrier(self) -> None:
        self.w("gpu.barrier")

    def _tf32(self, x: str) -> tuple[str, str]:
        """(i32 operand, its value as f32)."""
        q, f = self._v(), self._v()
        self.w(f"{q} = nvvm.convert.float.to.tf32 {x} {{rnd = #nvvm.fp_rnd_mode<rna>}}")
        self.w(f"{f} = arith.bitcast {q} : i32 to f32")
        return q, f

    def _operand(self, kind: str, reg: str) -> str:
        if kind == "f16":
            return reg
        r = self._v()
        if kind == "bf16":
            v = self._v()
            self.w(f"{v} = vector.bitcast {reg} : vector<2xbf16> to vector<1xi32>")
            self.w(f"{r} = vector.extract {v}[0] : i32 from vector<1xi32>")
            return r
        return self._tf32(reg)[0]

    def _mma1(self, kind: str, ao: list[str], bo: list[str], acc: list[str]) -> list[str]:
        m, n, k, pt = _MMA[kind]
        ot = "vector<2xf16>" if kind == "f16" else "i32"
        d = self._v()
        self.w(f"{d} = nvvm.mma.sync A[{', '.join(ao)}] B[{', '.join(bo)}] C[{', '.join(acc)}] "
               f"{{layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>, "
               f"multiplicandAPtxType = #nvvm.mma_type<{pt}>, multiplicandBPtxType = #nvvm.mma_type<{pt}>, "
               f"shape = #nvvm.shape<m = {m}, n = {n}, k = {k}>}} : ({ot}, {ot}, f32) -> "
               "!llvm.struct<(f32, f32, f32, f32)>")
        out = []
        for q in range(4):
            r = self._v()
            self.w(f"{r} = llvm.extractvalue {d}[{q}] : !llvm.struct<(f32, f32, f32, f32)>")
            out.append(r)
        return out

    def mma(self, kind: str, a: list[str], bregs: list[str], acc: list[str]) -> list[str]:
        if kind != "f32x3":
            return self._mma1(kind, [self._operand(kind, x) for x in a],
                              [self._operand(kind, x) for x in bregs], acc)

        def split(x: str) -> tuple[str, str]:
            big, bigf = self._tf32(x)
            return big, self._tf32(self.fsub(x, bigf))[0]
        sa, sb = [split(x) for x in a], [split(x) for x in bregs]
        acc = self._mma1(kind, [x[1] for x in sa], [x[0] for x in sb], acc)  # small terms first
        acc = self._mma1(kind, [x[0] for x in sa], [x[1] for x in sb], acc)
        return self._mma1(kind, [x[0] for x in sa], [x[0] for x in sb], acc)

    def load_mask(self, idx: list[str], ok: str) -> str:
        mb = self.spec.mask
        assert mb is not None
        r, x = self._v(), self._v()
        ty = "i1" if self.spec.mask_kind == "bool" else "f32"
        self.w(f"{r} = scf.if {ok} -> ({ty}) {{\n  {x} = memref.load %M[{', '.join(idx)}] : {mb.type}")
        if self.spec.mask_kind == "bool":
            z, h = self._v(), self._v()
            self.w(f"  {z} = arith.constant 0 : {mb.elem}\n  {h} = arith.cmpi eq, {x}, {z} : {mb.elem}")
            self.w(f"  scf.yield {h} : i1\n}} else {{\n  %t{self.n} = arith.constant true\n"
                   f"  scf.yield %t{self.n} : i1\n}}")
        else:
            y = x
            if mb.elem != "f32":
                y = self._v()
                self.w(f"  {y} = arith.extf {x} : {mb.elem} to f32")
            self.w(f"  scf.yield {y} : f32\n}} else {{\n  %z{self.n} = arith.constant 0.0 : f32\n"
                   f"  scf.yield %z{self.n} : f32\n}}")
        return r

    def store_out(self, idx: list[str], val: str, ok: str) -> None:
        o = self.spec.o
        self.w(f"scf.if {ok} {{")
        if o.elem != "f32":
            r = self._v()
            self.w(f"  {r} = arith.truncf {val} : f32 to {o.elem}")
            val = r
        self.w(f"  memref.store {val}, %O[{', '.join(idx)}] : {o.type}\n}}")

    def loop(self, n: str, init: list[str], body: Callable[[Any, list[Any]], list[Any]]) -> list[str]:
        res = self._v()
        kt = f"%kt{self.n}"
        iters = [f"%it{self.n}_{i}" for i in range(len(init))]
        lo, one = self.const(0), self.const(1)
        types = ", ".join(["f32"] * len(init))
        self.w(f"{res}:{len(init)} = scf.for {kt} = {lo} to {n} step {one} iter_args("
               + ", ".join(f"{a} = {v}" for a, v in zip(iters, init)) + f") -> ({types}) {{")
        saved = self.consts
        self.consts = dict(saved)  # constants defined inside the loop stay inside
        out = body(kt, iters)
        self.consts = saved
        self.w(f"scf.yield {', '.join(out)} : {types}\n}}")
        return [f"{res}#{i}" for i in range(len(init))]


def template(spec: Spec, p: Plan) -> str:
    """`func.func @tmpl(%Q, %K, %V, [%M,] %O)` holding one gpu.launch."""
    b = FlashText(spec, p)
    kernel(b, spec, p)
    gx, gy, gz = p.grid
    args = [f"%Q: {spec.q.type}", f"%K: {spec.k.type}", f"%V: {spec.v.type}"]
    if spec.mask is not None:
        args.append(f"%M: {spec.mask.type}")
    args.append(f"%O: {spec.o.type}")
    head = [
        f"func.func @tmpl({', '.join(args)}) {{",
        f"%one = arith.constant 1 : index\n%gx = arith.constant {gx} : index",
        f"%gy = arith.constant {gy} : index\n%gz = arith.constant {gz} : index",
        f"%nt = arith.constant {p.threads} : index",
        ("gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
         "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
         f"workgroup({', '.join(f'%S{w} : {t}' for w, t in b.smem.items())}) {{"),
    ]
    return "\n".join(head + b.lines + ["gpu.terminator\n}\nreturn\n}"])
