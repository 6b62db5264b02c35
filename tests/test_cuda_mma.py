"""Tensor cores (gac_torch/kernels/cuda_mma.py): mma.sync in the PTX where the types allow it,
TF32 following torch's flags, the fragment tables against upstream's, and the kernel body run on
the CPU through its numpy twin (races caught)."""

from __future__ import annotations

import pytest
import torch

from gac_torch.backends.cuda import ptxas
from gac_torch.backends.cuda.target import compile_options
from gac_torch.kernels.builder import RaceError, round_to
from cuda_cases import CASES, Case, compile_case

# ------------------------------------------------------------------------------------------------
# tensor cores (gac_torch/kernels/cuda_mma.py): PTX, fragment layouts, CPU emulation of the kernel


_PTXAS = ptxas.find_ptxas()
_MMA_PTX = {"f16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
            "bf16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            "tf32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}


@pytest.mark.parametrize("name,kind", [("matmul_96x64x80_f16", "f16"), ("matmul_70x50x66_bf16", "bf16"),
                                       ("batch_matmul_f16", "f16"), ("matmul_transposed_b_f16", "f16"),
                                       ("matmul_300x200x260_tf32", "tf32")])
def test_mma_instructions_in_ptx(name: str, kind: str) -> None:
    case = CASES[name]
    for arch in ("sm_80", "sm_90"):
        program = compile_case(case, arch)
        if [k.strategy for k in program.launches] == ["wgmma"]:  # sm_90, large and aligned:
            continue  # the Hopper kernel (tests/test_wgmma_gemm.py)
        mma = {line.split()[0] for line in program.ptx.splitlines() if "mma.sync" in line}
        assert mma == {_MMA_PTX[kind]}, mma
        if kind == "tf32":
            assert "cvt.rna.tf32.f32" in program.ptx
        # 16-byte shared-memory stores need 16-byte aligned buffers
        shared = [line for line in program.ptx.splitlines() if ".shared" in line and "__wg_" in line]
        assert shared and all(".align 16" in line for line in shared), shared
        assert _PTXAS is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
        result = ptxas.assemble(program.ptx, arch, _PTXAS)
        assert result.ok and " 0 bytes spill stores" in result.log, result.log
    # no tensor cores before sm_80; no TF32 unless allowed: the exact f32 FMA kernel
    assert "mma.sync" not in compile_case(case, "sm_75").ptx
    if kind == "tf32":
        plain = Case(case.name, case.inputs, case.outputs, case.body, case.reference)
        program = compile_case(plain, "sm_90")
        assert "mma.sync" not in program.ptx and {k.strategy for k in program.launches} == {"sgemm"}


@pytest.mark.unit
def test_allow_tf32_follows_torch_at_compile_time() -> None:
    # Saved and restored by hand: the flag is a property of a module object (no instance
    # attribute), which some pytest versions' monkeypatch cannot undo.
    saved_flag, saved_precision = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        assert compile_options({"arch": "sm_90"}).allow_tf32 is False
        torch.set_float32_matmul_precision("high")
        assert compile_options({"arch": "sm_90"}).allow_tf32 is True
        assert compile_options({"arch": "sm_90", "allow_tf32": False}).allow_tf32 is False
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = True
        assert compile_options({"arch": "sm_90"}).allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_flag
        torch.set_float32_matmul_precision(saved_precision)
    assert [s.name for s in compile_options({"arch": "sm_75"}).strategies] == [
        "row", "fused", "transpose", "sgemm", "matmul", "reduce"]  # (transpose: sgemm_relayout.copy_strategy)
    assert [s.name for s in compile_options({"arch": "sm_80"}).strategies] == [
        "flash", "row", "fused", "transpose", "igemm", "sgemm", "mma", "matmul", "reduce"]


def _upstream_fragments(elem: str, k: int) -> dict[str, list[tuple[str, str]]]:
    """Per operand, the (row, col) index expressions of each register element that upstream's
    `transform.nvgpu.rewrite_matmul_as_mma_sync` emits (lane = s0)."""
    from mlir import ir
    from mlir.dialects.transform import interpreter

    text = f"""
module attributes {{transform.with_named_sequence}} {{
  func.func @mm(%a: memref<16x{k}x{elem}>, %b: memref<{k}x8x{elem}>, %c: memref<16x8x{elem}>) {{
    linalg.matmul ins(%a, %b : memref<16x{k}x{elem}>, memref<{k}x8x{elem}>) outs(%c : memref<16x8x{elem}>)
    return
  }}
  transform.named_sequence @__transform_main(%root: !transform.any_op {{transform.readonly}}) {{
    %mm = transform.structured.match ops{{["linalg.matmul"]}} in %root : (!transform.any_op) -> !transform.any_op
    transform.nvgpu.rewrite_matmul_as_mma_sync %mm : (!transform.any_op) -> ()
    transform.yield
  }}
}}"""
    ctx = ir.Context()
    module = ir.Module.parse(text, ctx)
    seq = next(op for op in module.body.operations if op.operation.name == "transform.named_sequence")
    interpreter.apply_named_sequence(module.operation, seq, module)
    fn = next(op for op in module.body.operations if op.operation.name == "func.func")
    exprs: dict[str, str] = {}
    loads: dict[str, list[tuple[str, str]]] = {"a": [], "b": [], "c": []}
    for op in fn.regions[0].blocks[0].operations:
        op = op.operation
        if op.name == "affine.apply":
            exprs[op.results[0].get_name()] = str(op.attributes["map"]).split("-> (")[1].rsplit(")", 1)[0]
        elif op.name == "memref.load":
            which = "abc"[[str(a.get_name()) for a in fn.regions[0].blocks[0].arguments].index(
                op.operands[0].get_name())]
            loads[which].append((exprs[op.operands[1].get_name()], exprs[op.operands[2].get_name()]))
    return loads


def _eval(expr: str, lane: int) -> int:
    return eval(expr.replace("floordiv", "//").replace("mod", "%").replace("s0", str(lane)))


@pytest.mark.unit
def test_mma_fragment_tables_match_upstream() -> None:
    from gac_torch.kernels import cuda_mma as cm

    f16 = _upstream_fragments("f16", 16)
    tf32 = _upstream_fragments("f32", 4)  # upstream's tf32 shape is m16n8k4: the first half of k8
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = [(g + r, 2 * t + c + h) for r, c in cm.FRAG_A16 for h in (0, 1)]
        b = [(2 * t + k + h, g) for k in cm.FRAG_B16 for h in (0, 1)]
        c = [(g + r, 2 * t + cc) for r, cc in cm.FRAG_C]
        for which, ours in (("a", a), ("b", b), ("c", c)):
            theirs = [(_eval(x, lane), _eval(y, lane)) for x, y in f16[which]]
            assert theirs == ours, (which, lane, theirs, ours)
        a8 = [(g + r, t + cc) for r, cc in cm.FRAG_A8 if cc == 0]
        b8 = [(t + k, g) for k in cm.FRAG_B8 if k == 0]
        assert [(_eval(x, lane), _eval(y, lane)) for x, y in tf32["a"]] == a8
        assert [(_eval(x, lane), _eval(y, lane)) for x, y in tf32["b"]] == b8


def _mma_spec(kind: str, M: int, N: int, K: int, a_t: bool = False, b_t: bool = False,
              batch: int = 0, fill: bool = True, ec: str = "f32"):
    from gac_torch.kernels import cuda_mma as cm

    def operand(elem: str, dims: tuple[int, ...], shape: tuple[int, ...]) -> cm.Operand:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return cm.Operand("memref<" + "x".join(map(str, shape)) + f"x{elem}>", elem, dims, shape,
                          tuple(strides), 0)

    e = "f32" if kind == "tf32" else kind
    be = (2, 3)[:batch]
    bd = tuple(range(batch))
    m, n, k = batch, batch + 1, batch + 2
    a = operand(e, bd + ((k, m) if a_t else (m, k)), be + ((K, M) if a_t else (M, K)))
    b = operand(e, bd + ((n, k) if b_t else (k, n)), be + ((N, K) if b_t else (K, N)))
    c = operand(ec, bd + (m, n), be + (M, N))
    return cm.Spec(kind, m, n, k, bd, be + (M, N, K), a, b, c, fill)


@pytest.mark.unit
@pytest.mark.parametrize("kind,M,N,K,a_t,b_t,batch,fill,ec,big", [
    ("f16", 70, 50, 66, False, False, 0, True, "f32", False),  # ragged everything, 2-wide loads
    ("f16", 96, 64, 80, False, False, 0, False, "f32", False),  # accumulate onto C
    ("bf16", 70, 50, 66, False, True, 0, True, "f32", False),  # nn.Linear layout
    ("bf16", 64, 64, 64, True, True, 0, True, "bf16", False),  # transposed A, bf16 output
    ("tf32", 33, 40, 37, True, False, 0, False, "f32", False),  # scalar loads (K, M odd)
    ("f16", 130, 136, 40, False, False, 1, True, "f16", True),  # 128x128 tile, batch, f16 out
    ("tf32", 129, 130, 48, False, True, 2, True, "f32", True),
])
def test_mma_kernel_emulated_on_cpu(kind, M, N, K, a_t, b_t, batch, fill, ec, big) -> None:
    # The kernel body the MLIR is generated from, executed with numpy (threads in lockstep,
    # mma.sync from the fragment tables, shared-memory races checked against the barriers).
    import numpy as np

    from gac_torch.kernels import cuda_mma as cm
    from gac_torch.kernels import cuda_mma_twin as cmt

    spec = _mma_spec(kind, M, N, K, a_t, b_t, batch, fill, ec)
    plan = cm.plan(spec, big=big)
    assert plan is not None and (plan.bm == 128) == big
    rng = np.random.default_rng(M * N + K)
    A = rng.standard_normal(spec.a.shape).astype(np.float32)
    B = rng.standard_normal(spec.b.shape).astype(np.float32)
    C = round_to(rng.standard_normal(spec.c.shape).astype(np.float32), ec)
    out = cmt.emulate(spec, plan, A, B, C, init=0.25)
    rnd = "tf32" if kind == "tf32" else kind
    Am, Bm = round_to(A, rnd).astype(np.float64), round_to(B, rnd).astype(np.float64)
    Am = np.swapaxes(Am, -1, -2) if a_t else Am
    Bm = np.swapaxes(Bm, -1, -2) if b_t else Bm
    ref = (0.25 if fill else C.astype(np.float64)) + Am @ Bm
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < (1e-2 if ec == "bf16" else 2e-3 if ec == "f16" else 1e-5), err
    # the generated MLIR for the same plan parses
    from mlir import ir
    from mlir.dialects import gpu as _gpu  # noqa: F401  (registers the dialects)

    ir.Module.parse(cm.template(spec, plan), ir.Context())


@pytest.mark.unit
def test_mma_emulation_catches_a_missing_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    from gac_torch.kernels import cuda_mma as cm
    from gac_torch.kernels import cuda_mma_twin as cmt

    spec = _mma_spec("f16", 64, 64, 96)
    plan = cm.plan(spec, big=False)
    import numpy as np

    calls = []
    real = cmt.MmaNumpy.barrier

    def barrier(self):  # the loop's barrier (every one after the prologue's) is dropped
        calls.append(1)
        if len(calls) == 1:
            real(self)

    monkeypatch.setattr(cmt.MmaNumpy, "barrier", barrier)
    A, B, C = (np.ones(s, np.float32) for s in (spec.a.shape, spec.b.shape, spec.c.shape))
    with pytest.raises(RaceError):
        cmt.emulate(spec, plan, A, B, C)
