"""Builder 1 of the Hopper flash-attention kernel (gac_torch/kernels/flash_wgmma.py): the float
verbs of flash_attention_text's `FlashText`, plus mbarrier, TMA, setmaxnreg and wgmma as PTX through
llvm.inline_asm (as wgmma_text.py); `template` wraps the body into `func.func @tmpl(%Q, %K, %V,
%O)`: three TMA descriptors made on the host, then one gpu.launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gac_torch.kernels.flash_attention import Spec
from gac_torch.kernels.flash_attention_text import FlashText
from gac_torch.kernels.flash_wgmma import ALIGN, EXP2_MAGIC, EXP2_POLY, Plan, descriptor, kernel, layout


class _WgText(FlashText):
    def __init__(self, spec: Spec, p: Plan):  # (no workgroup buffers: dynamic shared memory)
        self.spec, self.p = spec, p
        self.lines: list[str] = []
        self.n = 0
        self.consts: dict[tuple, str] = {}
        self.bufs = {"Q": spec.q, "K": spec.k, "V": spec.v}

    def eq(self, x: str, y: str) -> str:
        return self._op("arith.cmpi eq,", x, y, "index")

    def i32(self, x: int) -> str:
        return self._const(int(x), "i32")

    def _cast(self, op: str, x: str, src: str, dst: str) -> str:
        r = self._v()
        self.w(f"{r} = {op} {x} : {src} to {dst}")
        return r

    def add_i32(self, x: str, y: str) -> str:
        return self._op("arith.addi", x, y, "i32")

    def mul_i32(self, x: str, k: int) -> str:
        """An index value times a constant, as i32."""
        return self._op("arith.muli", self._cast("arith.index_cast", x, "index", "i32"), self.i32(k), "i32")

    def asm(self, text: str, outs: int = 0, tied: list[str] | None = None,
            args: list[tuple[str, str, str]] = (), types: list[str] | None = None) -> list[str]:
        """One llvm.inline_asm with side effects: `outs` results of `types` (default f32; the
        first len(tied) of them also inputs: values held in their registers through it), then
        `args` (value, constraint, type)."""
        tied = tied or []
        types = types or ["f32"] * outs
        cons = ["=f" if t == "f32" else "=r" for t in types] + [str(i) for i in range(len(tied))]
        cons += [a[1] for a in args]
        ops = list(tied) + [a[0] for a in args]
        in_types = types[:len(tied)] + [a[2] for a in args]
        text = text.replace("\n", "\\0A")
        head = f'llvm.inline_asm has_side_effects asm_dialect = att "{text}", "{",".join(cons)}" {", ".join(ops)}'
        if outs == 0:
            self.w(f"{head} : ({', '.join(in_types)}) -> ()")
            return []
        r = self._v()
        rt = types[0] if outs == 1 else "!llvm.struct<(" + ", ".join(types) + ")>"
        self.w(f"{r} = {head} : ({', '.join(in_types)}) -> {rt}")
        if outs == 1:
            return [r]
        res = []
        for i in range(outs):
            x = self._v()
            self.w(f"{x} = llvm.extractvalue {r}[{i}] : {rt}")
            res.append(x)
        return res

    def smem_base(self) -> str:
        """The dynamic shared memory's address, rounded up to ALIGN (i32, shared window)."""
        d, p = self._v(), self._v()
        self.w(f"{d} = gpu.dynamic_shared_memory : memref<?xi8, #gpu.address_space<workgroup>>")
        self.w(f"{p} = memref.extract_aligned_pointer_as_index {d} : memref<?xi8, #gpu.address_space<workgroup>> -> index")
        a = self._cast("arith.index_cast", p, "index", "i32")
        return self._op("arith.andi", self.add_i32(a, self.i32(ALIGN - 1)), self.i32(-ALIGN), "i32")

    def smem_addr(self, base: str, off: int, s: str | None = None, stride: int = 0) -> str:
        a = self.add_i32(base, self.i32(off))
        return a if s is None else self.add_i32(a, self.mul_i32(s, stride))

    def _i32(self, x: str) -> str:
        return self._cast("arith.index_cast", x, "index", "i32")

    def mbar_init(self, bar: str, count: int) -> None:
        self.asm("mbarrier.init.shared::cta.b64 [$0], $1;", args=[(bar, "r", "i32"), (self.i32(count), "r", "i32")])

    def mbar_fence_init(self) -> None:
        self.asm("fence.mbarrier_init.release.cluster;")

    def mbar_expect(self, bar: str, nbytes: int) -> None:
        self.asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
                 args=[(bar, "r", "i32"), (self.i32(nbytes), "r", "i32")])

    def mbar_arrive(self, bar: str) -> None:
        self.asm("mbarrier.arrive.shared::cta.b64 _, [$0];", args=[(bar, "r", "i32")])

    def mbar_wait(self, bar: str, parity: str) -> None:
        self.asm("{\n.reg .pred P1;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [$0], $1;\n"
                 "@!P1 bra WAIT;\n}", args=[(bar, "r", "i32"), (self._i32(parity), "r", "i32")])

    def tma_load(self, which: str, dst: str, coords: list[str], bar: str) -> None:
        n = len(coords)
        cs = ", ".join(f"${i + 2}" for i in range(n))
        self.asm(f"cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 f"[$0], [$1, {{{cs}}}], [${n + 2}];",
                 args=[(dst, "r", "i32"), (f"%tm{which}", "l", "!llvm.ptr"),
                       *[(self._i32(x), "r", "i32") for x in coords], (bar, "r", "i32")])

    def fill_ones(self, addrs: list[str], nbytes: int) -> None:
        """Every thread: 16-byte stores of the operand type's 1.0 over [a, a + nbytes) for each
        a (i32 shared addresses), strided by the block; then the fence that shows these
        generic-proxy writes to wgmma's (async-proxy) reads after the next barrier."""
        one = {"bf16": 0x3F803F80, "f16": 0x3C003C00}[self.spec.elem]
        word = self._const(one, "i32")
        step = self.const(16 * self.p.threads)
        lo = self.mul(self.tid(), self.const(16))
        for a in addrs:
            iv = f"%kt{self.n}"
            self.n += 1
            self.w(f"scf.for {iv} = {lo} to {self.const(nbytes)} step {step} {{")
            saved = self.consts
            self.consts = dict(saved)
            at = self.add_i32(a, self._i32(iv))
            self.asm("st.shared.v4.b32 [$0], {$1, $1, $1, $1};", args=[(at, "r", "i32"), (word, "r", "i32")])
            self.consts = saved
            self.w("}")
        self.asm("fence.proxy.async.shared::cta;")

    def bar_sync(self, bar: str, count: int) -> None:
        """Named barrier `bar` (index): wait until `count` threads arrived (these included)."""
        self.asm("bar.sync $0, $1;", args=[(self._i32(bar), "r", "i32"), (self.i32(count), "r", "i32")])

    def bar_arrive(self, bar: str, count: int) -> None:
        self.asm("bar.arrive $0, $1;", args=[(self._i32(bar), "r", "i32"), (self.i32(count), "r", "i32")])

    def setmaxnreg(self, inc: bool, n: int) -> None:
        self.asm(f"setmaxnreg.{'inc' if inc else 'dec'}.sync.aligned.u32 {n};")

    def descriptor(self, addr: str, lbo: int, sbo: int, sw: int) -> str:
        a64 = self._cast("arith.extui", addr, "i32", "i64")
        lo = self._op("arith.shrui", self._op("arith.andi", a64, self._const(0x3FFFF, "i64"), "i64"),
                      self._const(4, "i64"), "i64")
        return self._op("arith.ori", lo, self._const(descriptor(0, lbo, sbo, sw), "i64"), "i64")

    def desc_add(self, d: str, off: int, s: str | None = None, stride: int = 0, lbo_step: int = 0) -> str:
        """Descriptor `d` moved by `off` (+ s·stride) bytes, its LBO less s·lbo_step bytes (the
        fields are in 16-byte units; shared addresses stay below 2^18 and LBOs above 0, so
        neither carries nor borrows out of its field)."""
        if off:
            d = self._op("arith.addi", d, self._const(off >> 4, "i64"), "i64")
        if s is not None:
            si = self._cast("arith.index_cast", s, "index", "i64")
            k = (stride >> 4) - ((lbo_step >> 4) << 16)
            d = self._op("arith.addi", d, self._op("arith.muli", si, self._const(k, "i64"), "i64"), "i64")
        return d

    def wgmma_fence(self) -> None:
        self.asm("wgmma.fence.sync.aligned;")

    def wgmma_commit(self) -> None:
        self.asm("wgmma.commit_group.sync.aligned;")

    def wgmma_wait(self, n: int, vals: list[str], ivals: list[str] = ()) -> list[str]:
        """Wait until at most n groups are in flight; `vals` (f32 accumulators) and `ivals` (b32
        A fragments a wgmma may still read: their registers stay theirs until here) flow
        through it."""
        vs = list(vals) + list(ivals)
        return self.asm(f"wgmma.wait_group.sync.aligned {n};", len(vs), vs,
                        types=["f32"] * len(vals) + ["i32"] * len(ivals))

    def fexp2_poly(self, x: str) -> str:
        """2^x on the FMA and integer pipes: n = round(x) by the magic add, 2^(x - n) by
        EXP2_POLY, n added to the exponent field (x clamped at -120: no denormals)."""
        xc = self.fmax(x, self.fconst(-120.0))
        t = self._op("arith.addf", xc, self.fconst(EXP2_MAGIC), "f32")
        f = self._op("arith.subf", xc, self._op("arith.subf", t, self.fconst(EXP2_MAGIC), "f32"), "f32")
        p = self.fconst(EXP2_POLY[3])
        for k in (2, 1, 0):
            r = self._v()
            self.w(f"{r} = math.fma {f}, {p}, {self.fconst(EXP2_POLY[k])} : f32")
            p = r
        ti, pi = self._cast("arith.bitcast", t, "f32", "i32"), self._cast("arith.bitcast", p, "f32", "i32")
        bits = self._op("arith.addi", pi, self._op("arith.shli", ti, self.i32(23), "i32"), "i32")
        return self._cast("arith.bitcast", bits, "i32", "f32")

    def izero(self) -> str:
        return self.i32(0)

    def loop(self, n: str, init: list[str], body: Callable[[Any, list[Any]], list[Any]],
             types: list[str] | None = None) -> list[str]:
        """scf.for 0..n with iter_args of `types` (default f32)."""
        res = self._v()
        kt = f"%kt{self.n}"
        iters = [f"%it{self.n}_{i}" for i in range(len(init))]
        lo, one = self.const(0), self.const(1)
        ts = ", ".join(types or ["f32"] * len(init))
        self.w(f"{res}:{len(init)} = scf.for {kt} = {lo} to {n} step {one} iter_args("
               + ", ".join(f"{a} = {v}" for a, v in zip(iters, init)) + f") -> ({ts}) {{")
        saved = self.consts
        self.consts = dict(saved)
        out = body(kt, iters)
        self.consts = saved
        self.w(f"scf.yield {', '.join(out)} : {ts}\n}}")
        return [f"{res}#{i}" for i in range(len(init))]

    def _wgmma(self, acc: list[str] | None, a: str | list[str], db: str, n: int, trans_b: int) -> list[str]:
        e = self.spec.elem
        k = n // 2  # accumulators a thread
        regs = ", ".join(f"${i}" for i in range(k))
        base = k + (0 if acc is None else k)
        if isinstance(a, list):
            ta = "{" + ", ".join(f"${base + i}" for i in range(len(a))) + "}"
            args = [(x, "r", "i32") for x in a]
            tail = f"{trans_b}"
        else:
            ta, args, tail = f"${base}", [(a, "l", "i64")], f"0, {trans_b}"
        nb = base + len(args)
        ins = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{e}.{e} {{{regs}}}, {ta}, ${nb}, P, 1, 1, {tail};")
        return self.asm("{\n.reg .pred P;\nsetp.ne.b32 P, $" + str(nb + 1) + ", 0;\n" + ins + "\n}", k, acc,
                        [*args, (db, "l", "i64"), (self.i32(0 if acc is None else 1), "r", "i32")])

    def wgmma_ss(self, acc: list[str] | None, da: str, db: str, n: int) -> list[str]:
        """m64nNk16, A and B K-major in shared memory; acc None: D = A B (scale-d off)."""
        return self._wgmma(acc, da, db, n, 0)

    def wgmma_rs(self, acc: list[str], a: list[str], db: str, n: int) -> list[str]:
        """m64nNk16, A from registers (4 x b32), B N-major in shared memory (transposed)."""
        return self._wgmma(acc, a, db, n, 1)

    def pack_i32(self, lo: str, hi: str) -> str:
        """Two f32 rounded to the operand type, as the b32 register of a pair."""
        v, r = self._v(), self._v()
        self.w(f"{v} = vector.bitcast {self.pack_f32(lo, hi)} : vector<2x{self.spec.elem}> to vector<1xi32>")
        self.w(f"{r} = vector.extract {v}[0] : i32 from vector<1xi32>")
        return r

    def store_pair(self, idx: list[str], vals: list[str], ok: str) -> None:
        o = self.spec.o
        self.w(f"scf.if {ok} {{")
        if o.elem != "f32":
            vals = [self._cast("arith.truncf", x, "f32", o.elem) for x in vals]
        v = self._v()
        es = 4 if o.elem == "f32" else 2
        self.w(f"{v} = vector.from_elements {', '.join(vals)} : vector<2x{o.elem}>")
        self.w(f"vector.store {v}, %O[{', '.join(idx)}] {{alignment = {2 * es}}} : {o.type}, vector<2x{o.elem}>\n}}")

    def when(self, cond: str, then: Callable[[], None]) -> None:
        self.w(f"scf.if {cond} {{")
        saved = self.consts
        self.consts = dict(saved)
        then()
        self.consts = saved
        self.w("}")

    def role(self, cond: str, then: Callable[[], None], other: Callable[[], None]) -> None:
        self.w(f"scf.if {cond} {{")
        saved = self.consts
        self.consts = dict(saved)
        then()
        self.consts = dict(saved)
        self.w("} else {")
        other()
        self.consts = saved
        self.w("}")

    def loop0(self, lo: str, hi: str, body: Callable[[Any], None]) -> None:
        iv = f"%kt{self.n}"
        self.n += 1
        self.w(f"scf.for {iv} = {lo} to {hi} step {self.const(1)} {{")
        saved = self.consts
        self.consts = dict(saved)
        body(iv)
        self.consts = saved
        self.w("}")


def tensor_map_type(box: list[int], elem: str, sw: int) -> str:
    return (f"!nvgpu.tensormap.descriptor<tensor = memref<{'x'.join(map(str, box))}x{elem}, 3>, "
            f"swizzle = swizzle_{sw}b, l2promo = l2promo_256b, oob = zero, interleave = none>")


def template(spec: Spec, p: Plan) -> str:
    """`func.func @tmpl(%Q, %K, %V, %O)`: the TMA descriptors (data for the runtime), then the
    gpu.launch."""
    b = _WgText(spec, p)
    kernel(b, spec, p)
    e = spec.elem
    nb = len(spec.batch)
    head = [f"func.func @tmpl(%Q: {spec.q.type}, %K: {spec.k.type}, %V: {spec.v.type}, %O: {spec.o.type}) {{"]
    casts = []
    for which, buf, rows, sw in (("Q", spec.q, p.bm, p.sw_qk), ("K", spec.k, p.bn, p.sw_qk), ("V", spec.v, p.bn, p.sw_v)):
        box = [1] * nb + [rows, sw // 2]
        tm = tensor_map_type(box, e, sw)
        head.append(f"%u{which} = memref.cast %{which} : {buf.type} to memref<*x{e}>")
        head += [f"%bx{which}{i} = arith.constant {n} : index" for i, n in enumerate(box)]
        head.append(f"%tm{which}d = nvgpu.tma.create.descriptor %u{which} box["
                    + ", ".join(f"%bx{which}{i}" for i in range(len(box))) + f"] : memref<*x{e}> -> {tm}")
        casts.append(f"%tm{which} = builtin.unrealized_conversion_cast %tm{which}d : {tm} to !llvm.ptr")
    gx, gy, gz = p.grid
    head += [
        f"%one = arith.constant 1 : index\n%gx = arith.constant {gx} : index",
        f"%gy = arith.constant {gy} : index\n%gz = arith.constant {gz} : index",
        f"%nt = arith.constant {p.threads} : index",
        f"%smem = arith.constant {layout(spec, p).total} : i32",
        ("gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
         "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
         "dynamic_shared_memory_size %smem {"),
    ]
    return "\n".join(head + casts + b.lines + ["gpu.terminator\n}\nreturn\n}"])
