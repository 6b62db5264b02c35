"""Stream-K for the exact-f32 implicit-GEMM kernel (conv_gemm.py; planned by
conv_gemm_plan.streamk): the last, partial wave of tiles spread evenly over every co-resident
block, so that no SM idles while others run one more tile.

Work is counted in (tile, K slice) iterations, tiles in the grid's order (n fastest, then m,
then batch), `nk` slices each. With W = `Plan.sk_workers` and the first S = `Plan.sk_tiles`
tiles stream-K's (I = S * nk iterations), block i < W (a worker) runs iterations
[i I / W, (i + 1) I / W) -- a contiguous range, floor-divided: its segments are the tail of one
tile, whole tiles, the head of another -- and block W + d runs tile S + d whole.

A segment covering a whole tile stores (or runs the fused epilogue) as the plain kernel. A
split tile's contributors are the workers w_first .. w_last whose ranges meet it; each writes
its partial accumulators to workspace slot 2 w (its first segment) or 2 w + 1 (its last),
fences, and takes a ticket from the tile's counter (one atomic add by thread 0). The block that
draws the last ticket -- whichever finishes last: no block waits for another, nothing can
deadlock -- re-reads every contributor's slot, its own included, adds them in worker order
(bit-identical whoever is last), resets the counter to 0 for the next call and stores once.

Buffers (template arguments after the epilogue's): %W, f32 [2 W x BM x BN], slot s, accumulator
a, thread t at (s * accs + a) * threads + t (coalesced); %F, i32 [S], zero at the launch (the
strategy zeroes it with a fill kernel before; the last contributor re-zeroes its counter). The
ticket's broadcast is one f32 in a padding column of A's shared buffer 0 (never a tile cell).

Builder verbs: `sk_loop`, `sk_if` (block-uniform scf.if with results), `sk_when`, `ws_store`, `ws_load`,
`fence`, `ticket`, `clear`, `flag_put`, `flag_get` (`TextMixin` / `NumpyMixin`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels.builder import Smem


def _nk(spec: Any, p: Any) -> int:
    return -(-spec.K // p.bk)


def schedule(spec: Any, p: Any) -> list[list[tuple[int, int, int]]]:
    """Per block, its segments (tile, first slice, end slice): the kernel's mapping in Python
    (tests check every iteration is covered once)."""
    W, nk = p.sk_workers, _nk(spec, p)
    I = p.sk_tiles * nk
    out = []
    for i in range(p.grid[0]):
        start, end = (i * I // W, (i + 1) * I // W) if i < W else ((p.sk_tiles + i - W) * nk, (p.sk_tiles + i - W + 1) * nk)
        segs = []
        for t in range(start // nk, (end - 1) // nk + 1):
            segs.append((t, max(start - t * nk, 0), min(end - t * nk, nk)))
        out.append(segs)
    return out


def workspace(spec: Any, p: Any) -> tuple[int, int]:
    """(f32 elements of %W, i32 counters of %F)."""
    return 2 * p.sk_workers * p.bm * p.bn, p.sk_tiles


@dataclass
class Seg:
    """One segment of a block's range: slices [k0, k0 + nk) of tile t (index values)."""

    k0: Any
    nk: Any
    finish: Callable[[list[Any], Callable[[list[Any]], None]], None]


def run(b: Any, spec: Any, p: Any, tile: Callable[[Any, Any, Any, Seg], None]) -> None:
    """The block's segments in order, each `tile(bx, by, bz, seg)`."""
    c = b.const
    W, nk, T = p.sk_workers, _nk(spec, p), p.threads
    I = p.sk_tiles * nk
    gx, gy = -(-spec.N // p.bn), -(-spec.M // p.bm)
    i, tid = b.bid(0), b.tid()
    sk = b.lt(i, c(W))
    # (the unselected side may wrap: index arithmetic, never used)
    start = b.select(sk, b.div(b.mul(i, c(I)), c(W)), b.add(b.mul(i, c(nk)), c(I - W * nk)), "index")
    end = b.select(sk, b.div(b.mul(b.add(i, c(1)), c(I)), c(W)), b.add(start, c(nk)), "index")
    t0 = b.div(start, c(nk))
    nseg = b.sub(b.add(b.div(b.sub(end, c(1)), c(nk)), c(1)), t0)

    def worker(g: Any) -> Any:  # the worker whose range holds iteration g: max w, w I / W <= g
        return b.div(b.sub(b.mul(b.add(g, c(1)), c(W)), c(1)), c(I))

    def slot(w: Any, t: Any) -> Any:  # 2 w, or 2 w + 1 when t is not the worker's first tile
        first = b.div(b.div(b.mul(w, c(I)), c(W)), c(nk))
        return b.add(b.mul(w, c(2)), b.select(b.eq(t, first), c(0), c(1), "index"))

    def segment(j: Any) -> None:
        b.barrier()  # (the previous segment's last slice read a buffer this one's prologue fills)
        t = b.add(t0, j)
        tnk = b.mul(t, c(nk))
        k0 = b.select(b.eq(j, c(0)), b.sub(start, tnk), c(0), "index")
        k1 = b.min_(b.sub(end, tnk), c(nk))
        count = b.sub(k1, k0)

        def finish(accs: list[Any], store: Callable[[list[Any]], None]) -> None:
            n = len(accs)
            f32 = ["f32"] * n

            def at(s: Any, a: int) -> Any:
                return b.add(b.mul(b.add(b.mul(s, c(n)), c(a)), c(T)), tid)

            def fix() -> list[Any]:
                own = slot(i, t)
                for a, v in enumerate(accs):
                    b.ws_store(at(own, a), v)
                b.fence()  # (release: the partials before the ticket)
                b.barrier()
                lo, hi = worker(tnk), worker(b.add(tnk, c(nk - 1)))

                def draw() -> None:
                    last = b.eq(b.ticket(t), b.sub(hi, lo))
                    b.when(last, lambda: b.clear(t))
                    b.flag_put(b.select(last, c(1.0, "f32"), c(0.0, "f32"), "f32"))

                b.when(b.eq(tid, c(0)), draw)
                b.barrier()
                last = b.flag_get()

                def total() -> list[Any]:
                    b.fence()  # (acquire: every contributor's partials after its ticket)
                    first = [b.ws_load(at(slot(lo, t), a)) for a in range(n)]

                    def add(w: Any, acc: list[Any]) -> list[Any]:
                        s = slot(w, t)
                        return [b.addf(x, b.ws_load(at(s, a))) for a, x in enumerate(acc)]

                    return b.for_(b.add(lo, c(1)), b.add(hi, c(1)), c(1), first, f32, add) + [last]

                return b.sk_if(last, f32 + ["i1"], total, lambda: list(accs) + [last])

            out = b.sk_if(b.lt(count, c(nk)), f32 + ["i1"], fix, lambda: list(accs) + [b.lt(c(0), c(1))])
            b.sk_when(out[-1], lambda: store(out[:-1]))

        tile(b.rem(t, c(gx)), b.rem(b.div(t, c(gx)), c(gy)), b.div(t, c(gx * gy)), Seg(k0, count, finish))

    b.sk_loop(nseg, segment)


class TextMixin:
    """The MLIR text verbs (conv_gemm_text._Text); %W / %F are the workspace arguments."""

    def _ws_types(self) -> tuple[str, str]:
        w, f = workspace(self.spec, self.p)
        return f"memref<{w}xf32>", f"memref<{f}xi32>"

    def sk_loop(self, n: str, body: Callable[[Any], None]) -> None:
        iv = self.val(f"%sk{self.n}")
        self.n += 1
        self.w(f"scf.for {iv} = {self.const(0)} to {n} step {self.const(1)} {{")
        self._scoped(lambda: body(iv))
        self.w("}")

    def sk_if(self, cond: str, types: list[str], then: Callable[[], list[str]],
              else_: Callable[[], list[str]]) -> list[str]:
        r = self.fresh()
        self.w(f"{r}:{len(types)} = scf.if {cond} -> ({', '.join(types)}) {{")
        for i, fn in enumerate((then, else_)):
            if i:
                self.w("} else {")
            self._scoped(lambda fn=fn: self.w(f"scf.yield {', '.join(fn())} : {', '.join(types)}"))
        self.w("}")
        return [self.val(f"{r}#{k}") for k in range(len(types))]

    def sk_when(self, cond: str, then: Callable[[], None]) -> None:
        self.when(cond, then)

    def addf(self, x: str, y: str) -> str:
        return self.binop("arith.addf", x, y, "f32")

    def ws_store(self, addr: str, val: str) -> None:
        self.w(f"memref.store {val}, %W[{addr}] : {self._ws_types()[0]}")

    def ws_load(self, addr: str) -> str:
        r = self.fresh()
        self.w(f"{r} = memref.load %W[{addr}] : {self._ws_types()[0]}")
        return r

    def fence(self) -> None:
        self.w('llvm.inline_asm has_side_effects asm_dialect = att "fence.acq_rel.gpu;", "" : () -> ()')

    def ticket(self, t: str) -> str:
        r, x = self.fresh(), self.fresh()
        self.w(f"{r} = memref.atomic_rmw addi {self.const(1, 'i32')}, %F[{t}] : (i32, {self._ws_types()[1]}) -> i32")
        self.w(f"{x} = arith.index_cast {r} : i32 to index")
        return x

    def clear(self, t: str) -> None:
        self.w(f"memref.store {self.const(0, 'i32')}, %F[{t}] : {self._ws_types()[1]}")

    def _flag_at(self) -> str:
        return f"%SA[{self.const(0)}, {self.const(0)}, {self.const(self.p.a.cols)}]"

    def flag_put(self, val: str) -> None:
        self.w(f"memref.store {val}, {self._flag_at()} : {self.smem['A']}")

    def flag_get(self) -> str:
        v, r = self.fresh(), self.fresh()
        self.w(f"{v} = memref.load {self._flag_at()} : {self.smem['A']}")
        self.w(f"{r} = arith.cmpf one, {v}, {self.const(0.0, 'f32')} : f32")
        return r


class NumpyMixin:
    """The numpy twin's verbs (conv_gemm_twin._Numpy): blocks run one after another, so the
    last ticket goes to the block emulated last (`emulate(order=...)` varies it); %W starts NaN
    (a read of a slot nobody wrote is caught)."""

    W: np.ndarray
    F: np.ndarray
    S: dict[str, Smem]

    def sk_loop(self, n: Any, body: Callable[[Any], None]) -> None:
        for j in range(int(np.asarray(n).flat[0])):
            body(self.const(j))

    def sk_if(self, cond: Any, types: list[str], then: Callable[[], list[Any]],
              else_: Callable[[], list[Any]]) -> list[Any]:
        cond = np.asarray(cond)
        assert (cond == cond.flat[0]).all(), "stream-K branches are block-uniform"
        return list(then() if cond.flat[0] else else_())

    def sk_when(self, cond: Any, then: Callable[[], None]) -> None:
        self.sk_if(cond, [], lambda: then() or [], lambda: [])

    def addf(self, x: Any, y: Any) -> Any:
        return (np.asarray(x, np.float32) + np.asarray(y, np.float32)).astype(np.float32)

    def ws_store(self, addr: Any, val: Any) -> None:
        at = np.asarray(addr)[self.mask]
        assert ((at >= 0) & (at < self.W.size)).all(), "workspace store out of bounds"
        assert len(np.unique(at)) == len(at), "two threads store one workspace element"
        self.W[at] = np.asarray(val, np.float32)[self.mask]

    def ws_load(self, addr: Any) -> Any:
        at = np.asarray(addr)
        assert ((at >= 0) & (at < self.W.size)).all(), "workspace load out of bounds"
        out = self.W[at]
        assert not np.isnan(out[self.mask]).any(), "workspace read of a partial nobody wrote"
        return out.astype(np.float32)

    def fence(self) -> None:
        pass

    def ticket(self, t: Any) -> Any:
        lanes = np.flatnonzero(self.mask)
        assert len(lanes) == 1, "one ticket per block"
        k = int(np.asarray(t).flat[lanes[0]])
        old = int(self.F[k])
        self.F[k] += 1
        return self.const(old)

    def clear(self, t: Any) -> None:
        for lane in np.flatnonzero(self.mask):
            self.F[int(np.asarray(t).flat[lane])] = 0

    def _flag_idx(self) -> list[Any]:
        return [self.const(0), self.const(0), self.const(self.p.a.cols)]

    def flag_put(self, val: Any) -> None:
        s = self.S["A"]
        for at in self.touch(s, self._flag_idx(), 1, True, lanes=self.mask.copy()):
            s.data[at] = np.asarray(val, np.float32)[self.mask]

    def flag_get(self) -> Any:
        return self.smem_load(self.S["A"], self._flag_idx()) != 0


def zero_template(n: int) -> str:
    """`func.func @tmpl(%F, %init)`: a launch that zeroes the n i32 tile counters."""
    t = f"memref<{n}xi32>"
    return "\n".join([
        f"func.func @tmpl(%F: {t}, %init: f32) {{",
        f"%one = arith.constant 1 : index\n%gx = arith.constant {-(-n // 256)} : index\n%nt = arith.constant 256 : index",
        "gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %one, %sgz = %one) "
        "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) {",
        "%c256 = arith.constant 256 : index\n%i0 = arith.muli %bx, %c256 : index\n%i = arith.addi %i0, %tid : index",
        f"%n = arith.constant {n} : index\n%ok = arith.cmpi ult, %i, %n : index",
        f"scf.if %ok {{\n%z = arith.constant 0 : i32\nmemref.store %z, %F[%i] : {t}\n}}",
        "gpu.terminator\n}\nreturn\n}"])
