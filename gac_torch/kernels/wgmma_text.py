"""The text builder of the Hopper GEMM (wgmma_gemm.py's kernel body emits MLIR through it):
PTX through llvm.inline_asm for what the NVVM dialect spells differently across MLIR releases
(mbarrier, TMA, wgmma, setmaxnreg), the rest as arith / memref / vector / scf ops."""

from __future__ import annotations

import os
from typing import Any

from gac_torch.kernels import gemm_epilogue
from gac_torch.kernels.builder import Text
from gac_torch.kernels.conv_gemm import _addr, _split
from gac_torch.kernels.cuda_mma import Spec
from gac_torch.kernels.wgmma_plan import ESIZE, ALIGN, Plan, Side, descriptor


# 5c: accumulators whose epilogue loads are issued together: 16 (8 before: a 1x1 conv's
# residual read one memory latency per 8, ~3x its DRAM time on the H200) while their registers
# stay within EPILOGUE_LOAD_REGS (16 per operand along M, 8 per column operand: a chunk's 16
# accumulators span 8 columns), else 8 and no pairs, as before (ResNet's block-3 conv with the
# downsample's unfolded BatchNorm fused: 80, spilled; at 8 with pairs, 16 bytes); 8 with A in
# registers (16 spilled there); GAC_WGMMA_EPILOGUE_CHUNK overrides
EPILOGUE_CHUNK, EPILOGUE_CHUNK_SMALL, EPILOGUE_LOAD_REGS = 16, 8, 40


class WgmmaText(gemm_epilogue.TextMixin, Text):
    epilogue_chunk = EPILOGUE_CHUNK
    def __init__(self, spec: Spec, p: Plan, init_type: str):
        super().__init__(hoist=True)
        self.spec, self.p, self.init_type = spec, p, init_type
        self.batch = "%bz"  # the current tile's batch index

    def i32(self, x: int) -> str:
        return self.const(x, "i32")

    def to_i32(self, x: str) -> str:
        return self.cast("arith.index_cast", x, "index", "i32")

    def i32_add(self, x: str, y: str) -> str:
        return self.binop("arith.addi", x, y, "i32")

    def i32_mul(self, x: str, y: str) -> str:
        return self.binop("arith.muli", x, y, "i32")

    def xor(self, x: str, y: str) -> str:
        return self.binop("arith.xori", x, y)

    def lds_tf32x2(self, addr: str) -> list[str]:
        """Two adjacent f32 from shared `addr` (8-byte aligned), each rounded to tf32 (cvt.rna: as
        mma.sync's operands)."""
        return self.asm("{\n.reg .f32 F, G;\nld.shared.v2.f32 {F, G}, [$2];\ncvt.rna.tf32.f32 $0, F;\n"
                        "cvt.rna.tf32.f32 $1, G;\n}", args=[(addr, "r", "i32")], results=2)

    def opaque_f32(self, x: str) -> str:
        """A copy of f32 `x` the compiler cannot rematerialize or move across other asm."""
        r = self.fresh()
        self.w(f'{r} = llvm.inline_asm has_side_effects asm_dialect = att "mov.b32 $0, $1;", "=f,f" {x} : (f32) -> f32')
        return r

    def xor1(self, x: str) -> str:
        return self.binop("arith.xori", x, self.i32(1), "i32")

    def asm(self, text: str, tied: list[str] | None = None, args: list[tuple[str, str, str]] = (),
            results: int = 0) -> list[str]:
        """One llvm.inline_asm with side effects. `args`: (value, constraint, type); `tied`:
        f32 values that are outputs and inputs at once (the accumulators)."""
        tied = tied or []
        n = len(tied) + results
        cons = ["=f"] * len(tied) + ["=r"] * results + [str(i) for i in range(len(tied))]
        cons += [a[1] for a in args]
        ops = list(tied) + [a[0] for a in args]
        types = ["f32"] * len(tied) + [a[2] for a in args]
        text = text.replace("\n", "\\0A")
        if n == 0:
            self.w(f'llvm.inline_asm has_side_effects asm_dialect = att "{text}", "{",".join(cons)}" '
                   f'{", ".join(ops)} : ({", ".join(types)}) -> ()')
            return []
        r = self.fresh()
        rt = ("!llvm.struct<(" + ", ".join(["f32"] * len(tied) + ["i32"] * results) + ")>") if n > 1 else (
            "f32" if tied else "i32")
        self.w(f'{r} = llvm.inline_asm has_side_effects asm_dialect = att "{text}", "{",".join(cons)}" '
               f'{", ".join(ops)} : ({", ".join(types)}) -> {rt}')
        if n == 1:
            return [r]
        out = []
        for i in range(n):
            x = self.fresh()
            self.w(f"{x} = llvm.extractvalue {r}[{i}] : {rt}")
            out.append(x)
        if tied:  # the accumulators flow on as the asm's results
            tied[:] = out[:len(tied)]
        return out

    def smem_base(self) -> str:
        """The dynamic shared memory's address, rounded up to ALIGN (i32, shared window)."""
        d, p = self.fresh(), self.fresh()
        self.w(f"{d} = gpu.dynamic_shared_memory : memref<?xi8, #gpu.address_space<workgroup>>")
        self.w(f"{p} = memref.extract_aligned_pointer_as_index {d} : memref<?xi8, #gpu.address_space<workgroup>> -> index")
        a = self.to_i32(p)
        up = self.i32_add(a, self.i32(ALIGN - 1))
        return self.binop("arith.andi", up, self.i32(-ALIGN), "i32")

    def mbar_init(self, bar: str, count: int) -> None:
        self.asm("mbarrier.init.shared::cta.b64 [$0], $1;", args=[(bar, "r", "i32"), (self.i32(count), "r", "i32")])

    def mbar_expect(self, bar: str, nbytes: int) -> None:
        self.asm("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
                 args=[(bar, "r", "i32"), (self.i32(nbytes), "r", "i32")])

    def mbar_arrive(self, bar: str) -> None:
        self.asm("mbarrier.arrive.shared::cta.b64 _, [$0];", args=[(bar, "r", "i32")])

    def mbar_wait(self, bar: str, parity: str, cluster: bool = False) -> None:
        """Spin until the phase of `parity` completed (cluster: acquiring the peer CTA's
        releases too)."""
        sem = ".acquire.cluster" if cluster else ""
        self.asm("{\n.reg .pred P1;\nWAIT:\nmbarrier.try_wait.parity" + sem + ".shared::cta.b64 P1, [$0], $1;\n"
                 "@!P1 bra WAIT;\n}", args=[(bar, "r", "i32"), (parity, "r", "i32")])

    def mbar_arrive_remote(self, bar: str, rank: str) -> None:
        """Arrive on the barrier at `bar`'s offset in CTA `rank` of the cluster."""
        self.asm("{\n.reg .b32 R;\nmapa.shared::cluster.u32 R, $0, $1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [R];\n}",
                 args=[(bar, "r", "i32"), (self.to_i32(rank), "r", "i32")])

    def cluster_rank(self) -> str:
        r = self.asm("mov.u32 $0, %cluster_ctarank;", results=1)[0]
        return self.cast("arith.index_cast", r, "i32", "index")

    def cluster_barrier(self) -> None:
        self.asm("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;")

    def tma_load(self, which: str, dst: str, coords: list[str], bar: str, multicast: int = 0) -> None:
        """A box at `coords` into shared `dst`, bytes counted on `bar`; `multicast`: a mask of
        cluster CTAs that each receive it at the same offsets (and count it on their `bar`)."""
        n = len(coords)
        cs = ", ".join(f"${i + 2}" for i in range(n))
        mc = ".multicast::cluster" if multicast else ""
        mask = f", ${n + 3}" if multicast else ""
        self.asm(f"cp.async.bulk.tensor.{n}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes{mc} "
                 f"[$0], [$1, {{{cs}}}], [${n + 2}]{mask};",
                 args=[(dst, "r", "i32"), (f"%tm{which}", "l", "!llvm.ptr"),
                       *[(self.to_i32(x), "r", "i32") for x in coords], (bar, "r", "i32"),
                       *([(self.const(multicast, "i16"), "h", "i16")] if multicast else [])])

    def tma_store(self, which: str, src: str, coords: list[str]) -> None:
        """The box at shared `src` to the tensor at `coords` (innermost first; the part outside
        the tensor is not written), in the thread's bulk async-group."""
        n = len(coords)
        cs = ", ".join(f"${i + 1}" for i in range(n))
        self.asm(f"cp.async.bulk.tensor.{n}d.global.shared::cta.bulk_group [$0, {{{cs}}}], [${n + 1}];",
                 args=[(f"%tm{which}", "l", "!llvm.ptr"), *[(self.to_i32(x), "r", "i32") for x in coords],
                       (src, "r", "i32")])

    def desc(self, smem: str, base: int, side: Side, s: str, layout: tuple[int, int, int],
             part: str | None, part_bytes: int) -> str:
        """The i64 descriptor of stage `s`'s tile + `layout`'s offset (+ part * part_bytes:
        a consumer's rows of A, whole 8-row atoms, so the swizzle phase is unchanged)."""
        off, lbo, sbo = layout
        addr = self.i32_add(smem, self.i32_add(self.i32(base + off), self.i32_mul(self.to_i32(s), self.i32(side.stage_bytes))))
        if part is not None:
            addr = self.i32_add(addr, self.i32_mul(self.to_i32(part), self.i32(part_bytes)))
        a64 = self.cast("arith.extui", addr, "i32", "i64")
        lo = self.binop("arith.shrui", self.binop("arith.andi", a64, self.const(0x3FFFF, "i64"), "i64"),
                        self.const(4, "i64"), "i64")
        return self.binop("arith.ori", lo, self.const(descriptor(0, lbo, sbo), "i64"), "i64")

    def wgmma(self, accs: list[str], da: str | list[str], db: str) -> list[str]:
        """One wgmma on the accumulators; A by descriptor `da`, or (a list) from registers."""
        spec, p = self.spec, self.p
        n = len(accs)
        regs = ", ".join(f"${i}" for i in range(n))
        # operands: the n outputs, the n tied inputs, then A (descriptor or registers), B's
        # descriptor and the scale-d flag
        na = len(da) if isinstance(da, list) else 1
        da_, db_, sd = 2 * n, 2 * n + na, 2 * n + na + 1
        a_args = [(r, "r", "i32") for r in da] if isinstance(da, list) else [(da, "l", "i64")]
        if isinstance(da, list):
            a_regs = "{" + ", ".join(f"${da_ + i}" for i in range(na)) + "}"
            ins = f"wgmma.mma_async.sync.aligned.m64n{p.bn}k8.f32.tf32.tf32 {{{regs}}}, {a_regs}, ${db_}, P, 1, 1;"
        elif spec.kind == "tf32":
            ins = f"wgmma.mma_async.sync.aligned.m64n{p.bn}k8.f32.tf32.tf32 {{{regs}}}, ${da_}, ${db_}, P, 1, 1;"
        else:
            ta, tb = int(not p.a.k_major), int(not p.b.k_major)
            ins = (f"wgmma.mma_async.sync.aligned.m64n{p.bn}k16.f32.{spec.kind}.{spec.kind} "
                   f"{{{regs}}}, ${da_}, ${db_}, P, 1, 1, {ta}, {tb};")
        acc = list(accs)
        self.asm("{\n.reg .pred P;\nsetp.ne.b32 P, $" + str(sd) + ", 0;\n" + ins + "\n}", acc,
                 [*a_args, (db, "l", "i64"), (self.i32(1), "r", "i32")])
        return acc

    def loop(self, lo: str, hi: str, body: Any) -> None:
        iv = self.fresh()
        self.w(f"scf.for {iv} = {lo} to {hi} step {self.const(1)} {{")
        body(iv)
        self.w("}")

    def if_else(self, cond: str, then: Any, else_: Any) -> None:
        self.w(f"scf.if {cond} {{")
        then()
        self.w("} else {")
        else_()
        self.w("}")

    def _to_f32(self, x: str, ty: str) -> str:
        return x if ty == "f32" else self.cast("arith.extf", x, ty, "f32")

    def init_f32(self) -> str:
        return self._to_f32("%init", self.init_type)

    def _cidx(self, row: str, col: str) -> list[str]:
        spec = self.spec
        at = {spec.m: row, spec.n: col}
        return [at.get(d, self.batch) for d in spec.c.dims]

    def _inside(self, row: str, col: str) -> str:
        return self.and_(self.lt(row, self.const(self.spec.M)), self.lt(col, self.const(self.spec.N)))

    def _c_at(self, row: str, col: str) -> tuple[str, str, list[str]]:
        """C[row, col] as (memref, its type, indices): the memref over the contraction's dims
        (a conv's ConvText: its flat view)."""
        return "%C", self.spec.c.type, self._cidx(row, col)

    def load_c(self, row: str, col: str) -> str:
        return self.if_(self._inside(row, col), "f32",
                        lambda: self._to_f32(self.load(*self._c_at(row, col)), self.spec.c.elem),
                        lambda: self.const(0.0, "f32"))

    def _round(self, v: str) -> str:
        ec = self.spec.c.elem
        return v if ec == "f32" else self.cast("arith.truncf", v, "f32", ec)

    def _locator(self, row: str, col: str) -> Any:
        """Where an epilogue operand (Operand, space) is read / written for C[row, col]: over
        the contraction's dims (space None) directly; over its own space, delinearised from
        the flat index in C (the f32 scratch the consumer read: dense)."""
        spec = self.spec
        at = {spec.m: row, spec.n: col, **{d: self.batch for d in spec.batch}}
        flat = None
        for d, stride in zip(spec.c.dims, spec.c.strides):
            term = self.mul(at[d], self.const(stride))
            flat = term if flat is None else self.add(flat, term)
        spaces: dict[tuple[int, ...], Any] = {}

        def locate(x: tuple[Any, tuple[int, ...] | None]) -> str:
            op, shape = x
            if shape is None:
                return _addr(self, op, at, tuple(at), self.const(op.const))
            dims = tuple(range(len(shape)))
            if shape not in spaces:
                spaces[shape] = _split(self, flat, dims, shape)
            return _addr(self, op, spaces[shape], dims, self.const(op.const))

        return locate

    def _varies_along_m(self, x: tuple[Any, tuple[int, ...] | None] | None) -> bool:
        return x is not None and not (x[1] is None and self._const_along_m(x[0]))

    def _light_epilogue(self) -> bool:
        """Whether a chunk of EPILOGUE_CHUNK accumulators' operand loads fit in
        EPILOGUE_LOAD_REGS registers (see there)."""
        ins = [x for x in self.spec.epilogue.inputs if x is not None]
        along_m = sum(map(self._varies_along_m, ins))
        return EPILOGUE_CHUNK * along_m + EPILOGUE_CHUNK // 2 * (len(ins) - along_m) <= EPILOGUE_LOAD_REGS

    def _pairable(self, x: tuple[Any, tuple[int, ...] | None]) -> bool:
        """An operand read (written) two columns at a time, one 2-element vector per FRAG_C
        column pair: over the contraction's dims, contiguous along N, each pair's first element
        at an even address, N even (a pair is inside the matrix iff its first element is); a
        light epilogue only. GAC_WGMMA_EPILOGUE_PAIRS=0: never."""
        op, n = x[0], self.spec.n
        return (x[1] is None and self.spec.N % 2 == 0 and op.coef[n] == 1 and (op.offset + op.const) % 2 == 0
                and self._light_epilogue()
                and all(k % 2 == 0 for d, k in enumerate(op.coef) if d != n)
                and os.environ.get("GAC_WGMMA_EPILOGUE_PAIRS") != "0")

    def _operand_loads(self, points: list[tuple[str, str]], first: int, wanted: Any) -> list[dict[int, str]]:
        """Per accumulator first + j at points[j]: {k: value} of the epilogue operands k that
        `wanted(k, x)`, branch-free (outside the matrix: element 0; an operand constant along M
        guarded by its column only); pairable ones for accumulators 2i, 2i + 1 in one load."""
        spec, zero, ep = self.spec, self.const(0), self.spec.epilogue
        out: list[dict[int, str]] = [{} for _ in points]
        for j, (row, col) in enumerate(points):
            ok = locate = None
            for k, x in enumerate(ep.inputs):
                if x is None or k in out[j] or not wanted(j, k, x):
                    continue
                if locate is None:
                    ok, locate = self._inside(row, col), self._locator(row, col)
                guard = ok if self._varies_along_m(x) else self.lt(col, self.const(spec.N))
                addr = self.select(guard, locate(x), zero, "index")
                if (first + j) % 2 == 0 and j + 1 < len(points) and self._pairable(x):
                    out[j][k], out[j + 1][k] = self.load_e2(k, addr)
                else:
                    out[j][k] = self.load_e(k, addr)
        return out

    def epilogue_prefetch(self, points: list[tuple[str, str]]) -> list[dict[int, str]]:
        """5c, issued before the main loop: the epilogue operands that vary along M (a
        residual) of the accumulators at `points`, so their memory latency passes under the
        MMAs (a short K's whole tile time otherwise: one latency per chunk). Safe ahead of the
        tile's stores as in epilogue_store_all."""
        return self._operand_loads(points, 0, lambda j, k, x: self._varies_along_m(x))

    def epilogue_store_all(self, points: list[tuple[str, str]], vals: list[str],
                           pre: list[dict[int, str]] | None = None) -> None:
        """5c: accumulator vals[n] of C at points[n] (row, col) through the fused epilogue
        (gemm_epilogue's steps), EPILOGUE_CHUNK at a time: first the chunk's operand loads
        (those not prefetched, `pre`), then per accumulator (pair, when the output is
        pairable), inside only, the body and the store. A load after a store waits for it
        (the compiler cannot tell they do not alias): a memory latency per chunk. Loading
        ahead of earlier stores is safe: an operand reads Z's buffer only at the element its
        own accumulator writes (epilogue._consumer)."""
        ep = self.spec.epilogue
        light = self._light_epilogue()
        n = int(os.environ.get("GAC_WGMMA_EPILOGUE_CHUNK", 0)) or min(self.epilogue_chunk, (
            EPILOGUE_CHUNK if not self.p.a_regs and light else EPILOGUE_CHUNK_SMALL))
        n += n % 2
        pre = pre or []
        pair_out = self._pairable(ep.out)
        for s in range(0, len(vals), n):
            part = points[s:s + n]
            have = [pre[s + j] if s + j < len(pre) else {} for j in range(len(part))]
            loaded = self._operand_loads(part, s, lambda j, k, x: k not in have[j])
            todo = []
            for j, ((row, col), v) in enumerate(zip(part, vals[s:s + n])):
                args = [None if x is None else {**loaded[j], **have[j]}[k] for k, x in enumerate(ep.inputs)]
                todo.append((self._inside(row, col), args, self._locator(row, col)(ep.out), v))
            step = 2 if pair_out else 1
            for j in range(0, len(todo), step):
                ok, _, z, _ = todo[j]
                self.begin_if(ok)
                ys = [self.body_value(v, args) for _, args, _, v in todo[j:j + step]]
                if len(ys) == 2:
                    self.store_e2(z, ys[0], ys[1])
                else:
                    for (_, _, z1, _), y in zip(todo[j:j + step], ys):
                        self.store_e(z1, y)
                self.end_if()

    def body_value(self, v: str, args: list[str | None]) -> str:
        """The epilogue body on accumulator `v` (rounded to C's type: args[k] None) and the
        other operands' values args[k]: the value stored to Z."""
        ep = self.spec.epilogue
        vals = [self.round_to(v, self.spec.c.elem) if a is None else a for a in args]
        results: list[str] = []
        for op in ep.ops:
            results.append(self.eop(op, [self._ref(r, vals, results) for r in op.args]))
        return self._ref(ep.result, vals, results)

    def column_loads(self, points: list[tuple[str, str]], skip: int) -> list[dict[int, str]]:
        """5d: per point, the epilogue operands constant along M (all but operand `skip`)."""
        return self._operand_loads(points, 0, lambda j, k, x: k != skip)

    def lds_pair(self, addr: str, elem: str) -> tuple[str, str]:
        """Two adjacent `elem` values from shared `addr` (aligned to their pair)."""
        if ESIZE[elem] == 4:
            lo, hi = self.asm("ld.shared.v2.b32 {$0, $1}, [$2];", args=[(addr, "r", "i32")], results=2)
            return tuple(self.cast("arith.bitcast", x, "i32", elem) for x in (lo, hi))  # type: ignore[return-value]
        w = self.asm("ld.shared.b32 $0, [$1];", args=[(addr, "r", "i32")], results=1)[0]
        v, h = self.fresh(), self.fresh()
        self.w(f"{v} = vector.from_elements {w} : vector<1xi32>")
        self.w(f"{h} = vector.bitcast {v} : vector<1xi32> to vector<2x{elem}>")
        return self._extract(h, 0, elem), self._extract(h, 1, elem)

    def sts_pair(self, addr: str, v0: str, v1: str, elem: str) -> None:
        if ESIZE[elem] == 4:
            lo, hi = (self.cast("arith.bitcast", x, elem, "i32") for x in (v0, v1))
            self.asm("st.shared.v2.b32 [$0], {$1, $2};", args=[(addr, "r", "i32"), (lo, "r", "i32"), (hi, "r", "i32")])
            return
        x, w = self.fresh(), self.fresh()
        self.w(f"{x} = vector.from_elements {v0}, {v1} : vector<2x{elem}>")
        self.w(f"{w} = vector.bitcast {x} : vector<2x{elem}> to vector<1xi32>")
        y = self._extract_i32(w)
        self.asm("st.shared.b32 [$0], $1;", args=[(addr, "r", "i32"), (y, "r", "i32")])

    def _extract_i32(self, v: str) -> str:
        r = self.fresh()
        self.w(f"{r} = vector.extract {v}[0] : i32 from vector<1xi32>")
        return r

    def lds_chunk(self, addr: str) -> list[str]:
        """16 bytes from shared `addr` as four i32."""
        return self.asm("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", args=[(addr, "r", "i32")], results=4)

    def store_z_chunk(self, regs: list[str], row: str, col: str) -> None:
        """5d: 16 bytes of the staged output (`regs`, lds_chunk's) to Z at C[row, col..] (inside
        the matrix: the chunk is wholly inside, N being whole chunks); without an epilogue, to C."""
        ep = getattr(self.spec, "epilogue", None)
        elem = ep.out[0].elem if ep is not None else self.spec.c.elem

        def st() -> None:
            v, h = self.fresh(), self.fresh()
            self.w(f"{v} = vector.from_elements {', '.join(regs)} : vector<4xi32>")
            n = 16 // ESIZE[elem]
            self.w(f"{h} = vector.bitcast {v} : vector<4xi32> to vector<{n}x{elem}>")
            if ep is None:
                c, ct, idx = self._c_at(row, col)
                self.w(f"vector.store {h}, {c}[{', '.join(idx)}] {{alignment = 16}} : {ct}, vector<{n}x{elem}>")
                return
            z = self._locator(row, col)(ep.out)
            self.w(f"vector.store {h}, %Zf[{z}] {{alignment = 16}} : {ep.out[0].flat}, vector<{n}x{elem}>")

        self.when(self._inside(row, col), st)

    def load_e2(self, k: int, addr: str) -> tuple[str, str]:
        """Epilogue operand k's elements addr, addr + 1 (addr even: one aligned vector load)."""
        op = self.spec.epilogue.inputs[k][0]
        v = self.fresh()
        self.w(f"{v} = vector.load %E{k}f[{addr}] {{alignment = {2 * ESIZE[op.elem]}}} : {op.flat}, vector<2x{op.elem}>")
        return tuple(self._extract(v, i, op.elem) for i in (0, 1))  # type: ignore[return-value]

    def _extract(self, v: str, i: int, elem: str) -> str:
        r = self.fresh()
        self.w(f"{r} = vector.extract {v}[{i}] : {elem} from vector<2x{elem}>")
        return r

    def store_e2(self, addr: str, v0: str, v1: str) -> None:
        op = self.spec.epilogue.out[0]
        x = self.fresh()
        self.w(f"{x} = vector.from_elements {v0}, {v1} : vector<2x{op.elem}>")
        self.w(f"vector.store {x}, %Zf[{addr}] {{alignment = {2 * ESIZE[op.elem]}}} : {op.flat}, vector<2x{op.elem}>")

    def _const_along_m(self, op: Any) -> bool:
        return op.coef[self.spec.m] == 0

    def _ref(self, r: tuple, args: list[str], results: list[str]) -> str:
        return args[r[1]] if r[0] == "arg" else results[r[1]] if r[0] == "op" else self.econst(r[1], r[2])

    def store_c(self, row: str, col: str, v: str) -> None:
        self.when(self._inside(row, col), lambda: self.store(self._round(v), *self._c_at(row, col)))

    def smem_store_pair(self, addr: str, v0: str, v1: str) -> None:
        ec = self.spec.c.elem
        x, w = self.fresh(), self.fresh()
        self.w(f"{x} = vector.from_elements {self._round(v0)}, {self._round(v1)} : vector<2x{ec}>")
        self.w(f"{w} = vector.bitcast {x} : vector<2x{ec}> to vector<1xi32>")
        y = self.fresh()
        self.w(f"{y} = vector.extract {w}[0] : i32 from vector<1xi32>")
        self.asm("st.shared.b32 [$0], $1;", args=[(addr, "r", "i32"), (y, "r", "i32")])

    def store_chunk(self, addr: str, row: str, col: str) -> None:
        """16 bytes of staged C (8 halves) from shared `addr` to C[row, col..col+7]."""
        ec, ct = self.spec.c.elem, self.spec.c.type
        regs = self.asm("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", args=[(addr, "r", "i32")], results=4)

        def st() -> None:
            v, h = self.fresh(), self.fresh()
            self.w(f"{v} = vector.from_elements {', '.join(regs)} : vector<4xi32>")
            self.w(f"{h} = vector.bitcast {v} : vector<4xi32> to vector<8x{ec}>")
            self.w(f"vector.store {h}, %C[{', '.join(self._cidx(row, col))}] {{alignment = 16}} : {ct}, vector<8x{ec}>")

        self.when(self._inside(row, col), st)

    def store_pair(self, row: str, col: str, v0: str, v1: str) -> None:
        ec = self.spec.c.elem

        def st() -> None:
            x = self.fresh()
            self.w(f"{x} = vector.from_elements {self._round(v0)}, {self._round(v1)} : vector<2x{ec}>")
            c, ct, idx = self._c_at(row, col)
            self.w(f"vector.store {x}, {c}[{', '.join(idx)}] {{alignment = {2 * ESIZE[ec]}}}"
                   f" : {ct}, vector<2x{ec}>")

        self.when(self._inside(row, col), st)
