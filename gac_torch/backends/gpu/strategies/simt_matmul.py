"""`matmul`: a contraction with one M, one N, one K dim (+ batch dims) whose body is
`out + cast(a) * cast(b)`: a 16x16-thread block computes a (16*TM)x(16*TN) tile (TM, TN up to 8
when the grid still has ~2 waves), K is staged through shared memory 16 deep, each thread
accumulates a TMxTN register tile (f32 for f16/bf16 outputs, as torch does). A fill of the
output right before becomes the accumulators' initial value. Run-time extents take a 64-wide
tile and a host-computed grid."""

from __future__ import annotations

import math

from mlir import ir

from gac_torch.backends.gpu.analysis import Contraction, Generic, fill_before, map_dims, match_contraction
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy, splice_template


def strategy(big_tile_min_blocks: int = 256) -> Strategy:
    """`big_tile_min_blocks`: 128x128 tiles once they still make about two waves."""

    def match(g: Generic, limits: GpuLimits) -> Contraction | None:
        return match_contraction(g)

    def emit(c: Contraction, name: str, limits: GpuLimits) -> bool:
        return _emit_matmul(c, name, limits, big_tile_min_blocks)

    return Strategy("matmul", match, emit)


def _acc_type(elem: str, is_float: bool) -> str:
    # Accumulate low-precision floats in f32 like torch's GEMMs; ints wrap identically in any width.
    return "f32" if is_float and elem in ("f16", "bf16") else elem


def _convert(x: str, src: str, dst: str, is_float: bool, out: str) -> tuple[str, str]:
    """MLIR text converting `x` from element type `src` to `dst`: (lines, name of the result)."""
    if src == dst:
        return "", x
    if is_float:
        if {src, dst} == {"f16", "bf16"}:  # no direct cast between the two halves
            return (f"{out}_w = arith.extf {x} : {src} to f32\n"
                    f"{out} = arith.truncf {out}_w : f32 to {dst}\n", out)
        widths = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
        op = "arith.extf" if widths[dst] > widths[src] else "arith.truncf"
    else:
        op = "arith.extsi" if int(dst[1:]) > int(src[1:]) else "arith.trunci"
    return f"{out} = {op} {x} : {src} to {dst}\n", out


def _emit_matmul(c: Contraction, name: str, limits: GpuLimits, big_tile_min_blocks: int) -> bool:
    g = c.g
    M, N, K = g.ranges[c.m], g.ranges[c.n], g.ranges[c.k]
    batch_ext = [g.ranges[d] for d in c.batch]
    # Run-time extents (None) take a 64-wide tile; the grid is computed on the host per call.
    big = not g.dynamic and (-(-M // 128) * -(-N // 128) * math.prod(batch_ext)  # type: ignore
                             >= big_tile_min_blocks)
    tm = 8 if big else 4 if M is None or M >= 64 else 2 if M >= 32 else 1  # (16*tm) x (16*tn) tile
    tn = 8 if big else 4 if N is None or N >= 64 else 2 if N >= 32 else 1
    tt, bk = 16, 16  # a 16x16 thread block; K staged 16 deep through shared memory
    bm, bn = tt * tm, tt * tn
    if not g.dynamic:
        grid = (-(-N // bn), -(-M // bm), math.prod(batch_ext))  # type: ignore[operator]
        if any(x > lim for x, lim in zip(grid, limits.max_grid)) or 0 in grid or K == 0:
            return False
    ta, tb = (str(v.type) for v in g.inputs)
    tc = str(g.outputs[0].type)
    ea, eb = (str(ir.MemRefType(v.type).element_type) for v in g.inputs)
    ec = str(ir.MemRefType(g.outputs[0].type).element_type)
    acc = _acc_type(ec, c.is_float)
    acc_bytes = {"f16": 2, "bf16": 2, "f32": 4, "i32": 4, "f64": 8, "i64": 8}.get(acc, 4)
    if bk * (bm + bn) * acc_bytes > limits.max_static_shared_bytes:
        return False
    fill = fill_before(g.op, g.outputs[0])
    zero = "0.0" if c.is_float else "0"
    mul, add = ("arith.mulf", "arith.addf") if c.is_float else ("arith.muli", "arith.addi")
    fm = " fastmath<contract>" if c.is_float else ""  # lets LLVM form FMAs
    sa = f"memref<{bk}x{bm}x{acc}, #gpu.address_space<workgroup>>"
    sb = f"memref<{bk}x{bn}x{acc}, #gpu.address_space<workgroup>>"

    def idx(m: ir.AffineMap, names: dict[int, str]) -> str:
        return ", ".join(names[d] for d in map_dims(m))  # type: ignore[union-attr]

    bnames = {d: f"%bi{j}" for j, d in enumerate(c.batch)}
    a_names = {**bnames, c.m: "%am", c.k: "%ak"}
    b_names = {**bnames, c.n: "%bn", c.k: "%bk"}
    c_names = {**bnames, c.m: "%cm", c.n: "%cn"}

    def casts(x: str, chain: list[tuple[str, str]], src: str, out: str) -> tuple[str, str]:
        text, cur, ty = "", x, src
        for i, (op, rt) in enumerate(chain):
            text += f"{out}_{i} = {op} {cur} : {ty} to {rt}\n"
            cur, ty = f"{out}_{i}", rt
        more, cur = _convert(cur, ty, acc, c.is_float, f"{out}_acc")
        return text + more, cur

    lines: list[str] = []
    w = lines.append
    w(f"func.func @tmpl(%A: {ta}, %B: {tb}, %C: {tc}, %init: {ec}) {{")
    w("%one = arith.constant 1 : index")

    def extent(ssa: str, d: int) -> None:  # host side: a constant or the buffer's run-time dim
        if g.ranges[d] is not None:
            w(f"{ssa} = arith.constant {g.ranges[d]} : index")
            return
        buf, pos = g.sources[d]
        operand, ty = {g.inputs[0]: ("%A", ta), g.inputs[1]: ("%B", tb)}.get(buf, ("%C", tc))
        w(f"{ssa}_pos = arith.constant {pos} : index\n{ssa} = memref.dim {operand}, {ssa}_pos : {ty}")

    extent("%cM", c.m)
    extent("%cN", c.n)
    extent("%cK", c.k)
    for j, d in enumerate(c.batch):
        extent(f"%bext{j}", d)
    w(f"%hbm = arith.constant {bm} : index\n%hbn = arith.constant {bn} : index")
    w("%gx = arith.ceildivui %cN, %hbn : index\n%gy = arith.ceildivui %cM, %hbm : index")
    gz = "%one"
    for j in range(len(batch_ext)):
        w(f"%gzb{j} = arith.muli {gz}, %bext{j} : index")
        gz = f"%gzb{j}"
    w(f"%nt = arith.constant {tt * tt} : index")
    w(f"gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %gy, %sgz = {gz}) "
      "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) "
      f"workgroup(%As : {sa}, %Bs : {sb}) {{")
    w("%c0 = arith.constant 0 : index\n%c1 = arith.constant 1 : index")
    w(f"%ctt = arith.constant {tt} : index\n%cbk = arith.constant {bk} : index")
    w(f"%cbm = arith.constant {bm} : index\n%cbn = arith.constant {bn} : index")
    w(f"%zero = arith.constant {zero} : {acc}")
    w("%tr = arith.divui %tid, %ctt : index\n%tc = arith.remui %tid, %ctt : index")
    w("%m0 = arith.muli %by, %cbm : index\n%n0 = arith.muli %bx, %cbn : index")
    rest = "%bz"
    for j in range(len(batch_ext) - 1, -1, -1):  # delinearize the batch index, last fastest
        if j == 0:
            w(f"%bi0 = arith.addi {rest}, %c0 : index")
        else:
            w(f"%bi{j} = arith.remui {rest}, %bext{j} : index")
            w(f"%bq{j} = arith.divui {rest}, %bext{j} : index")
            rest = f"%bq{j}"
    # Accumulator (i, j) is output (tr + 16 i, tc + 16 j): conflict-free shared-memory reads,
    # coalesced stores.
    accs = [(i, j) for i in range(tm) for j in range(tn)]
    for i in range(tm):
        w(f"%ro{i} = arith.constant {i * tt} : index\n%rr{i} = arith.addi %tr, %ro{i} : index")
        w(f"%cm{i} = arith.addi %m0, %rr{i} : index\n%mok{i} = arith.cmpi ult, %cm{i}, %cM : index")
    for j in range(tn):
        w(f"%co{j} = arith.constant {j * tt} : index\n%cc{j} = arith.addi %tc, %co{j} : index")
        w(f"%cn{j} = arith.addi %n0, %cc{j} : index\n%nok{j} = arith.cmpi ult, %cn{j}, %cN : index")
    text, init = _convert("%init", ec, acc, c.is_float, "%init_acc")
    w(text)
    inits = []
    for i, j in accs:
        if fill is not None:  # the fill right before is folded into the accumulator's start
            inits.append(init)
            continue
        w(f"%ok{i}_{j} = arith.andi %mok{i}, %nok{j} : i1")
        w(f"%init{i}_{j} = scf.if %ok{i}_{j} -> ({acc}) {{")
        w(f"%cm = arith.addi %cm{i}, %c0 : index\n%cn = arith.addi %cn{j}, %c0 : index")
        w(f"%x = memref.load %C[{idx(g.maps[2], c_names)}] : {tc}")
        text, res = _convert("%x", ec, acc, c.is_float, "%xa")
        w(text + f"scf.yield {res} : {acc}\n}} else {{\nscf.yield %zero : {acc}\n}}")
        inits.append(f"%init{i}_{j}")
    acc_names = [f"%acc{i}_{j}" for i, j in accs]
    acc_types = ", ".join([acc] * len(accs))
    w(f"%res:{len(accs)} = scf.for %k0 = %c0 to %cK step %cbk iter_args("
      + ", ".join(f"{a} = {v}" for a, v in zip(acc_names, inits)) + f") -> ({acc_types}) {{")

    def load_tile(which: str, rows: int, tensor: str, ttype: str, elem: str,
                  names: dict[int, str], m: ir.AffineMap, chain: list[tuple[str, str]]) -> None:
        # A rows x bk tile (rows = M or N extent), stored k-major in shared memory. Consecutive
        # threads walk the operand's contiguous dim so the global loads coalesce.
        k_fast = map_dims(m)[-1] == c.k  # type: ignore[index]
        r_name, k_name, lim, base, sh, st = (
            ("%am", "%ak", "%cM", "%m0", "%As", sa) if which == "A"
            else ("%bn", "%bk", "%cN", "%n0", "%Bs", sb))
        for l in range(rows * bk // (tt * tt)):
            p = f"%{which}{l}"
            w(f"{p}off = arith.constant {l * tt * tt} : index\n{p}e = arith.addi %tid, {p}off : index")
            if k_fast:
                w(f"{p}r = arith.divui {p}e, %cbk : index\n{p}k = arith.remui {p}e, %cbk : index")
            else:
                w(f"{p}rows = arith.constant {rows} : index")
                w(f"{p}k = arith.divui {p}e, {p}rows : index\n{p}r = arith.remui {p}e, {p}rows : index")
            w(f"{p}gr = arith.addi {base}, {p}r : index\n{p}gk = arith.addi %k0, {p}k : index")
            w(f"{p}okr = arith.cmpi ult, {p}gr, {lim} : index")
            w(f"{p}okk = arith.cmpi ult, {p}gk, %cK : index\n{p}ok = arith.andi {p}okr, {p}okk : i1")
            w(f"{p}v = scf.if {p}ok -> ({acc}) {{")
            w(f"{r_name} = arith.addi {p}gr, %c0 : index\n{k_name} = arith.addi {p}gk, %c0 : index")
            w(f"%x = memref.load {tensor}[{idx(m, names)}] : {ttype}")
            text, res = casts("%x", chain, elem, "%xc")
            w(text + f"scf.yield {res} : {acc}\n}} else {{\nscf.yield %zero : {acc}\n}}")
            w(f"memref.store {p}v, {sh}[{p}k, {p}r] : {st}")

    load_tile("A", bm, "%A", ta, ea, a_names, g.maps[0], c.a_casts)
    load_tile("B", bn, "%B", tb, eb, b_names, g.maps[1], c.b_casts)
    w("gpu.barrier")
    inner = [f"%i{i}_{j}" for i, j in accs]
    w(f"%part:{len(accs)} = scf.for %kk = %c0 to %cbk step %c1 iter_args("
      + ", ".join(f"{x} = {a}" for x, a in zip(inner, acc_names)) + f") -> ({acc_types}) {{")
    for i in range(tm):
        w(f"%a{i} = memref.load %As[%kk, %rr{i}] : {sa}")
    for j in range(tn):
        w(f"%b{j} = memref.load %Bs[%kk, %cc{j}] : {sb}")
    for i, j in accs:
        w(f"%p{i}_{j} = {mul} %a{i}, %b{j}{fm} : {acc}")
        w(f"%s{i}_{j} = {add} %i{i}_{j}, %p{i}_{j}{fm} : {acc}")
    w("scf.yield " + ", ".join(f"%s{i}_{j}" for i, j in accs) + f" : {acc_types}\n}}")
    w("gpu.barrier")  # the next stage overwrites the tiles
    w("scf.yield " + ", ".join(f"%part#{n}" for n in range(len(accs))) + f" : {acc_types}\n}}")
    for n, (i, j) in enumerate(accs):
        w(f"%oks{i}_{j} = arith.andi %mok{i}, %nok{j} : i1\nscf.if %oks{i}_{j} {{")
        w(f"%cm = arith.addi %cm{i}, %c0 : index\n%cn = arith.addi %cn{j}, %c0 : index")
        text, res = _convert(f"%res#{n}", acc, ec, c.is_float, "%out")
        w(text + f"memref.store {res}, %C[{idx(g.maps[2], c_names)}] : {tc}\n}}")
    w("gpu.terminator\n}\nreturn\n}")
    init_value = fill[1] if fill is not None else None
    splice_template("\n".join(lines), g.op, [*g.inputs, g.outputs[0]], init_value, ec, name)
    if fill is not None:
        fill[0].erase()
    g.op.erase()
    return True
