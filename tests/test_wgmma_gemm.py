"""Hopper GEMM (gac_torch/kernels/wgmma_gemm.py, strategies/wgmma.py), without a GPU: the
shared-memory layout math against a numpy model of TMA's swizzled writes and wgmma's
descriptor reads; the strategy's choice and the PTX (sm_90a, ptxas, no spills)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gac_torch.backends.cuda import ptxas
from gac_torch.backends.gpu.program import BufferRef, KernelLaunch, TensorMapArg, from_json, to_json
from gac_torch.kernels import wgmma_plan as W
from gac_torch.kernels.cuda_mma import FRAG_A8, FRAG_C, Operand, Spec
from cuda_cases import MLIR, Case, compile_case, matmul

# ------------------------------------------------------------------------------------------------
# layout: TMA writes a box swizzled, wgmma reads it back through the kernel's descriptors


def _tma_write(smem: np.ndarray, at: int, box: np.ndarray, es: int) -> None:
    """A TMA box (outer x inner elements, 128-byte rows) written at byte `at` (1024-aligned)
    with the 128-byte swizzle: 16-byte chunk c of row r lands in chunk c ^ (r % 8)."""
    assert at % W.ALIGN == 0
    raw = box.view(np.uint8).reshape(box.shape[0], -1)
    assert raw.shape[1] == W.SWIZZLE
    for r in range(box.shape[0]):
        for chunk in range(8):
            dst = at + r * 128 + ((chunk ^ (r % 8)) * 16)
            smem[dst:dst + 16] = raw[r, chunk * 16:chunk * 16 + 16]


def _wgmma_read(smem: np.ndarray, desc: int, rows: int, k: int, k_major: bool, dtype) -> np.ndarray:
    """The rows x k operand a wgmma reads through descriptor `desc` (PTX ISA "matrix
    descriptor", 128-byte swizzle mode; the canonical layouts as CUTLASS's GmmaDescriptor
    documents them), decoded from the descriptor's bits."""
    es = np.dtype(dtype).itemsize
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    assert desc >> 62 == 1  # 128-byte swizzle
    out = np.zeros((rows, k), dtype=dtype)
    for r in range(rows):
        for kk in range(k):
            if k_major:  # 8-row groups SBO apart, rows 128 B apart, K contiguous
                addr = start + (r // 8) * sbo + (r % 8) * 128 + kk * es
            else:  # 64-element M/N chunks LBO apart, 8-row K groups SBO apart, rows of 128 B
                span = 128 // es
                addr = start + (r // span) * lbo + (kk // 8) * sbo + (kk % 8) * 128 + (r % span) * es
            addr = W.swizzle128(addr)
            out[r, kk] = smem[addr:addr + es].view(dtype)[0]
    return out


@pytest.mark.parametrize("k_major,rows,dtype,split", [
    (True, 128, np.float16, 1), (False, 128, np.float16, 1), (False, 256, np.float16, 1),
    (True, 256, np.float16, 1), (True, 128, np.float32, 1),
    (True, 256, np.float16, 2)])  # a K-major B tile as two boxes (CTA pairs: one each)
def test_descriptors_read_back_what_tma_wrote(k_major: bool, rows: int, dtype, split: int) -> None:
    es = np.dtype(dtype).itemsize
    bk = W.SWIZZLE // es
    ks = 8 if es == 4 else 16
    side = W.Side(k_major, rows, (bk, rows // split) if k_major else (64, bk),
                  split if k_major else rows // 64, rows * bk * es)
    rng = np.random.default_rng(0)
    tile = rng.standard_normal((rows, bk)).astype(dtype)  # [M/N row][k] of one stage
    base = 3 * W.ALIGN  # a stage of the ring
    smem = np.zeros(base + side.stage_bytes + 4096, dtype=np.uint8)
    for off, shift in W.box_origins(side, es):  # 3b: the producer's boxes
        if k_major:  # box [rows / split][k]
            box = tile[shift:shift + side.box[1]]
        else:  # box [k][64 M/N elements]
            box = np.ascontiguousarray(tile[shift:shift + 64, :].T)
        _tma_write(smem, base + off, box, es)
    # 4b: every consumer's rows of A (64 each), all of B's; every K step
    parts = [(0, 64), (64, 64)] if rows == 128 else [(0, rows)]  # A: per consumer; B: whole
    for rows0, n in parts + ([(0, rows)] if rows == 128 and not k_major else []):
        for kstep in range(bk // ks):
            off, lbo, sbo = W.desc_layout(side, es, rows0, kstep)
            got = _wgmma_read(smem, W.descriptor(base + off, lbo, sbo), n, ks, k_major, dtype)
            want = tile[rows0:rows0 + n, kstep * ks:(kstep + 1) * ks]
            np.testing.assert_array_equal(got, want)


def test_layout_model_catches_a_wrong_stride_byte_offset() -> None:
    es = 2
    side = W.Side(True, 128, (64, 128), 1, 128 * 64 * es)
    tile = np.random.default_rng(1).standard_normal((128, 64)).astype(np.float16)
    smem = np.zeros(side.stage_bytes + 2048, dtype=np.uint8)
    _tma_write(smem, 0, tile, es)
    off, lbo, sbo = W.desc_layout(side, es, 0, 1)
    got = _wgmma_read(smem, W.descriptor(off, lbo, sbo // 2), 64, 16, True, np.float16)
    assert not np.array_equal(got, tile[:64, 16:32])


# ------------------------------------------------------------------------------------------------
# strategy choice and PTX

_PTXAS = ptxas.find_ptxas()


def _case(M: int, K: int, N: int, dt: torch.dtype, a_t: bool = False, b_t: bool = False,
          batch: int = 0) -> Case:
    """C = A @ B with A given as [K, M] (a_t) and B as [N, K] (b_t), batched when batch > 0;
    f16/bf16 accumulate in f32 and are rounded after, as the shared lowering does."""
    e = MLIR[dt]
    acc = "f32"
    bs = f"{batch}x" if batch else ""
    d = "d0, " if batch else ""
    dims = "(d0, d1, d2, d3)" if batch else "(d1, d2, d3)"
    am = f"affine_map<{dims} -> ({d}d3, d1)>" if a_t else f"affine_map<{dims} -> ({d}d1, d3)>"
    bm = f"affine_map<{dims} -> ({d}d2, d3)>" if b_t else f"affine_map<{dims} -> ({d}d3, d2)>"
    cm = f"affine_map<{dims} -> ({d}d1, d2)>"
    its = '"parallel", ' * (3 if batch else 2) + '"reduction"'
    ash = (K, M) if a_t else (M, K)
    bsh = (N, K) if b_t else (K, N)
    at, bt = f"tensor<{bs}{ash[0]}x{ash[1]}x{e}>", f"tensor<{bs}{bsh[0]}x{bsh[1]}x{e}>"
    ct, rt = f"tensor<{bs}{M}x{N}x{acc}>", f"tensor<{bs}{M}x{N}x{e}>"
    idm = f"affine_map<({'d0, ' if batch else ''}d1, d2) -> ({'d0, ' if batch else ''}d1, d2)>"
    ext = f"%x = arith.extf %a : {e} to f32\n    %y = arith.extf %b : {e} to f32"
    body = f"""
  %zero = arith.constant 0.0 : f32
  %em = tensor.empty() : {ct}
  %f = linalg.fill ins(%zero : f32) outs(%em : {ct}) -> {ct}
  %mm = linalg.generic {{indexing_maps = [{am}, {bm}, {cm}], iterator_types = [{its}]}} ins(%t0, %t1 : {at}, {bt}) outs(%f : {ct}) {{
  ^bb0(%a: {e}, %b: {e}, %c: f32):
    {ext}
    %p = arith.mulf %x, %y : f32
    %s = arith.addf %c, %p : f32
    linalg.yield %s : f32
  }} -> {ct}"""
    if e == "f32":
        body = body.replace("%mm = ", "%r0 = ").replace(ext, "").replace("%x, %y", "%a, %b")
    else:
        body += f"""
  %eo = tensor.empty() : {rt}
  %r0 = linalg.generic {{indexing_maps = [{idm}, {idm}], iterator_types = [{'"parallel", ' * (2 if batch else 1) + '"parallel"'}]}} ins(%mm : {ct}) outs(%eo : {rt}) {{
  ^bb0(%a: f32, %o: {e}):
    %t = arith.truncf %a : f32 to {e}
    linalg.yield %t : {e}
  }} -> {rt}"""
    shape = lambda s: ((batch,) if batch else ()) + s  # noqa: E731

    def ref(a, b):
        a = a.transpose(-1, -2) if a_t else a
        b = b.transpose(-1, -2) if b_t else b
        return [a @ b]

    return Case(f"gemm_{M}x{K}x{N}_{e}_{int(a_t)}{int(b_t)}_{batch}", [(shape(ash), dt), (shape(bsh), dt)],
                [(shape((M, N)), dt)], body, ref)


@pytest.mark.parametrize("M,K,N,dt,a_t,b_t,batch,bn", [
    (4096, 4096, 4096, torch.bfloat16, False, False, 0, 256),
    (1000, 520, 1032, torch.float16, False, False, 0, 128),
    (136, 72, 264, torch.bfloat16, True, False, 0, 128),
    (200, 136, 264, torch.float16, False, True, 3, 128),
    (200, 136, 262, torch.float16, False, True, 0, 128),  # C rows not 16-byte multiples: pairs
])
def test_wgmma_chosen_and_assembles(M, K, N, dt, a_t, b_t, batch, bn) -> None:
    program = compile_case(_case(M, K, N, dt, a_t, b_t, batch), "sm_90")
    staged = "st.global.v4.b32" in program.ptx  # 5b, else two halves at a time (5)
    assert staged == (N % 8 == 0), staged
    # the TMA descriptors are host-program data: two per launch, read access, JSON round trip
    maps = [a for a in program.launches[0].args if isinstance(a, TensorMapArg)]
    assert [(a.buffer.index, a.swizzle) for a in maps] == [(0, 128), (1, 128)]
    assert from_json(to_json(program)) == program and program.dataflow_errors(2) == []
    # one kernel: the rounding to f16/bf16 happens in its store
    assert [k.strategy for k in program.launches] == ["wgmma"], program.describe()
    assert program.launches[0].block == (W.THREADS, 1, 1)
    ptx = program.ptx
    assert ".target sm_90a" in ptx
    want = {f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{MLIR[dt]}.{MLIR[dt]}"}
    assert {line.split()[0] for line in ptx.splitlines() if line.startswith("wgmma.mma_async")} == want
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait.parity" in ptx
    assert _PTXAS is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
    assert result.ok and " 0 bytes spill stores" in result.log, result.log


class _Ints:
    """The builder verbs `a_frag_offset` uses, on plain ints."""

    const = staticmethod(lambda x: x)
    add = staticmethod(lambda x, y: x + y)
    mul = staticmethod(lambda x, y: x * y)
    div = staticmethod(lambda x, y: x // y)
    rem = staticmethod(lambda x, y: x % y)
    xor = staticmethod(lambda x, y: x ^ y)


def test_register_fragments_read_back_what_tma_wrote() -> None:
    # 4b': tf32 with an M-major A, each thread loads its m64n?k8 A fragment (FRAG_A8) from the
    # swizzled boxes [BK][32 rows] TMA wrote; the kernel adds the K step as kstep * 8 rows
    es, ks = 4, 8
    side = W.Side(False, 128, (32, 32), 4, 128 * 32 * es)
    rng = np.random.default_rng(1)
    tile = rng.standard_normal((128, 32)).astype(np.float32)  # [M row][k] of one stage
    base = 2 * W.ALIGN
    smem = np.zeros(base + side.stage_bytes + 1024, dtype=np.uint8)
    for off, shift in W.box_origins(side, es):
        _tma_write(smem, base + off, np.ascontiguousarray(tile[shift:shift + 32, :].T), es)
    # rows are permuted (a_pair_row): fragment row g is tile row pr, g + 8 is pr + 1, each k's
    # two values one 8-byte load; the store puts FRAG_C's row rq at pr + rq // 8: so the
    # fragment register of (row dr, k dk) must hold tile[pr + dr // 8, k]
    for cw in range(2):
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                row0 = cw * 64 + W.a_pair_row(_Ints, warp, g)
                for kstep in range(32 // ks):
                    regs = []
                    for dk in (0, 4):
                        at = base + W.a_frag_offset(_Ints, side, es, row0, t + dk) + kstep * ks * W.SWIZZLE
                        regs += list(smem[at:at + 2 * es].view(np.float32))
                    for (dr, dk), got in zip(FRAG_A8, regs):
                        assert got == tile[row0 + dr // 8, kstep * ks + t + dk], (cw, warp, lane, dr, dk, kstep)


@pytest.mark.parametrize("M,K,N,a_t,b_t,want,form", [
    (512, 256, 384, False, True, "wgmma", "desc"),  # nn.Linear's B: both K-major
    (512, 256, 384, False, False, "wgmma", "regs"),  # B N-major: C^T = B^T A^T, A from registers
    (1000, 520, 1032, False, False, "wgmma", "regs"),
    (136, 72, 264, True, True, "wgmma", "regs"),  # A M-major: from registers
    (512, 256, 384, True, False, "mma", None),  # A M-major and B N-major: no wgmma tf32 form
])
def test_wgmma_tf32_operand_layouts(M, K, N, a_t, b_t, want, form) -> None:
    case = _case(M, K, N, torch.float32, a_t, b_t)
    case.options = {"allow_tf32": True}
    program = compile_case(case, "sm_90")
    assert [k.strategy for k in program.launches] == [want], program.describe()
    if form is None:
        return
    wg = [ln for ln in program.ptx.splitlines() if ln.startswith("wgmma.mma_async")]
    assert wg and all(".f32.tf32.tf32" in ln for ln in wg)
    assert all(("}, {%r" in ln) == (form == "regs") for ln in wg), wg[0]  # A: registers or descriptor
    assert ("cvt.rna.tf32.f32" in program.ptx) == (form == "regs")
    result = ptxas.assemble(program.ptx, "sm_90a", _PTXAS)
    assert result.ok and " 0 bytes spill stores" in result.log and "serialized" not in result.log, result.log


@pytest.mark.parametrize("M,K,N,arch", [(1000, 520, 1030, "sm_90"),  # B's rows: 2060 B, not 16-aligned
                                        (129, 64, 257, "sm_90"),  # small and unaligned
                                        (1024, 1024, 1024, "sm_80")])  # no wgmma before Hopper
def test_other_gemms_keep_mma(M, K, N, arch) -> None:
    program = compile_case(matmul(M, K, N, torch.bfloat16), arch)
    assert "wgmma" not in {k.strategy for k in program.launches}
    assert ".target sm_90a" not in program.ptx


def test_plan_fits_shared_memory_and_registers() -> None:
    def op(shape, dims):
        return Operand(f"memref<{'x'.join(map(str, shape))}xbf16>", "bf16", dims, shape,
                       tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))), 0)

    spec = Spec("bf16", 0, 1, 2, (), (4096, 4096, 4096), op((4096, 4096), (0, 2)), op((4096, 4096), (2, 1)),
                op((4096, 4096), (0, 1)), True)
    for bn in (128, 256):
        p = W.plan(spec, bn=bn)
        assert p is not None and p.smem_bytes <= W.SMEM_LIMIT and p.stages >= 3
        assert p.tiles == 4096 // bn * 4096 // W.BM and p.grid == (W.SM_COUNT_HINT, 1, 1)
    assert W.PRODUCER_REGS * W.WG + 2 * W.CONSUMER_REGS * W.WG <= 65536


@pytest.mark.parametrize("M,K,N,narrow,want", [
    (144000, 64, 256, True, 128),  # ResNet layer 1's widening 1x1 conv: short K
    (144000, 256, 64, True, 64),  # its narrowing one: N in one 64-wide tile
    (36000, 512, 128, True, 128),
    (36000, 512, 512, True, 256),
    (144000, 256, 64, False, 256),  # GAC_WGMMA_NARROW=0: as before
])
def test_narrow_and_short_gemms_take_narrow_tiles(M, K, N, narrow, want, monkeypatch) -> None:
    def op(shape, dims):
        return Operand(f"memref<{'x'.join(map(str, shape))}xbf16>", "bf16", dims, shape, (shape[1], 1), 0)

    if not narrow:
        monkeypatch.setenv("GAC_WGMMA_NARROW", "0")
    spec = Spec("bf16", 0, 1, 2, (), (M, N, K), op((M, K), (0, 2)), op((N, K), (1, 2)), op((M, N), (0, 1)), True)
    p = W.plan(spec)
    assert p is not None and p.bn == want and p.smem_bytes <= W.SMEM_LIMIT
    assert W.prefetch(p) == (W.PREFETCH if want <= 128 else 0)  # (registers for 64 accumulators only)


def test_arg_table_passes_tensor_map_addresses() -> None:
    # the runtime encodes each descriptor once per pointer set (tensor_maps.upload, on the GPU)
    # and hands the kernel its device address in the argument's slot
    from gac_torch.backends.cuda.launch_args import ArgTable

    tm = TensorMapArg(BufferRef("arg", 0), "bf16", (64, 128), (128,), 0, (64, 128), 128)
    launch = KernelLaunch("k", (1, 1, 1), (384, 1, 1), 0, (tm, BufferRef("arg", 1)))
    table = ArgTable([launch], [0x1000, 0x2000], [], {(0, 0): 0xABC00})
    assert int.from_bytes(table.param(0, 0), "little") == 0xABC00
    assert int.from_bytes(table.param(0, 1), "little") == 0x2000


def test_env_switch_leaves_gemms_to_mma(monkeypatch: pytest.MonkeyPatch) -> None:
    case = matmul(1024, 1024, 1024, torch.bfloat16)
    assert [k.strategy for k in compile_case(case, "sm_90").launches] == ["wgmma"]
    monkeypatch.setenv("GAC_WGMMA", "0")  # bisecting: the mma.sync kernel and its rounding pass
    assert {k.strategy for k in compile_case(case, "sm_90").launches} == {"mma", "loops"}


def test_cluster_pairs_compile_with_multicast(monkeypatch: pytest.MonkeyPatch) -> None:
    # GAC_WGMMA_CLUSTER=2: CTA pairs, B multicast; checked offline only (PTX + ptxas)
    monkeypatch.setenv("GAC_WGMMA_CLUSTER", "2")
    for case, pairs in ((_case(4096, 512, 4096, torch.bfloat16), True),
                        (_case(1000, 520, 1032, torch.float16, b_t=True), True),  # K-major B: 2 boxes
                        (_case(120, 136, 264, torch.bfloat16), False)):  # one M tile: no pair
        program = compile_case(case, "sm_90")
        ptx = program.ptx
        assert ("multicast::cluster" in ptx and ".reqnctapercluster 2, 1, 1" in ptx) == pairs
        assert program.launches[0].grid[0] % (2 if pairs else 1) == 0
        result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
        assert result.ok and " 0 bytes spill stores" in result.log, result.log


# ------------------------------------------------------------------------------------------------
# transposed operands from torch: read in place (backends/gpu/transposed_operands.py)


@contextlib.contextmanager
def matmul_tf32(allow: bool) -> Iterator[None]:
    """torch's matmul TF32 flag set for a compile (saved and restored by hand: a property of a
    module object, which some pytest versions' monkeypatch cannot undo)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def launches(compiled) -> list[str]:
    """The strategies of a compiled graph's kernels, in launch order (from the PTX header)."""
    head = compiled.ir("ptx").split("\n.version")[0]
    return [line.rsplit("[", 1)[1].split("]")[0] for line in head.splitlines() if line.startswith("// launch")]


class _Mm(torch.nn.Module):
    def __init__(self, a_t: bool, b_t: bool) -> None:
        super().__init__()
        self.a_t, self.b_t = a_t, b_t

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.transpose(-1, -2) if self.a_t else a) @ (b.transpose(-1, -2) if self.b_t else b)


@pytest.mark.parametrize("M,K,N,dt,a_t,b_t,batch,arch,want", [
    (200, 136, 262, torch.float16, False, True, 0, "sm_90", ["wgmma"]),  # nn.Linear's B (K-major)
    (200, 136, 264, torch.bfloat16, False, True, 3, "sm_90", ["wgmma"]),
    (136, 72, 264, torch.bfloat16, True, False, 0, "sm_90", ["wgmma"]),  # A M-major
    (520, 200, 1032, torch.float16, True, True, 0, "sm_90", ["wgmma"]),
    (200, 136, 262, torch.float16, False, True, 0, "sm_80", ["mma", "loops"]),  # (+ the rounding)
])
def test_transposes_are_views_not_kernels(M, K, N, dt, a_t, b_t, batch, arch, want) -> None:
    import gac_torch

    lead = (batch,) if batch else ()
    a = torch.randn(lead + ((K, M) if a_t else (M, K))).to(dt)
    b = torch.randn(lead + ((N, K) if b_t else (K, N))).to(dt)
    compiled = gac_torch.compile(_Mm(a_t, b_t), (a, b), target="cuda", options={"arch": arch})
    assert launches(compiled) == want, compiled.ir("ptx").split("\n.version")[0]
    if arch == "sm_90":  # TMA boxes over the arguments themselves, no temporary
        head = compiled.ir("ptx").split("\n.version")[0]
        assert "tma(arg0 " in head and "tma(arg1 " in head and "temp" not in head


# ------------------------------------------------------------------------------------------------
# epilogues: bias, activation, residual add in the wgmma kernel's store (5c)


class Epilogue(torch.nn.Module):
    """A Linear (x @ w.T + bias, or a @ b + bias with b row-major) and what follows it: the
    activation and a residual add run in the wgmma kernel's store."""

    def __init__(self, act: str, residual: bool, linear: bool) -> None:
        super().__init__()
        self.act, self.residual, self.linear = act, residual, linear

    def forward(self, x, w, bias, r):
        if self.linear:  # nn.Linear's call; batched: the same layout per batch
            y = torch.nn.functional.linear(x, w, bias) if w.dim() == 2 else x @ w.transpose(-1, -2) + bias
        else:
            y = x @ w + bias
        y = {"none": y, "relu": torch.relu(y), "gelu": torch.nn.functional.gelu(y)}[self.act]
        return y + r if self.residual else y


def epilogue_shapes(M: int, K: int, N: int, linear: bool, batch: int) -> list[tuple[int, ...]]:
    lead = (batch,) if batch else ()
    return [lead + (M, K), lead + ((N, K) if linear else (K, N)), (N,), lead + (M, N)]


EPILOGUES = [  # M, K, N, dtype, activation, residual, linear layout (else a @ b), batch
    (1000, 520, 1030, torch.bfloat16, "gelu", False, True, 0),  # partial tiles in M, N, K
    (1000, 520, 1030, torch.float16, "relu", True, True, 0),
    (520, 256, 1032, torch.bfloat16, "none", True, False, 0),  # B N-major (16-bit: transpose bit)
    (1000, 520, 1032, torch.float32, "relu", False, True, 0),  # TF32, both K-major
    (1000, 520, 1032, torch.float32, "gelu", True, False, 0),  # TF32 C^T = B^T A^T, A from registers
    (200, 136, 262, torch.bfloat16, "relu", True, True, 3),  # batched
    (200, 136, 264, torch.float32, "none", False, False, 2),
    # narrow tiles (wgmma_plan.narrow), a 1x1 conv's: N <= 64 in a 64-wide tile, a short K in a
    # 128-wide one, the residual loaded before the main loop (prefetch)
    (1000, 72, 40, torch.bfloat16, "relu", True, True, 0),
    (1000, 72, 200, torch.float32, "relu", True, True, 0),
    (520, 136, 104, torch.float16, "gelu", True, False, 0),  # B N-major
]



@pytest.mark.parametrize("M,K,N,dtype,act,residual,linear,batch", EPILOGUES)
def test_epilogue_runs_in_the_wgmma_store(M, K, N, dtype, act, residual, linear, batch, monkeypatch) -> None:
    import gac_torch

    shapes = epilogue_shapes(M, K, N, linear, batch)
    args = tuple(torch.randn(s).to(dtype) for s in shapes)
    with matmul_tf32(dtype == torch.float32):
        compiled = gac_torch.compile(Epilogue(act, residual, linear), args, target="cuda", options={"arch": "sm_90"})
        assert launches(compiled) == ["wgmma"], compiled.ir("ptx").split("\n.version")[0]
        result = ptxas.assemble(compiled.ir("ptx"), "sm_90a", _PTXAS)
        assert result.ok and " 0 bytes spill stores" in result.log, result.log
        monkeypatch.setenv("GAC_WGMMA_EPILOGUE_FUSION", "0")  # (bisecting: a separate pass)
        unfused = gac_torch.compile(Epilogue(act, residual, linear), args, target="cuda", options={"arch": "sm_90"})
        assert launches(unfused) == ["wgmma", "loops"]


@pytest.mark.parametrize("pairs", [True, False])
def test_epilogue_loads_pairs_before_the_main_loop(pairs, monkeypatch) -> None:
    # a 1x1 conv's epilogue (BN 128, short K): the residual read two columns per load, all of
    # the tile's before the first wgmma (their latency under the MMAs), the output stored in
    # pairs; GAC_WGMMA_EPILOGUE_PAIRS=0 and PREFETCH=0: scalar loads, after the main loop
    import gac_torch

    monkeypatch.setenv("GAC_WGMMA_EPILOGUE_STAGE", "0")  # (5d, the default, reads it by TMA)
    if not pairs:
        monkeypatch.setenv("GAC_WGMMA_EPILOGUE_PAIRS", "0")
        monkeypatch.setenv("GAC_WGMMA_EPILOGUE_PREFETCH", "0")
    args = tuple(torch.randn(s) for s in epilogue_shapes(1000, 72, 200, True, 0))
    with matmul_tf32(True):
        ptx = gac_torch.compile(Epilogue("relu", True, True), args, target="cuda",
                                options={"arch": "sm_90", "cache": False}).ir("ptx")
    body = ptx.split("setmaxnreg.inc")[1]  # the consumers
    before = body.split("wgmma.mma_async")[0]
    assert before.count("ld.global.nc.v2") == (32 if pairs else 0), before.count("ld.global")
    assert ("st.global.v2" in body) == pairs


@pytest.mark.parametrize("es,bn", [(2, 128), (4, 128), (2, 64), (4, 64), (2, 256)])
def test_staged_epilogue_moves_each_element_once(es: int, bn: int) -> None:
    # 5d: TMA writes the residual tile as [BM][128-byte] swizzled boxes; each consumer thread
    # reads its FRAG_C pairs at ring_offset and writes its results there; the read-out then
    # takes 16-byte chunks at ring_offset: every element is read back where TMA put it, and
    # the chunks cover the tile once, row-contiguous
    dt = {2: np.float16, 4: np.float32}[es]
    span = W.SWIZZLE // es
    tile = np.arange(W.BM * bn).reshape(W.BM, bn).astype(dt)  # (exact in f16 below 2048)
    tile = tile if es == 4 else (np.arange(W.BM * bn) % 2039).reshape(W.BM, bn).astype(dt)
    smem = np.zeros(W.BM * bn * es, dtype=np.uint8)
    for j in range(bn // span):
        _tma_write(smem, j * W.BM * W.SWIZZLE, np.ascontiguousarray(tile[:, j * span:(j + 1) * span]), es)
    seen = np.zeros((W.BM, bn), dtype=int)
    for cw in range(2):
        for warp in range(4):
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                local = cw * 64 + warp * 16 + g
                for i in range(bn // 8):
                    for (rq, cq) in FRAG_C[::2]:  # the pairs (q, q + 1)
                        r, col = local + rq, 2 * tq + 8 * i
                        at = W.ring_offset(_Ints, r, col, es)
                        assert at % (2 * es) == 0
                        got = smem[at:at + 2 * es].view(dt)
                        assert (got == tile[r, col:col + 2]).all(), (r, col)
                        seen[r, col:col + 2] += 1
    assert (seen == 1).all()
    per_row, chunks = bn * es // 16, np.zeros((W.BM, bn), dtype=int)
    for cw in range(2):
        for t in range(W.WG):
            for k in range(64 * per_row // W.WG):
                idx = t + k * W.WG
                r, col = cw * 64 + idx // per_row, (idx % per_row) * (16 // es)
                at = W.ring_offset(_Ints, r, col, es)
                assert at % 16 == 0 and (smem[at:at + 16].view(dt) == tile[r, col:col + 16 // es]).all()
                chunks[r, col:col + 16 // es] += 1
                if t % 32:  # a warp's consecutive threads: consecutive chunks of a row (or the next row's first)
                    prev = t - 1 + k * W.WG
                    assert (r, col) == ((cw * 64 + prev // per_row, (prev % per_row + 1) * (16 // es))
                                        if (prev % per_row) + 1 < per_row else (r, 0))
    assert (chunks == 1).all()


@pytest.mark.parametrize("M,K,N,dtype,residual,staged,bn", [
    (1000, 72, 200, torch.float32, True, True, (128, 128)),  # TF32, a 1x1 conv's 128-wide tile, two buffers
    (1000, 72, 40, torch.bfloat16, True, True, (64, 64)),  # N 40 in a 64-wide tile
    (999, 136, 104, torch.float16, False, True, (128, 128)),  # no residual: the buffer only stages Z
    (1000, 520, 1030, torch.float16, True, False, (128, 128)),  # rows of 2060 bytes: not 16-byte chunks
    (4000, 200, 1024, torch.float32, True, True, (128, 256)),  # a 256-wide f32 tile's buffer: 128 KiB
    (4300, 264, 1024, torch.bfloat16, False, True, (256, 256)),  # one 64 KiB buffer, no residual to wait for
    (1000, 1032, 200, torch.float32, False, False, (128, 128)),  # long K, no residual: all 6 stages
    (1000, 1032, 200, torch.float32, True, True, (128, 128)),  # with one: 3 stages, two buffers
])
def test_epilogue_through_shared_memory(M, K, N, dtype, residual, staged, bn, monkeypatch) -> None:
    # 5d: the residual comes by TMA (a third tensor map, read by the producer), Z leaves as
    # 16-byte chunks (=tma: by TMA stores, a tensor map the kernel writes); where it does not
    # apply, and with GAC_WGMMA_EPILOGUE_STAGE=0, the loads and stores stay in registers (5c);
    # with a residual, a 256-wide tile goes 128 wide (two buffers: the next tile's residual
    # loads while this one is stored)
    import gac_torch

    args = tuple(torch.randn(s).to(dtype) for s in epilogue_shapes(M, K, N, True, 0))
    loads = {}
    for mode in ("1", "tma", "0"):
        monkeypatch.setenv("GAC_WGMMA_EPILOGUE_STAGE", mode)
        with matmul_tf32(dtype == torch.float32):
            model = Epilogue("relu", residual, True) if residual else _NoResidual()
            ptx = gac_torch.compile(model, args if residual else args[:3], target="cuda",
                                    options={"arch": "sm_90", "cache": False}).ir("ptx")
        head, body = ptx.split("\n.version")[0], ptx.split("setmaxnreg.inc")[1]
        five_d = mode != "0" and staged
        assert f".m64n{bn[0] if mode != '0' else bn[1]}k" in body
        assert head.count("tma(") == 2 + (five_d and residual) + (five_d and mode == "tma"), head
        assert (":w)" in head or ":w, " in head) == (five_d and mode == "tma"), head
        assert ("st.global.v4" in body) == (five_d and mode == "1") == ("ld.shared.v4.b32" in body)
        assert ("global.shared::cta.bulk_group" in body) == (five_d and mode == "tma")
        loads[mode] = body.count("ld.global")  # the per-column operands' (the bias) only, in 5d
        result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
        assert result.ok and " 0 bytes spill stores" in result.log, result.log
    assert (loads["1"] < loads["0"]) == (staged and residual), loads


@pytest.mark.parametrize("M,K,N,batch,staged", [
    (1000, 72, 200, 0, True), (200, 136, 264, 2, True),  # short K (8 slices at most), a batch
    (1000, 1032, 200, 0, False),  # a long K keeps its 6 stages and the paired stores
])
def test_short_k_f32_c_through_shared_memory(M, K, N, batch, staged, monkeypatch) -> None:
    # 5d without an epilogue (wgmma_plan.stage_c): a TF32 product's f32 C, whose bytes are the
    # tile's time, leaves as 16-byte row chunks; GAC_WGMMA_EPILOGUE_STAGE=0: pairs from registers
    import gac_torch

    lead = (batch,) if batch else ()
    args = (torch.randn(lead + (M, K)), torch.randn(lead + (N, K)))
    for on in (True, False):
        monkeypatch.setenv("GAC_WGMMA_EPILOGUE_STAGE", "1" if on else "0")
        with matmul_tf32(True):
            ptx = gac_torch.compile(_Mm(False, True), args, target="cuda",
                                    options={"arch": "sm_90", "cache": False}).ir("ptx")
        assert launches_of(ptx) == ["wgmma"]
        body = ptx.split("setmaxnreg.inc")[1]
        assert ("st.global.v4" in body) == (on and staged) != ("st.global.v2.b32" in body)
        result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
        assert result.ok and " 0 bytes spill stores" in result.log, result.log


def launches_of(ptx: str) -> list[str]:
    return [line.rsplit("[", 1)[1].split("]")[0] for line in ptx.split("\n.version")[0].splitlines()
            if line.startswith("// launch")]


class _NoResidual(torch.nn.Module):
    def forward(self, x, w, bias):
        return torch.relu(torch.nn.functional.linear(x, w, bias))


class BlockEnd(torch.nn.Module):
    """A bottleneck's end as one GEMM: its BatchNorm and the downsample branch's (unfolded: mean,
    var, weight, bias each), the add, ReLU: nine epilogue operands, eight of them per column."""

    def forward(self, x, w, r, *p):
        y = torch.nn.functional.linear(x, w)
        a = (y - p[0]) * torch.rsqrt(p[1] + 1e-5) * p[2] + p[3]
        b = (r - p[4]) * torch.rsqrt(p[5] + 1e-5) * p[6] + p[7]
        return torch.relu(a + b)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heavy_epilogue_in_a_wide_tile_does_not_spill(dtype, staged, monkeypatch) -> None:
    # ResNet's block-3 first conv (K 256 -> N 1024, a 256-wide tile, the downsample's BatchNorm
    # fused): 16-accumulator chunks with pairs spilled 132 bytes; such an epilogue loads 8 at a
    # time (5c). Staged (5d, the default), the residual comes by TMA into a 128-wide tile's buffer
    import gac_torch

    monkeypatch.setenv("GAC_WGMMA_EPILOGUE_STAGE", "1" if staged else "0")
    M, K, N = 9000, 256, 1024
    args = (torch.randn(M, K), torch.randn(N, K), torch.randn(M, N), *[torch.rand(N) + 0.5 for _ in range(8)])
    with matmul_tf32(True):
        ptx = gac_torch.compile(BlockEnd(), tuple(a.to(dtype) for a in args), target="cuda",
                                options={"arch": "sm_90", "cache": False}).ir("ptx")
    assert f"m64n{128 if staged else 256}k" in ptx and [ln.split("[")[1].split("]")[0] for ln in ptx.splitlines()
                                   if ln.startswith("// launch")] == ["wgmma"], ptx.split("\n.version")[0]
    result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
    assert result.ok and " 0 bytes spill stores" in result.log, result.log


LINEAR_3D = [  # B, M, K, N, dtype, activation, residual, linear layout: x [B, M, K] with a 2-D weight
    (4, 130, 256, 520, torch.bfloat16, "gelu", False, True),  # M = B * M = 520: partial tiles
    (2, 250, 520, 1030, torch.float16, "relu", True, True),
    (3, 200, 136, 264, torch.float32, "none", False, True),  # TF32, both K-major
    (3, 200, 136, 264, torch.float32, "relu", True, False),  # TF32 x @ w: C^T, merged M is N'
]


def linear_3d_shapes(B: int, M: int, K: int, N: int, linear: bool) -> list[tuple[int, ...]]:
    return [(B, M, K), (N, K) if linear else (K, N), (N,), (B, M, N)]


@pytest.mark.parametrize("B,M,K,N,dtype,act,residual,linear", LINEAR_3D)
def test_linear_on_3d_input_is_one_wgmma_kernel(B, M, K, N, dtype, act, residual, linear, monkeypatch) -> None:
    # the input's (B, M) are one M run in x and in the result: one GEMM over B * M rows
    # through collapse_shape views (strategies/merged_rows.py), not the mma.sync igemm
    import gac_torch

    args = tuple(torch.randn(s).to(dtype) for s in linear_3d_shapes(B, M, K, N, linear))
    with matmul_tf32(dtype == torch.float32):
        compiled = gac_torch.compile(Epilogue(act, residual, linear), args, target="cuda", options={"arch": "sm_90"})
    head = compiled.ir("ptx").split("\n.version")[0]
    assert launches(compiled) == ["wgmma"], head
    assert "tma(arg0 box=" in head and "temp" not in head  # x read in place, no copy
    result = ptxas.assemble(compiled.ir("ptx"), "sm_90a", _PTXAS)
    assert result.ok and " 0 bytes spill stores" in result.log, result.log


class WeightT(torch.nn.Module):
    """x @ w.T without a bias: the f32 result's rounding is the kernel's store (5 / 5b)."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.transpose(-1, -2)


@pytest.mark.parametrize("N,staged", [(520, True), (262, False)])
def test_3d_input_times_weight_t_rounds_in_the_store(N, staged) -> None:
    import gac_torch

    args = (torch.randn(4, 130, 256).to(torch.bfloat16), torch.randn(N, 256).to(torch.bfloat16))
    compiled = gac_torch.compile(WeightT(), args, target="cuda", options={"arch": "sm_90"})
    assert launches(compiled) == ["wgmma"]
    assert ("st.global.v4.b32" in compiled.ir("ptx")) == staged  # 16-byte rows: staged (5b)


def async_register_hazards(ptx: str) -> list[str]:
    """PTX lines that touch a register an unfinished wgmma still reads or writes (PTX ISA:
    undefined until a wgmma.wait_group covers its group): a write to an A-fragment register, or
    any access to an accumulator, by another instruction. A dataflow pass over the basic blocks
    (branches to `$L` labels; loops iterate to a fixed point): the state at a block's start is
    the union over its predecessors of the open group and the groups in flight (newest aligned)."""
    blocks: list[list[str]] = [[]]
    succ: list[list[int]] = []
    names: dict[str, int] = {}
    targets: list[tuple[int, str, bool]] = []  # (block, label, conditional)
    for raw in ptx.splitlines():
        ln = raw.split("//")[0].strip()
        if not ln or ln.startswith((".reg", "{", "}")):
            continue
        if re.match(r"\$L\w+:$", ln):
            names[ln[:-1]] = len(blocks)
            blocks.append([])
            continue
        cond = ln.startswith("@")
        ln = re.sub(r"^@!?%?\w+\s+", "", ln)
        blocks[-1].append(ln)
        if m := re.match(r"bra(?:\.uni)?\s+(\$L\w+);", ln):
            targets.append((len(blocks) - 1, m.group(1), cond))
            blocks.append([])
    succ = [[i + 1] if i + 1 < len(blocks) and not (bl and bl[-1].startswith("ret")) else [] for i, bl in enumerate(blocks)]
    for i, label, cond in targets:
        succ[i] = [names[label]] + (succ[i] if cond else [])

    def join(x, y):
        if x is None:
            return y
        n = max(len(x[2]), len(y[2]))
        pad = lambda g: [(frozenset(), frozenset())] * (n - len(g)) + list(g)  # noqa: E731
        return (x[0] | y[0], x[1] | y[1], tuple((p[0] | q[0], p[1] | q[1]) for p, q in zip(pad(x[2]), pad(y[2]))))

    def run(state, block: list[str], bad: list[str] | None):
        open_a, open_acc, groups = state
        for ln in block:
            regs = set(re.findall(r"%r\d+", ln))
            if ln.startswith("wgmma.mma_async"):
                lists = [set(re.findall(r"%r\d+", x)) for x in re.findall(r"\{([^}]*)\}", ln)]
                open_acc, open_a = open_acc | lists[0], open_a | (lists[1] if len(lists) > 1 else set())
            elif ln.startswith("wgmma.commit_group"):
                groups, open_a, open_acc = groups + ((frozenset(open_a), frozenset(open_acc)),), frozenset(), frozenset()
            elif ln.startswith("wgmma.wait_group"):
                n = int(ln.split()[-1].rstrip(";"))
                groups = groups[len(groups) - n:] if len(groups) > n else groups
            elif regs and bad is not None:
                a_regs = set(open_a).union(*(g[0] for g in groups))
                accs = set(open_acc).union(*(g[1] for g in groups))
                dest = re.match(r"\S+\s+(\{[^}]*\}|%r\d+)", ln)
                written = set() if not dest or ln.startswith(("st.", "mbarrier")) else set(re.findall(r"%r\d+", dest.group(1)))
                if written & a_regs or regs & accs:
                    bad.append(ln)
        return frozenset(open_a), frozenset(open_acc), groups

    entry = (frozenset(), frozenset(), ())
    state_in: list = [entry] + [None] * (len(blocks) - 1)
    work = [0]
    while work:
        i = work.pop()
        out = run(state_in[i], blocks[i], None)
        for j in succ[i]:
            new = join(state_in[j], out)
            if new != state_in[j]:
                state_in[j] = new
                work.append(j)
    bad: list[str] = []
    for i, block in enumerate(blocks):
        if state_in[i] is not None:
            run(state_in[i], block, bad)
    return bad


def test_hazard_check_flags_fragments_reloaded_under_an_unfinished_wgmma() -> None:
    # the register-A kernel before ddaa6b7, in miniature: one set of fragment registers per
    # slice, reloaded while the previous slice's group may still run (wait depth 1); 4 % off
    # on the H200. Depth 0 is safe, and so is a second set of registers (two slices per loop)
    def kernel(depth: int, sets: int) -> str:
        body = []
        for s in range(sets):
            r = 10 * s
            body += [f"ld.shared.v2.f32 {{%r{r + 1}, %r{r + 2}}}, [%r0];", "wgmma.fence.sync.aligned;",
                     f"wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {{%r100, %r101, %r102, %r103}}, "
                     f"{{%r{r + 1}, %r{r + 2}, %r{r + 1}, %r{r + 2}}}, %rd1, P, 1, 1;",
                     "wgmma.commit_group.sync.aligned;", f"wgmma.wait_group.sync.aligned {depth};"]
        return "\n".join(["$L__BB0_1:", *body, "add.s32 %r0, %r0, 8;", "@%p1 bra $L__BB0_1;",
                          "wgmma.wait_group.sync.aligned 0;", "st.global.f32 [%rd2], %r100;"])

    assert async_register_hazards(kernel(1, 1)) == ["ld.shared.v2.f32 {%r1, %r2}, [%r0];"]
    assert async_register_hazards(kernel(0, 1)) == []
    assert async_register_hazards(kernel(1, 2)) == []
    assert async_register_hazards(kernel(1, 2).replace("sync.aligned 0;\nst", "sync.aligned 1;\nst"))


@pytest.mark.parametrize("m,k,n", [(2048, 2048, 2048), (1000, 520, 1032)])  # (520: 17 slices, one alone)
def test_register_a_kernel_overlaps_loads_and_mmas_without_hazards(m: int, k: int, n: int) -> None:
    """tf32 `a @ b` (B row-major: C^T = B^T A^T, B's tile from registers): two slices per loop
    iteration in two sets of fragment registers, so one group stays in flight (wait depth 1)
    while the next slice's fragments load, and no register of an unfinished wgmma is touched
    (ddaa6b7 had waited with depth 0 to stay correct). 8-byte fragment loads (a_pair_row),
    C's row pairs stored 8 bytes at a time; ptxas: no spills, nothing serialized (with an odd
    slice after the loop, ptxas serialized every wgmma: it goes first)."""
    import gac_torch

    class Mm(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    a, b = torch.randn(m, k), torch.randn(k, n)
    with matmul_tf32(True):
        ptx = gac_torch.compile(Mm(), (a, b), target="cuda", options={"arch": "sm_90", "cache": False}).ir("ptx")
    assert "_wgmma" in ptx and "wgmma.wait_group.sync.aligned 0;" in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert async_register_hazards(ptx) == []
    assert "ld.shared.v2.f32" in ptx and "ld.shared.f32" not in ptx and "st.global.v2.b32" in ptx
    result = ptxas.assemble(ptx, "sm_90a", _PTXAS)
    assert result.ok and " 0 bytes spill stores" in result.log and "serialized" not in result.log, result.log


def test_pair_rows_are_a_permutation_and_conflict_free() -> None:
    # 4b': every row of the warpgroup's 64 once; each half-warp's 8-byte loads at one k (both k
    # halves, every K step) fall in 16 distinct 8-byte bank slots of a 128-byte wavefront
    es = 4
    side = W.Side(False, 128, (32, 32), 4, 128 * 32 * es)
    rows = [W.a_pair_row(_Ints, w, g) + h for w in range(4) for g in range(8) for h in range(2)]
    assert sorted(rows) == list(range(64))
    for w in range(4):
        for kstep in range(4):
            for dk in (0, 4):  # one ld.shared.v2 per (K step, k half): lane t reads k t + dk
                for half in range(2):
                    slots = set()
                    for lane in range(16 * half, 16 * half + 16):
                        g, t = lane // 4, lane % 4
                        off = W.a_frag_offset(_Ints, side, es, W.a_pair_row(_Ints, w, g), 8 * kstep + dk + t)
                        assert off % 8 == 0
                        slots.add((off % 128) // 8)
                    assert len(slots) == 16, (w, kstep, dk, half, sorted(slots))
