"""cpu native code (backends/cpu/native.py: llc + link, for huge modules and the cache): the
f16/bf16 conversions generic x86-64 code calls as library functions are in the shared object."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from gac_torch.backends.cpu import native

# one conversion per function, through memory (ctypes cannot read a half returned in xmm0)
CONVERSIONS = """
define void @f32_bf16(float %x, ptr %o) { %r = fptrunc float %x to bfloat
 store bfloat %r, ptr %o
 ret void }
define void @f64_bf16(double %x, ptr %o) { %r = fptrunc double %x to bfloat
 store bfloat %r, ptr %o
 ret void }
define void @f32_f16(float %x, ptr %o) { %r = fptrunc float %x to half
 store half %r, ptr %o
 ret void }
define void @f64_f16(double %x, ptr %o) { %r = fptrunc double %x to half
 store half %r, ptr %o
 ret void }
define void @f16_f32(ptr %i, ptr %o) { %h = load half, ptr %i
 %r = fpext half %h to float
 store float %r, ptr %o
 ret void }
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    try:
        so = native.shared_object(CONVERSIONS)
    except native.NativeUnavailable as e:
        pytest.fail(f"llc and a linker are installed with gac's cpu extra: {e}")
    path = tmp_path_factory.mktemp("native") / "conv.so"
    path.write_bytes(so)
    lib = ctypes.CDLL(str(path))  # failed before: undefined symbol __truncsfbf2
    for name, arg in (("f32_bf16", ctypes.c_float), ("f32_f16", ctypes.c_float),
                      ("f64_bf16", ctypes.c_double), ("f64_f16", ctypes.c_double)):
        getattr(lib, name).argtypes = [arg, ctypes.c_void_p]
    lib.f16_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _narrow(fn, values, dtype) -> torch.Tensor:
    out, got = ctypes.c_uint16(), []
    for x in values.tolist():
        fn(x, ctypes.addressof(out))
        got.append(out.value)
    return torch.tensor(np.array(got, np.uint16).view(np.int16)).view(dtype)


def _f32_values() -> np.ndarray:
    rng = np.random.default_rng(16)
    random_bits = rng.integers(0, 2**32, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near_f16 = (rng.standard_normal(3000) * np.exp(rng.uniform(-20, 12, 3000))).astype(np.float32)
    edges = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F7FFFFF,
                      0x477FF000, 0x477FEFFF, 0x47800000, 0x33000000, 0x33000001, 0x387FC000,
                      0x38800000, 0x00000001], np.uint32).view(np.float32)  # f16 max/inf/subnormal ties
    return np.concatenate([random_bits, near_f16, edges])


@pytest.mark.parametrize("name,dtype", [("f32_bf16", torch.bfloat16), ("f32_f16", torch.float16)])
def test_f32_to_narrow_rounds_as_torch(lib, name, dtype):
    x = _f32_values()
    got, want = _narrow(getattr(lib, name), x, dtype), torch.from_numpy(x).to(dtype)
    nan = torch.from_numpy(np.isnan(x))
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert got[nan].isnan().all()


@pytest.mark.parametrize("name,dtype", [("f64_bf16", torch.bfloat16), ("f64_f16", torch.float16)])
def test_f64_to_narrow_is_the_nearest(lib, name, dtype):
    """Rounded once (torch's own cast goes through f32, rounding twice): the nearest value,
    ties to even, so never farther from x than torch's."""
    rng = np.random.default_rng(17)
    with np.errstate(invalid="ignore"):  # the NaNs among the f32 values
        x = np.concatenate([rng.standard_normal(3000) * np.exp(rng.uniform(-30, 30, 3000)),
                            _f32_values().astype(np.float64) * (1 + 2.0**-30)])
    x = x[np.isfinite(x)]
    got = _narrow(getattr(lib, name), x, dtype).double()
    via_f32 = torch.from_numpy(x).to(dtype).double()
    xt = torch.from_numpy(x)
    assert ((got - xt).abs() <= (via_f32 - xt).abs()).all()
    assert (got == via_f32).float().mean() > 0.99  # the two differ only on double-rounding ties
    if dtype == torch.float16:  # numpy rounds f64 -> f16 directly
        with np.errstate(over="ignore"):  # beyond f16's range: inf, as ours
            assert np.array_equal(got.numpy(), x.astype(np.float16).astype(np.float64))


def test_f16_to_f32_every_value(lib):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    inp, out, got = ctypes.c_uint16(), ctypes.c_float(), np.empty(65536, np.float32)
    for k in range(65536):
        inp.value = int(h[k])
        lib.f16_f32(ctypes.addressof(inp), ctypes.addressof(out))
        got[k] = out.value
    want = h.view(np.float16).astype(np.float32)
    assert np.array_equal(got, want, equal_nan=True)
