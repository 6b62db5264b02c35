"""Vortex lower half: C / LLVM IR -> .vxbin with our toolchain, run on the functional simulator
(CI) and, for tests marked `simx`, on the real SimX runtime (needs VORTEX_HOME)."""

from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest

pytest.importorskip("ziglang")
pytest.importorskip("elftools")

from gac_torch.backends.vortex import bridge, simt_ir  # noqa: E402
from gac_torch.backends.vortex import toolchain as tc  # noqa: E402
from gac_torch.backends.vortex.funcsim import SimError, disassemble  # noqa: E402
from gac_torch.backends.vortex.target import VortexConfig, pack_args  # noqa: E402
from gac_torch.backends.vortex.vxbin import elf_to_vxbin, read_vxbin  # noqa: E402

KERNELS_C = r"""
#include "vx_gac.h"
#ifndef USE_SPLIT
#define USE_SPLIT 1
#endif
static inline unsigned gid(void) { return vx_block_id_x() * vx_block_dim_x() + vx_thread_id_x(); }

void vecadd(const float* a, const float* b, float* c, int n) {
  unsigned i = gid();
  int t = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) c[i] = a[i] + b[i];
  vx_join(t);
}

/* odd v: odd[i] = 3v+1, odd[n+i] = v; even v: even[i] = v/2. The odd arm's second store is
   conditional, so the if/else stays a real branch: without SPLIT/JOIN it runs for the last
   thread's side only. */
void collatz_step(const int* in, int* odd, int* even, int n) {
  unsigned i = gid();
  int g = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) {
    int v = in[i];
#if USE_SPLIT
    int t = vx_split(v & 1);
#endif
    if (v & 1) { odd[i] = 3 * v + 1; odd[n + i] = v; }
    else { even[i] = v / 2; }
#if USE_SPLIT
    vx_join(t);
#endif
  }
  vx_join(g);
}

/* data-dependent trip count: after vx_pred only threads with c=1 stay active, or (none left)
   the saved mask returns with c=0 everywhere, so `if (!c) break` is uniform */
void tri(const int* in, int* out, int n) {
  unsigned i = gid();
  int g = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) {
    unsigned mask = vx_active_threads();
    int v = in[i], acc = 0, k = 0;
    for (;;) {
      int c = k < v;
      vx_pred(c, mask);
      if (!c) break;
      acc += k;
      ++k;
    }
    out[i] = acc;
  }
  vx_join(g);
}

void block_sum(const float* in, float* out, int n) {
  float* sh = (float*)vx_local_mem();
  unsigned tid = vx_thread_id_x(), bd = vx_block_dim_x(), i = gid();
  float v = 0.0f;
  int t = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) v = in[i];
  vx_join(t);
  sh[tid] = v;
  vx_syncthreads();
  for (unsigned s = bd / 2; s > 0; s >>= 1) {
    int t2 = vx_split(tid < s);
    if (tid < s) sh[tid] += sh[tid + s];
    vx_join(t2);
    vx_syncthreads();
  }
  int t3 = vx_split(tid == 0);
  if (tid == 0) out[vx_block_id_x()] = sh[0];
  vx_join(t3);
}

void fops(const float* a, const float* b, float* out, int n) {
  unsigned i = gid();
  int g = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) {
    float x = a[i], y = b[i];
    float* o = out + 12 * i;
    o[0] = x * y + 1.5f;
    o[1] = x / (y + 3.0f);
    o[2] = __builtin_sqrtf(__builtin_fabsf(x));
    o[3] = __builtin_fminf(x, y);
    o[4] = x < y ? x : -y;                 /* a float select: a branch for stock LLVM */
    o[5] = __builtin_floorf(x);
    o[6] = __builtin_ceilf(y);
    o[7] = __builtin_truncf(x * 0.7f);
    o[8] = __builtin_roundf(y * 1.3f);
    o[9] = (float)(int)(x * 3.3f);
    o[10] = (float)((int)x % 3);
    o[11] = __builtin_fmaxf(x, 0.0f) - __builtin_copysignf(2.0f, y);
  }
  vx_join(g);
}

/* raw-blob kernel (KernelSpec without params): a0 points at the argument blob */
struct scale_args { unsigned long long x; float s; int n; };
void scale(const struct scale_args* a) {
  float* x = (float*)(unsigned)a->x;
  unsigned i = gid();
  int t = vx_split(i < (unsigned)a->n);
  if (i < (unsigned)a->n) x[i] *= a->s;
  vx_join(t);
}

/* libm from compiler_rt branches on the data: the toolchain serialises these calls per lane */
float expf(float);
float sinf(float);
float logf(float);
void mathfn(const float* x, float* y, int n) {
  unsigned i = gid();
  int t = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) {
    float v = x[i];
    y[3 * i] = expf(v);
    y[3 * i + 1] = sinf(v * 10.0f);
    y[3 * i + 2] = __builtin_fmodf(v, 0.3f) + logf(__builtin_fabsf(v) + 1e-3f);
  }
  vx_join(t);
}

/* a barrier that only some threads of a CTA reach: SimX hangs, we report a deadlock */
void bad_barrier(float* x) {
  unsigned tid = vx_thread_id_x();
  int t = vx_split(tid < 2);
  if (tid < 2) { vx_syncthreads(); x[tid] = 1.0f; }
  vx_join(t);
}
"""

# GPU-style LLVM IR as the MLIR side will hand it over: helpers are plain declarations
KERNEL_IR = r"""
target datalayout = "e-m:e-p:32:32-i64:64-n32-S128"
target triple = "riscv32-unknown-elf"

declare i32 @vx_thread_id_x()
declare i32 @vx_block_id_x()
declare i32 @vx_block_dim_x()
declare i32 @vx_split(i32)
declare void @vx_join(i32)
declare float @llvm.maximum.f32(float, float)

; y[i] = x[i] < -1 ? -1 : maximum(x[i], 0) * alpha
define void @clamp_relu(ptr %x, ptr %y, float %alpha, i32 %n) {
entry:
  %tid = call i32 @vx_thread_id_x()
  %bid = call i32 @vx_block_id_x()
  %bd = call i32 @vx_block_dim_x()
  %b = mul i32 %bid, %bd
  %i = add i32 %b, %tid
  %in = icmp slt i32 %i, %n
  %c = zext i1 %in to i32
  %tok = call i32 @vx_split(i32 %c)
  br i1 %in, label %body, label %exit
body:
  %p = getelementptr inbounds float, ptr %x, i32 %i
  %v = load float, ptr %p, align 4
  %m = call float @llvm.maximum.f32(float %v, float 0.0)
  %s = fmul float %m, %alpha
  %neg = fcmp olt float %v, -1.0
  %r = select i1 %neg, float -1.0, float %s
  %q = getelementptr inbounds float, ptr %y, i32 %i
  store float %r, ptr %q, align 4
  br label %exit
exit:
  call void @vx_join(i32 %tok)
  ret void
}
"""

P3, P4 = ("ptr", "ptr", "i32"), ("ptr", "ptr", "ptr", "i32")
SPECS = [tc.KernelSpec("vecadd", P4), tc.KernelSpec("collatz_step", P4), tc.KernelSpec("tri", P3),
         tc.KernelSpec("block_sum", P3), tc.KernelSpec("fops", P4), tc.KernelSpec("scale"),
         tc.KernelSpec("bad_barrier", ("ptr",)), tc.KernelSpec("mathfn", P3)]
IR_SPEC = tc.KernelSpec("clamp_relu", ("ptr", "ptr", "f32", "i32"))
MLIR_SPEC = tc.KernelSpec("saxpy_exp", ("ptr", "ptr", "f32", "i32"))


@pytest.fixture(scope="module")
def programs() -> dict[str, tc.Program]:
    return {"good": tc.build(c=[KERNELS_C], kernels=SPECS),
            "no_split": tc.build(c=[KERNELS_C], kernels=SPECS, cflags=["-DUSE_SPLIT=0"]),
            "unsafe": tc.build(c=[KERNELS_C], kernels=SPECS, simt_safe=False),
            "ir": tc.build(ir=[KERNEL_IR], kernels=[IR_SPEC]),
            "mlir": tc.build(ir=[_mlir_to_llvm_ir(MLIR_KERNEL)], kernels=[MLIR_SPEC])}


# ---- kernel runners shared by the functional and the SimX tests -------------------------------
RNG = np.random.default_rng(0)
N = 64
INTS = RNG.integers(0, 20, N).astype(np.int32)
FA = (RNG.standard_normal(N) * 4).astype(np.float32)
FB = (RNG.standard_normal(N) * 4).astype(np.float32)


def run_vecadd(dev, prog, n=1000, block=16):
    a, b = np.arange(n, dtype=np.float32), np.full(n, 0.25, np.float32)
    A, B, C = dev.upload(a), dev.upload(b), dev.alloc(4 * n)
    m = dev.load_module(prog.vxbin)
    cnt = dev.launch(m, "vecadd", pack_args(P4, [A.address, B.address, C.address, n]),
                     grid=(n + block - 1) // block, block=block)
    return dev.download(C, np.float32), a + b, cnt


def run_collatz(dev, prog):
    m = dev.load_module(prog.vxbin)
    inp, odd, even = dev.upload(INTS), dev.upload(np.full(2 * N, -7, np.int32)), dev.upload(np.full(N, -7, np.int32))
    cnt = dev.launch(m, "collatz_step", pack_args(P4, [inp.address, odd.address, even.address, N]),
                     grid=N // 8, block=8)
    got = np.concatenate([dev.download(odd, np.int32), dev.download(even, np.int32)])
    is_odd = (INTS & 1) == 1
    ref = np.concatenate([np.where(is_odd, 3 * INTS + 1, -7), np.where(is_odd, INTS, -7),
                          np.where(is_odd, -7, INTS // 2)])
    return got, ref, cnt


def run_tri(dev, prog):
    m = dev.load_module(prog.vxbin)
    inp, out = dev.upload(INTS), dev.upload(np.zeros(N, np.int32))
    cnt = dev.launch(m, "tri", pack_args(P3, [inp.address, out.address, N]), grid=N // 8, block=8)
    return dev.download(out, np.int32), INTS * (INTS - 1) // 2, cnt


def run_block_sum(dev, prog, block=16, n=N - 5):
    m = dev.load_module(prog.vxbin)
    nblocks = (n + block - 1) // block
    inp, out = dev.upload(FA), dev.upload(np.zeros(nblocks, np.float32))
    cnt = dev.launch(m, "block_sum", pack_args(P3, [inp.address, out.address, n]), grid=nblocks,
                     block=block, lmem_size=4 * block)
    ref = np.array([FA[k * block:min(k * block + block, n)].sum() for k in range(nblocks)], np.float32)
    return dev.download(out, np.float32), ref, cnt


def run_fops(dev, prog):
    m = dev.load_module(prog.vxbin)
    a, b, out = dev.upload(FA), dev.upload(FB), dev.alloc(4 * 12 * N)
    cnt = dev.launch(m, "fops", pack_args(P4, [a.address, b.address, out.address, N]), grid=N // 4, block=4)
    x, y, f = FA, FB, np.float32
    with np.errstate(all="ignore"):
        ref = np.stack([x * y + f(1.5), x / (y + f(3)), np.sqrt(np.abs(x)), np.fmin(x, y),
                        np.where(x < y, x, -y), np.floor(x), np.ceil(y), np.trunc(x * f(0.7)),
                        np.sign(y * f(1.3)) * np.floor(np.abs(y * f(1.3)) + f(0.5)),
                        np.trunc(x * f(3.3)), np.fmod(np.trunc(x), 3),
                        np.maximum(x, 0) - np.copysign(f(2), y)], 1).astype(np.float32)
    return dev.download(out, np.float32).reshape(N, 12), ref, cnt


def run_libm(dev, prog, n=24):
    m = dev.load_module(prog.vxbin)
    x = np.concatenate([np.linspace(-90, 90, n // 2), np.linspace(-2, 2, n // 2)]).astype(np.float32)
    x[5], x[7] = np.nan, np.inf
    x = x[np.random.default_rng(3).permutation(n)]
    X, Y = dev.upload(x), dev.alloc(12 * n)
    cnt = dev.launch(m, "mathfn", pack_args(P3, [X.address, Y.address, n]), grid=n // 8, block=8)
    f = np.float32
    with np.errstate(all="ignore"):
        ref = np.stack([np.exp(x), np.sin(x * f(10)), np.fmod(x, f(0.3)) + np.log(np.abs(x) + f(1e-3))], 1)
    return dev.download(Y, np.float32).reshape(n, 3), ref, cnt


def run_ir(dev, prog, n=50):
    m = dev.load_module(prog.vxbin)
    x = (np.random.default_rng(1).standard_normal(n) * 2).astype(np.float32)
    x[3] = np.nan
    X, Y = dev.upload(x), dev.alloc(4 * n)
    cnt = dev.launch(m, "clamp_relu", pack_args(IR_SPEC.params, [X.address, Y.address, 0.5, n]),
                     grid=(n + 7) // 8, block=8)
    ref = np.where(x < -1, np.float32(-1), np.where(np.isnan(x), np.nan, np.maximum(x, 0)) * np.float32(0.5))
    return dev.download(Y, np.float32), ref.astype(np.float32), cnt


# ---- toolchain and container ---------------------------------------------------------------
def test_vxbin_matches_elf(programs):
    from elftools.elf.elffile import ELFFile

    prog = programs["good"]
    vx = read_vxbin(prog.vxbin)
    syms = {s.name: s["st_value"] for s in ELFFile(io.BytesIO(prog.elf)).get_section_by_name(".symtab").iter_symbols()}
    assert vx.min_vma == 0x8000_0000 and vx.max_vma >= syms["_end"] >= syms["_edata"]
    assert len(vx.image) == syms["_edata"] - vx.min_vma
    assert vx.kernels == {k.name: syms[f"__vx_kentry_{k.name}"] for k in SPECS}
    assert prog.vxbin.endswith(b"VXSYMTAB") and struct.unpack_from("<I", prog.vxbin, len(prog.vxbin) - 12)[0] == len(SPECS)
    assert elf_to_vxbin(prog.elf) == prog.vxbin


def test_startup_dispatch_window(programs):
    """A reused warp restarts 20 bytes before the PC after `tmc x0`: csrr entry, csrr a0, jalr."""
    lines = [ln.split(":", 1)[1].split(None, 1)[1] for ln in disassemble(programs["good"].vxbin).splitlines()
             if ln.startswith("  8")]
    tmc = next(i for i, t in enumerate(lines) if t.startswith("vx.tmc"))
    assert lines[tmc - 4].startswith("csrrs s11, 0xce1") and lines[tmc - 3].startswith("csrrs a0, 0x340")
    assert lines[tmc - 2].startswith("jalr ra, 0(s11)") and lines[tmc - 1].startswith("vx.wsync")


def test_simt_rewrite_removes_float_selects(programs):
    _, ir = tc.compile_object(KERNELS_C, "c")
    assert not simt_ir.branchy_float_ops(ir)
    _, raw = tc.compile_object(KERNELS_C, "c", simt_safe=False)
    assert any("select" in ln and "float" in ln for ln in simt_ir.branchy_float_ops(raw))
    header = simt_ir.c_header()
    assert "vx_split" in header and "0xcd3" in header


# ---- functional simulator ---------------------------------------------------------------------
def test_vecadd_functional(programs):
    for block in (16, 6, 4):
        got, ref, cnt = run_vecadd(bridge.FunctionalDevice(), programs["good"], n=200, block=block)
        np.testing.assert_array_equal(got, ref)
        assert cnt["divergent_branches"] == 0 and cnt["cycles"] is None and cnt["instructions"] > 0


def test_divergent_if_else_needs_split(programs):
    got, ref, cnt = run_collatz(bridge.FunctionalDevice(), programs["good"])
    np.testing.assert_array_equal(got, ref)
    assert cnt["divergent_branches"] == 0 and cnt["divergent_splits"] > 0
    # the same kernel without SPLIT/JOIN: the branch follows the last active thread -> wrong
    got, ref, cnt = run_collatz(bridge.FunctionalDevice(), programs["no_split"])
    assert (got != ref).sum() > 0 and cnt["divergent_branches"] > 0
    with pytest.raises(SimError, match="divergent branch"):
        run_collatz(bridge.FunctionalDevice(strict=True), programs["no_split"])


def test_divergent_loop_with_pred(programs):
    got, ref, cnt = run_tri(bridge.FunctionalDevice(), programs["good"])
    np.testing.assert_array_equal(got, ref)
    assert cnt["divergent_branches"] == 0


@pytest.mark.parametrize("block", [16, 8])
def test_block_reduction_local_memory_barrier(programs, block):
    got, ref, cnt = run_block_sum(bridge.FunctionalDevice(), programs["good"], block=block)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert cnt["barriers"] > 0 and cnt["divergent_branches"] == 0


def test_float_ops(programs):
    got, ref, cnt = run_fops(bridge.FunctionalDevice(), programs["good"])
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert cnt["divergent_branches"] == 0
    # without the SIMT rewrite the float select becomes a branch that diverges
    got, ref, cnt = run_fops(bridge.FunctionalDevice(), programs["unsafe"])
    assert cnt["divergent_branches"] > 0 and not np.allclose(got[:, 4], ref[:, 4])


def test_libm_calls_are_serialised(programs):
    got, ref, cnt = run_libm(bridge.FunctionalDevice(), programs["good"])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert cnt["divergent_branches"] == 0
    got, ref, cnt = run_libm(bridge.FunctionalDevice(), programs["unsafe"])
    assert cnt["divergent_branches"] > 0
    assert not np.allclose(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_llvm_ir_kernel(programs):
    got, ref, cnt = run_ir(bridge.FunctionalDevice(), programs["ir"])
    np.testing.assert_array_equal(got, ref)
    assert cnt["divergent_branches"] == 0
    with pytest.raises(tc.ToolchainError, match="expected `declare i32 @vx_thread_id_x"):
        tc.compile_object(KERNEL_IR.replace("declare i32 @vx_thread_id_x()", "declare i64 @vx_thread_id_x()"), "ir")


def test_raw_blob_kernel_and_multi_kernel_module(programs):
    dev = bridge.FunctionalDevice()
    m = dev.load_module(programs["good"].vxbin)
    x = np.arange(10, dtype=np.float32)
    X = dev.upload(x)
    dev.launch(m, "scale", struct.pack("<Qfi", X.address, 3.0, 10), grid=3, block=4)
    np.testing.assert_array_equal(dev.download(X, np.float32), x * 3)


def test_other_configurations(programs):
    cfg = VortexConfig(cores=2, warps=4, threads=8)
    got, ref, _ = run_vecadd(bridge.FunctionalDevice(cfg), programs["good"], n=300, block=24)
    np.testing.assert_array_equal(got, ref)
    got, ref, _ = run_block_sum(bridge.FunctionalDevice(cfg), programs["good"], block=16)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_barrier_in_divergent_code_is_reported(programs):
    dev = bridge.FunctionalDevice()
    m = dev.load_module(programs["good"].vxbin)
    with pytest.raises(SimError, match="deadlock"):
        dev.launch(m, "bad_barrier", pack_args(("ptr",), [dev.alloc(64).address]), grid=1, block=8)


def test_simx_missing_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    with pytest.raises(bridge.VortexNotFound, match="VORTEX_HOME"):
        bridge.SimxDevice()
    with pytest.raises(bridge.VortexNotFound, match="VORTEX_DRIVER"):
        bridge.find_vortex(tmp_path)


# ---- the same .vxbin on real SimX -------------------------------------------------------------
@pytest.fixture(scope="module")
def simx():
    if not bridge.simx_available():
        pytest.skip("SimX not available: set VORTEX_HOME")
    dev = bridge.SimxDevice(timeout=120)
    yield dev
    dev.close()


CASES = {"vecadd": (run_vecadd, "good"), "collatz_split": (run_collatz, "good"),
         "collatz_no_split": (run_collatz, "no_split"), "tri_pred": (run_tri, "good"),
         "block_sum": (run_block_sum, "good"), "fops": (run_fops, "good"),
         "fops_unsafe": (run_fops, "unsafe"), "ir_clamp_relu": (run_ir, "ir"),
         "libm_serial": (run_libm, "good"), "libm_unsafe": (run_libm, "unsafe"),
         "mlir_saxpy_exp": (lambda dev, prog: run_mlir(dev, prog), "mlir")}   # defined below


@pytest.mark.simx
@pytest.mark.parametrize("case", sorted(CASES))
def test_simx_matches_functional(simx, programs, case):
    """Same bytes, same inputs: bit-identical outputs (wrong ones included) and instruction counts."""
    run, prog = CASES[case]
    s_got, ref, s_cnt = run(simx, programs[prog])
    f_got, _, f_cnt = run(bridge.FunctionalDevice(simx.config), programs[prog])
    print(f"\n[simx] {case:18s} instructions={s_cnt['instructions']:6d} cycles={s_cnt['cycles']:6d} "
          f"IPC={s_cnt['instructions'] / s_cnt['cycles']:.2f} functional_instructions={f_cnt['instructions']}")
    np.testing.assert_array_equal(s_got.view(np.uint32), f_got.view(np.uint32))
    assert s_cnt["instructions"] == f_cnt["instructions"]
    if case == "collatz_no_split":
        assert (s_got != ref).sum() > 0         # SimX gets it wrong exactly like we do
    elif not case.endswith("unsafe"):
        np.testing.assert_allclose(s_got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.simx
def test_simx_hang_is_a_timeout(programs):
    if not bridge.simx_available():
        pytest.skip("SimX not available: set VORTEX_HOME")
    with bridge.SimxDevice(timeout=float(os.environ.get("GAC_SIMX_HANG_TIMEOUT", "15"))) as dev:
        m = dev.load_module(programs["good"].vxbin)
        buf = dev.alloc(64)
        with pytest.raises(bridge.SimxError, match="did not finish|died"):
            dev.launch(m, "bad_barrier", pack_args(("ptr",), [buf.address]), grid=1,
                       block=2 * dev.config.threads)          # 2 warps: one never arrives


MANY_C = r"""
#include "vx_gac.h"
/* 10 integer-class and 10 float parameters: a7 holds b's low half, its high half and the rest
   go to the stack; the last two floats go to integer registers/stack (ilp32f) */
void many(float* out, int a1, int a2, int a3, int a4, int a5, int a6, long long b, int a7,
          float f0, float f1, float f2, float f3, float f4, float f5, float f6, float f7,
          float f8, float f9) {
  int t = vx_split(vx_thread_id_x() == 0);
  if (vx_thread_id_x() == 0) {
    out[0] = (float)(a1 + 2 * a2 + 3 * a3 + 4 * a4 + 5 * a5 + 6 * a6 + 7 * a7);
    out[1] = (float)(int)(b >> 32);
    out[2] = (float)(int)(b & 0xffff);
    float f[10] = {f0, f1, f2, f3, f4, f5, f6, f7, f8, f9};
    for (int k = 0; k < 10; ++k) out[3 + k] = f[k];
  }
  vx_join(t);
}
"""


def test_many_parameters_use_the_stack():
    params = ("ptr",) + ("i32",) * 6 + ("i64", "i32") + ("f32",) * 10
    prog = tc.build(c=[MANY_C], kernels=[tc.KernelSpec("many", params)])
    dev = bridge.FunctionalDevice()
    out = dev.alloc(4 * 13)
    fs = [0.5 * k - 1 for k in range(10)]
    b = (123 << 32) | 4567
    dev.launch(dev.load_module(prog.vxbin), "many",
               pack_args(params, [out.address, 1, 2, 3, 4, 5, 6, b, 7] + fs), grid=1, block=4)
    np.testing.assert_array_equal(dev.download(out, np.float32),
                                  np.array([1 + 4 + 9 + 16 + 25 + 36 + 49, 123, 4567] + fs, np.float32))


def test_undefined_symbol_hint():
    with pytest.raises(tc.ToolchainError, match="no libc/libm"):
        tc.build(c=["float tanhf(float); void k(float* x) { x[0] = tanhf(x[0]); }"],
                 kernels=[tc.KernelSpec("k", ("ptr",))], use_cache=False)


MLIR_KERNEL = r"""
module attributes {llvm.target_triple = "riscv32-unknown-elf",
                   llvm.data_layout = "e-m:e-p:32:32-i64:64-n32-S128"} {
  func.func private @vx_thread_id_x() -> i32
  func.func private @vx_block_id_x() -> i32
  func.func private @vx_block_dim_x() -> i32
  func.func private @vx_split(i32) -> i32
  func.func private @vx_join(i32)
  func.func @saxpy_exp(%x: !llvm.ptr, %y: !llvm.ptr, %a: f32, %n: i32) {
    %t = func.call @vx_thread_id_x() : () -> i32
    %b = func.call @vx_block_id_x() : () -> i32
    %d = func.call @vx_block_dim_x() : () -> i32
    %bd = arith.muli %b, %d : i32
    %i = arith.addi %bd, %t : i32
    %in = arith.cmpi slt, %i, %n : i32
    %c = arith.extui %in : i1 to i32
    %tok = func.call @vx_split(%c) : (i32) -> i32
    scf.if %in {
      %px = llvm.getelementptr %x[%i] : (!llvm.ptr, i32) -> !llvm.ptr, f32
      %py = llvm.getelementptr %y[%i] : (!llvm.ptr, i32) -> !llvm.ptr, f32
      %vx = llvm.load %px : !llvm.ptr -> f32
      %vy = llvm.load %py : !llvm.ptr -> f32
      %m = arith.mulf %a, %vx : f32
      %r = arith.addf %m, %vy : f32
      %e = math.exp %vx : f32
      %mx = arith.maximumf %r, %e : f32
      llvm.store %mx, %py : f32, !llvm.ptr
    }
    func.call @vx_join(%tok) : (i32) -> ()
    return
  }
}
"""


def _mlir_to_llvm_ir(text: str) -> str:
    """MLIR -> LLVM IR text in-process, as the MLIR side does it (docs/stack.md)."""
    import ctypes
    import glob

    import mlir._mlir_libs as libs
    import mlir.ir as mir
    from mlir.passmanager import PassManager

    ctx = mir.Context()
    module = mir.Module.parse(text, ctx)
    PassManager.parse("builtin.module(convert-scf-to-cf, convert-math-to-llvm, "
                      "convert-arith-to-llvm{index-bitwidth=32}, convert-func-to-llvm{index-bitwidth=32}, "
                      "convert-cf-to-llvm{index-bitwidth=32}, reconcile-unrealized-casts)", ctx).run(module.operation)
    capi = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(libs.__file__), "libMLIRPythonCAPI.so*"))[0])
    translate = capi.mlirTranslateModuleToLLVMIRToString
    translate.restype, translate.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    cap = module.operation._CAPIPtr
    return ctypes.string_at(translate(api.PyCapsule_GetPointer(cap, api.PyCapsule_GetName(cap)))).decode()


def run_mlir(dev, prog, n=37):
    x, y = np.linspace(-3, 3, n, dtype=np.float32), np.linspace(1, -1, n, dtype=np.float32)
    X, Y = dev.upload(x), dev.upload(y)
    cnt = dev.launch(dev.load_module(prog.vxbin), "saxpy_exp",
                     pack_args(MLIR_SPEC.params, [X.address, Y.address, 2.0, n]), grid=5, block=8)
    return dev.download(Y, np.float32), np.maximum(2 * x + y, np.exp(x)), cnt


def test_mlir_translated_kernel(programs):
    """The hand-off format: LLVM IR from MLIR's translation, helpers as plain declarations."""
    got, ref, _ = run_mlir(bridge.FunctionalDevice(strict=True), programs["mlir"])
    np.testing.assert_allclose(got, ref, rtol=1e-6)
