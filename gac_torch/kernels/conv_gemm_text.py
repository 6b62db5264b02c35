"""The MLIR text builder of kernels/conv_gemm.py's implicit-GEMM kernel: cuda_mma's, plus flat
global access, cp.async staging, ldmatrix fragments, scalar shared stores and FMAs; `template`
wraps the kernel in the `func.func @tmpl` that backends/gpu/strategy.splice_template takes."""

from __future__ import annotations

import dataclasses

from gac_torch.kernels import cuda_mma as mma
from gac_torch.kernels import conv_gemm_streamk, gemm_epilogue
from gac_torch.kernels.builder import WORKGROUP
from gac_torch.kernels.conv_gemm import Spec, kernel
from gac_torch.kernels.conv_gemm_plan import ESIZE, Plan, smem_bytes, smem_elem


class _Text(conv_gemm_streamk.TextMixin, gemm_epilogue.TextMixin, mma.MmaText):
    def __init__(self, spec: Spec, p: Plan):
        super().__init__(spec, p)  # type: ignore[arg-type]
        self.e = smem_elem(spec.kind)
        self.smem = {w: f"memref<{p.stages}x{s.rows}x{s.cols + s.pad}x{self.e}, {WORKGROUP}>"
                     for w, s in (("A", p.a), ("B", p.b))}
        self.copies: list[str] = []  # cp.async tokens since the last commit
        self.group: str | None = None  # the prologue's first group token (dominates the loop)

    def cp_async(self, which: str, idx: list[str], addr: str, vec: int, ok: str) -> None:
        """cp.async of `vec` elements at flat index addr to shared [buf, row, col]; outside
        (not ok): 0 source elements, the hardware writes zeros and reads nothing."""
        op = self.spec.a if which == "A" else self.spec.b
        at, n, t = self.fresh(), self.fresh(), self.fresh()
        self.w(f"{at} = arith.select {ok}, {addr}, {self.const(0)} : index")
        self.w(f"{n} = arith.select {ok}, {self.const(vec)}, {self.const(0)} : index")
        l1 = " {bypassL1}" if vec * ESIZE[op.elem] == 16 else ""
        self.w(f"{t} = nvgpu.device_async_copy %{which}f[{at}], %S{which}[{', '.join(idx)}], {vec}, {n}{l1} "
               f": {op.flat} to {self.smem[which]}")
        self.copies.append(t)

    def ldmatrix(self, which: str, idx: list[str], num: int, trans: bool) -> list[str]:
        """ldmatrix.sync.aligned.m8n8.x{num}[.trans].b16: this lane's row address is shared
        [buf, row, col]; returns num registers as vector<2 x elem>."""
        st = self.p.a if which == "A" else self.p.b
        off = self.fresh()
        self.w(f"{off} = affine.apply affine_map<(d0, d1, d2) -> (((d0 * {st.rows} + d1) * {st.cols + st.pad} + d2) * 2)>"
               f"({', '.join(idx)})")
        return self.ldmatrix_at(f"%S{which}", self.smem[which], off, num, trans, self.e)

    def cp_commit(self) -> None:
        g = self.fresh()
        self.w(f"{g} = nvgpu.device_async_create_group {', '.join(self.copies)}")
        self.copies = []
        if self.group is None:
            self.group = g

    def cp_wait(self, n: int) -> None:
        # (the token is any group's: the instruction waits until at most n groups are pending)
        self.w(f"nvgpu.device_async_wait {self.group} {{numGroups = {n} : i32}}")

    def round_tf32_1(self, x: str) -> str:
        q, f = self.fresh(), self.fresh()
        self.w(f"{q} = nvvm.convert.float.to.tf32 {x} {{rnd = #nvvm.fp_rnd_mode<rna>}}")
        self.w(f"{f} = arith.bitcast {q} : i32 to f32")
        return f

    def load_flat(self, which: str, addr: str, vec: int, ok: str) -> str:
        # branch-free: outside the tile, load element 0 (always valid) and select zero, so all
        # of a slice's loads can be in flight at once
        op = self.spec.a if which == "A" else self.spec.b
        vt = f"vector<{vec}x{op.elem}>"
        at, ld, z, r = self.fresh(), self.fresh(), self.fresh(), self.fresh()
        self.w(f"{at} = arith.select {ok}, {addr}, {self.const(0)} : index")
        self.w(f"{ld} = vector.load %{which}f[{at}] {{alignment = {vec * ESIZE[op.elem]}}} : {op.flat}, {vt}")
        self.w(f"{z} = arith.constant dense<0.0> : {vt}")
        self.w(f"{r} = arith.select {ok}, {ld}, {z} : {vt}")
        return r

    def inb(self, x: str, upper: str) -> str:
        return self.lt(x, upper)  # unsigned: a negative index is huge

    def extract(self, val: str, j: int, vec: int) -> str:
        r = self.fresh()
        self.w(f"{r} = vector.extract {val}[{j}] : {self.e} from vector<{vec}x{self.e}>")
        return r

    def store_smem1(self, which: str, idx: list[str], val: str) -> None:
        self.w(f"memref.store {val}, %S{which}[{', '.join(idx)}] : {self.smem[which]}")

    def fma(self, x: str, y: str, acc: str) -> str:
        p, s = self.fresh(), self.fresh()  # contract: LLVM fuses these into one fma.rn.f32
        self.w(f"{p} = arith.mulf {x}, {y} fastmath<contract> : f32")
        self.w(f"{s} = arith.addf {acc}, {p} fastmath<contract> : f32")
        return s

    def load_cflat(self, addr: str, ok: str) -> str:
        return self.load_c_at("%Cf", addr, self.spec.c.flat, ok)

    def store_cflat(self, addr: str, val: str, ok: str, add: bool = False) -> None:
        if not add:
            return self.store_c_at("%Cf", addr, self.spec.c.flat, val, ok)
        self.w(f"scf.if {ok} {{")  # split-K: an f32 C, red.global.add
        self.w(f"  {self.fresh()} = memref.atomic_rmw addf {val}, %Cf[{addr}] : (f32, {self.spec.c.flat}) -> f32\n}}")


def template(spec: Spec, p: Plan) -> str:
    """`func.func @tmpl(%A, %B, %C, %init)` holding the gpu.launch (see the banner)."""
    b = _Text(spec, p)
    kernel(b, spec, p)
    gx, gy, gz = p.grid
    ep = spec.epilogue
    extra = [] if ep is None else ([(f"E{k}", x[0]) for k, x in enumerate(ep.inputs) if x is not None]
                                   + [(f"T{t}", x[0]) for t, (_, x) in enumerate(ep.taps)] + [("Z", ep.out[0])])
    if p.sk_workers:  # stream-K's workspace: partial sums, tile counters (conv_gemm_streamk.py)
        extra += [("W", b._ws_types()[0]), ("F", b._ws_types()[1])]
    flat = []
    uses_c = ep is None or not spec.fill  # C is read (init) or written (no epilogue)
    for name, op in (("A", spec.a), ("B", spec.b), *([("C", spec.c)] if uses_c else []), *extra):
        if name in ("W", "F"):
            continue
        flat.append(f"%{name}f = memref.reinterpret_cast %{name} to offset: [{op.offset}], "
                    f"sizes: [{op.span}], strides: [1] : {op.type} to {op.flat}")
    if p.dynamic:  # one dynamic buffer, A's tiles then B's (16-byte aligned: whole rows)
        a_bytes = smem_bytes(dataclasses.replace(p, b=dataclasses.replace(p.b, rows=0)), spec)
        smem = [f"%smem = arith.constant {smem_bytes(p, spec)} : i32"]
        launch_smem = "dynamic_shared_memory_size %smem "
        bufs = ["%dsm = gpu.dynamic_shared_memory : memref<?xi8, #gpu.address_space<workgroup>>",
                f"%offA = arith.constant 0 : index\n%offB = arith.constant {a_bytes} : index",
                f"%SA = memref.view %dsm[%offA][] : memref<?xi8, {WORKGROUP}> to {b.smem['A']}",
                f"%SB = memref.view %dsm[%offB][] : memref<?xi8, {WORKGROUP}> to {b.smem['B']}"]
        attrib = ""
    else:
        smem, launch_smem, bufs = [], "", []
        attrib = f"workgroup(%SA : {b.smem['A']}, %SB : {b.smem['B']}) "
    head = [
        f"func.func @tmpl(%A: {spec.a.type}, %B: {spec.b.type}, %C: {spec.c.type}, "
        + "".join(f"%{n}: {op if n in ('W', 'F') else op.type}, " for n, op in extra) + f"%init: {spec.c.elem}) {{",
        f"%one = arith.constant 1 : index\n%gx = arith.constant {gx} : index",
        f"%gy = arith.constant {gy} : index\n%gz = arith.constant {gz} : index",
        f"%nt = arith.constant {p.threads} : index", *smem,
        ("gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = %gz) "
         f"threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) {launch_smem}{attrib}{{"),
        *bufs,
        *flat,
    ]
    return "\n".join(head + b.lines + ["gpu.terminator\n}\nreturn\n}"])
