"""The text builder of the Hopper implicit-GEMM conv (wgmma_conv.py): wgmma_text's, with the
producer's 16-byte cp.async (zero-filled by a source size of 0) and C / the fused epilogue's
operands addressed through the conv's dims (flat views, conv_gemm.Operand's linear forms: a row
of the GEMM is (n, oh, ow), a column f); `template` wraps the kernel for splice_template."""

from __future__ import annotations

import os
from typing import Any

from gac_torch.kernels.conv_gemm import Operand, Spec, _addr, _split
from gac_torch.kernels.wgmma_conv import Window, WindowHooks, gather, narrow
from gac_torch.kernels.wgmma_gemm import _kernel, launch_lines, tensor_map_lines
from gac_torch.kernels.wgmma_plan import ALIGN, ESIZE, Plan
from gac_torch.kernels.wgmma_text import WgmmaText

_WG = "#gpu.address_space<workgroup>"


def _merges(op: Operand, dims: tuple[int, ...], ranges: tuple[int, ...]) -> bool:
    """op's address is linear in the merged index of `dims` (last fastest): coef[d_i] =
    coef[d_i+1] * range[d_i+1] (a dense NHWC output or residual; 0 throughout: a per-channel
    vector)."""
    return all(op.coef[dims[i]] == op.coef[dims[i + 1]] * ranges[dims[i + 1]] for i in range(len(dims) - 1))


STEM_CHANNELS = 16  # a conv whose innermost K dim is at most this: a stem (padded, or on 2x2 blocks)


def pairs(spec: Spec) -> bool:
    """The fused epilogue reads and writes two columns at a time (8-byte f32 accesses, half the
    store instructions) on an RGB stem's conv: its tiles are short (K = 196) and store 147 MB
    (ResNet-50 at 6x3x480x800), so the epilogue's accesses weigh; not yet checked on the other
    convs' registers. GAC_CONV_WGMMA_PAIRS=1: every conv, 0: none."""
    flag = os.environ.get("GAC_CONV_WGMMA_PAIRS")
    return flag == "1" or (flag != "0" and spec.ranges[spec.ks[-1]] <= STEM_CHANNELS)


class ConvText(WgmmaText):
    spec: Spec  # type: ignore[assignment]

    @property
    def epilogue_chunk(self) -> int:  # type: ignore[override]
        """Accumulators whose epilogue loads go together: each chunk's loads wait for the last
        chunk's stores (one memory latency per chunk: 16 of them per 128 x 128 tile at 4). 4
        under 168 registers (8: a BatchNorm epilogue on a 128-wide tile spilled); 16 with a
        Window's setmaxnreg (232 for the consumers: wgmma_conv.plan)."""
        return 16 if getattr(self.p, "window", None) is not None and self.p.maxnreg else 4

    def _part(self, op: Operand, dims: tuple[int, ...], idx: str) -> str:
        """op's address part of merged index `idx` over `dims`: a multiple of idx where the
        layout merges them, else through the dims' indices."""
        r = self.spec.ranges
        if _merges(op, dims, r):
            k = op.coef[dims[-1]]
            return self.const(0) if k == 0 else idx if k == 1 else self.mul(idx, self.const(k))
        return _addr(self, op, _split(self, idx, dims, r), dims)

    def _flat_at(self, op: Operand, row: str, col: str) -> str:
        s = self.spec
        return self.add(self.add(self.const(op.const), self._part(op, s.ms, row)), self._part(op, s.ns, col))

    def _const_along_m(self, op: Any) -> bool:
        return all(op.coef[d] == 0 for d in self.spec.ms)

    # The GEMM's epilogue prefetch and two-column accesses were tuned on the 1x1 GEMMs and are
    # not checked for the conv's registers (168, no setmaxnreg) or its merged M/N addresses.
    def epilogue_prefetch(self, points: list[tuple[str, str]]) -> list[dict[int, str]]:
        return []

    def _pairable(self, x: Any) -> bool:
        """Two columns per access (the GEMM's pairs) where `pairs` allows: an operand over the
        conv's dims, unit-stride along its one N dim, every other term even."""
        s, op = self.spec, x[0]
        n_in = [d for d in s.ns if s.ranges[d] > 1]
        return (pairs(s) and x[1] is None and len(n_in) == 1 and op.coef[n_in[0]] == 1 and s.N % 2 == 0
                and (op.offset + op.const) % 2 == 0 and self._light_epilogue()
                and all(k % 2 == 0 for d, k in enumerate(op.coef) if d != n_in[0] and s.ranges[d] > 1))

    def inb(self, x: str, upper: str) -> str:
        return self.lt(x, upper)  # unsigned: a negative index is huge

    def smem_base(self) -> str:
        """wgmma_text's aligned base (i32), and %SM: the same bytes as elements, the view the
        producers' device_async_copy writes into."""
        base = super().smem_base()
        d = self.fresh()
        self.w(f"{d} = gpu.dynamic_shared_memory : memref<?xi8, {_WG}>")
        raw = self.fresh()
        self.w(f"{raw} = memref.extract_aligned_pointer_as_index {d} : memref<?xi8, {_WG}> -> index")
        shift = self.sub(self.cast("arith.index_cast", base, "i32", "index"), raw)
        self.w(f"%SM = memref.view {d}[{shift}][] : memref<?xi8, {_WG}> to {self._sm_type()}")
        self.sbase = base
        return base

    def _sm_type(self) -> str:
        es = ESIZE[self.spec.a.elem]
        return f"memref<{(self.p.smem_bytes - ALIGN) // es}x{self.spec.a.elem}, {_WG}>"

    @property
    def a_in_l1(self) -> bool:
        """A's copies go through L1 (cp.async.ca) when a window reads its rows again: the next
        kw's tile is the same rows one pixel on (3x3: a 128-row tile shares 127 with the one
        two slices back). GAC_CONV_WGMMA_A_L1=0: .cg, as B (being measured)."""
        s = self.spec
        return os.environ.get("GAC_CONV_WGMMA_A_L1") != "0" and any(s.ranges[d] > 1 for d in s.ks[:-1])

    def cp16(self, which: str, dst: str, addr: str, ok: str) -> None:
        """16 bytes from flat element `addr` of %{which}'s view to shared byte `dst` (cp.async,
        .cg; A's .ca: `a_in_l1`); outside (not ok): a source size of 0, nothing read, zeros
        written."""
        op = self.spec.a if which == "A" else self.spec.b
        es = ESIZE[op.elem]
        vec = 16 // es
        at = self.select(ok, addr, self.const(0), "index")
        n = self.select(ok, self.const(vec), self.const(0), "index")
        idx = self.div(self.cast("arith.index_cast", self.binop("arith.subi", dst, self.sbase, "i32"), "i32", "index"),
                       self.const(es))
        t, l1 = self.fresh(), "" if which == "A" and self.a_in_l1 else " {bypassL1}"
        self.w(f"{t} = nvgpu.device_async_copy %{which}f[{at}], %SM[{idx}], {vec}, {n}{l1} "
               f": {op.flat} to {self._sm_type()}")

    def _c_at(self, row: str, col: str) -> tuple[str, str, list[str]]:
        c = self.spec.c
        return "%Cf", c.flat, [self._flat_at(c, row, col)]

    def _locator(self, row: str, col: str) -> Any:
        """Where an epilogue operand (Operand, space) is read / written for C[row, col]: over
        the conv's dims (space None) directly; over its own space, delinearised from the flat
        index in C (the dense scratch the consumer read)."""
        spaces: dict[tuple[int, ...], Any] = {}
        flat: list[str] = []

        def locate(x: tuple[Any, tuple[int, ...] | None]) -> str:
            op, shape = x
            if shape is None:
                return self._flat_at(op, row, col)
            if not flat:
                flat.append(self._flat_at(self.spec.c, row, col))
            dims = tuple(range(len(shape)))
            if shape not in spaces:
                spaces[shape] = _split(self, flat[0], dims, shape)
            return _addr(self, op, spaces[shape], dims, self.const(op.const))

        return locate


class _I32:
    """ConvText's verbs the producers' gather uses, on i32 values (every index and address it
    forms fits 31 bits: `wgmma_conv.narrow`): half the integer work of 64-bit `index` math."""

    def __init__(self, b: ConvText):
        self.b = b

    def const(self, x: int, ty: str = "index") -> str:
        return self.b.i32(x)

    def _op(self, op: str, x: str, y: str) -> str:
        return self.b.binop(op, x, y, "i32")

    def add(self, x: str, y: str) -> str:
        return self._op("arith.addi", x, y)

    def mul(self, x: str, y: str) -> str:
        return self._op("arith.muli", x, y)

    def div(self, x: str, y: str) -> str:
        return self._op("arith.divui", x, y)

    def rem(self, x: str, y: str) -> str:
        return self._op("arith.remui", x, y)

    def xor(self, x: str, y: str) -> str:
        return self._op("arith.xori", x, y)

    def lt(self, x: str, y: str) -> str:  # unsigned: a negative index is huge
        r = self.b.fresh()
        self.b.w(f"{r} = arith.cmpi ult, {x}, {y} : i32")
        return r

    inb = lt

    def and_(self, x: str, y: str) -> str:
        return self.b.and_(x, y)

    def to_i32(self, x: str) -> str:
        return x

    def i32_add(self, x: str, y: str) -> str:
        return self.b.i32_add(x, y)

    def cp16(self, which: str, dst: str, addr: str, ok: str) -> None:
        at = self.b.select(ok, addr, self.b.i32(0), "i32")
        self.b.cp16(which, dst, self.b.cast("arith.index_cast", at, "i32", "index"), ok)


def _producer(b: ConvText, spec: Spec, p: Plan) -> Any:
    """wgmma_gemm._kernel's gather hook: wgmma_conv.gather, on i32 where it fits."""
    if not narrow(spec):
        return gather(b, spec, p)
    inner = gather(_I32(b), spec, p)

    def hook(t: str, a_stage: str, b_stage: str, m0: str, n0: str, kt: str) -> None:
        inner(b.to_i32(t), a_stage, b_stage, b.to_i32(m0), b.to_i32(n0), b.to_i32(kt))

    return hook


def _tensor_maps(spec: Spec, win: Window, p: Plan) -> tuple[list[str], list[str]]:
    """The host lines of A's 4-D (5-D) and B's 2-D TMA descriptors over the Window's views (boxes
    Window.box and [BN, BK] (a cluster's half: [BN / 2, BK])), and the kernel's casts of them."""
    head, casts = [], []
    for which, op, (off, sizes, strides), box in (
            ("A", spec.a, win.a_view, win.box(p.bk)), ("B", spec.b, win.b_view, [p.bn // p.cluster, p.bk])):
        shape = "x".join(map(str, sizes))
        view = f"memref<{shape}x{op.elem}, strided<[{', '.join(map(str, strides))}], offset: {off}>>"
        head.append(f"%{which}v = memref.reinterpret_cast %{which} to offset: [{off}], sizes: "
                    f"[{', '.join(map(str, sizes))}], strides: [{', '.join(map(str, strides))}] : {op.type} to {view}")
        lines, cast = tensor_map_lines(which, f"%{which}v", view, box, op.elem)
        head += lines
        casts.append(cast)
    return head, casts


def template(spec: Spec, p: Plan, init_type: str | None = None) -> str:
    """`func.func @tmpl(%A, %B, %C, [%E.., %Z,] %init)` holding the gpu.launch (see
    wgmma_conv's banner); tensor maps for a Window's boxes, else none: the producers address A
    and B themselves."""
    init_type = init_type or spec.c.elem
    b = ConvText(spec, p, init_type)  # type: ignore[arg-type]
    win = getattr(p, "window", None)
    if win is not None:
        _kernel(b, spec, p, conv=WindowHooks(b, win, p.bk))  # type: ignore[arg-type]
    else:
        _kernel(b, spec, p, _producer(b, spec, p))  # type: ignore[arg-type]
    ep = spec.epilogue
    extra = [] if ep is None else [(f"E{k}", x[0]) for k, x in enumerate(ep.inputs) if x is not None] + [("Z", ep.out[0])]
    uses_c = ep is None or not spec.fill  # C is read (init) or written (no epilogue)
    flat = [f"%{n}f = memref.reinterpret_cast %{n} to offset: [{op.offset}], sizes: [{op.span}], strides: [1] "
            f": {op.type} to {op.flat}" for n, op in (("A", spec.a), ("B", spec.b), *([("C", spec.c)] if uses_c else []), *extra)]
    maps, casts = _tensor_maps(spec, win, p) if win is not None else ([], [])
    head = [f"func.func @tmpl(%A: {spec.a.type}, %B: {spec.b.type}, %C: {spec.c.type}, "
            + "".join(f"%{n}: {op.type}, " for n, op in extra) + f"%init: {init_type}) {{", *maps, *launch_lines(p)]
    return "\n".join(head + casts + flat + b.const_lines + b.lines + ["gpu.terminator\n}\nreturn\n}"])
