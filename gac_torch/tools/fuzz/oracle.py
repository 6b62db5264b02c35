"""The fuzzer's oracle: is gac's output the eager output, up to the output dtype's rounding?

Rules, per output tensor:
- dtype and shape equal eager's; integer and bool values equal exactly;
- non-finite elements match eager exactly: a NaN where eager has NaN, the same infinity where
  eager has one, and nothing non-finite where eager is finite. One exception, where eager is the
  one off: a finite gac element where eager has NaN/inf passes if the float64 reference is finite
  there and gac is within tolerance of it (eager's vectorized cpu gelu gives NaN for +inf where
  its own scalar path and float64 give inf: fuzz seed 1978), and likewise a NaN/inf of gac
  where eager has the other kind, when float64 gives exactly gac's (pow(inf, gelu(inf)) on a
  machine whose vectorized gelu makes that NaN: seed 108 with AVX512). Never the other way round;
- finite float elements within (rtol, atol) of eager (TOL, by dtype). Where they are not, the
  float64 reference (the whole program run in float64, rounded to the output dtype) decides: gac
  passes when its largest error against it, in units of the tolerance, is at most 1 or at most
  eager's own largest error (gac is no further from the exact answer than eager is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TOL = {  # (rtol, atol)
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-9),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def _units(x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|x - ref| in units of the dtype's tolerance around ref (float64)."""
    rtol, atol = TOL[dtype]
    return (x - ref).abs() / (atol + rtol * ref.abs())


def _nonfinite(got: torch.Tensor, eager: torch.Tensor) -> str | None:
    g_bad, e_bad = ~got.isfinite(), ~eager.isfinite()
    if bool((g_bad != e_bad).any()):
        i = int((g_bad != e_bad).flatten().nonzero()[0])
        return (f"non-finite elements differ (flat index {i}: gac {got.flatten()[i].item()}, "
                f"eager {eager.flatten()[i].item()})")
    if bool((got.isnan() != eager.isnan()).any()) or not torch.equal(got[e_bad & ~eager.isnan()],
                                                                       eager[e_bad & ~eager.isnan()]):
        return "non-finite elements differ (NaN vs inf, or the sign of an infinity)"
    return None


def _eager_alone_non_finite(got: torch.Tensor, eager: torch.Tensor,
                            ref: Callable[[], torch.Tensor | None]) -> bool:
    """Do gac and eager differ only where eager is non-finite, and is gac the float64
    reference's value there (finite and within tolerance, or the same NaN / infinity)?"""
    g_bad, e_bad = ~got.isfinite(), ~eager.isfinite()
    if bool((g_bad & ~e_bad).any()):
        return False  # gac non-finite where eager is finite: never excused
    both = g_bad & e_bad
    differ = both & ((got.isnan() != eager.isnan()) | (~got.isnan() & ~eager.isnan() & (got != eager)))
    only = e_bad & ~g_bad
    if not bool(only.any() or differ.any()):
        return False
    r = ref()
    if r is None or r.shape != eager.shape:
        return False
    r = r.detach().cpu().to(eager.dtype).double()
    g = got.double()
    if bool(differ.any()):  # (NaN vs inf: gac must be exactly what float64 gives)
        rd, gd = r[differ], g[differ]
        if not bool(((rd.isnan() & gd.isnan()) | (~rd.isnan() & (rd == gd))).all()):
            return False
    if bool(only.any()):
        ro = r[only]
        if not bool(ro.isfinite().all()) or float(_units(g[only], ro, eager.dtype).max()) > 1:
            return False
    return True


def compare_tensor(got, eager: torch.Tensor, ref: Callable[[], torch.Tensor | None]) -> str | None:
    """None when got passes, else why not. ref() gives the float64 reference (or None)."""
    if not isinstance(got, torch.Tensor):
        return f"expected a tensor, got {type(got).__name__}"
    if got.dtype != eager.dtype:
        return f"dtype {got.dtype}, eager {eager.dtype}"
    if got.shape != eager.shape:
        return f"shape {tuple(got.shape)}, eager {tuple(eager.shape)}"
    got, eager = got.detach().cpu(), eager.detach().cpu()
    if not eager.is_floating_point():
        if torch.equal(got, eager):
            return None
        i = int((got != eager).flatten().nonzero()[0])
        return f"values differ at flat index {i}: gac {got.flatten()[i].item()}, eager {eager.flatten()[i].item()}"
    why = _nonfinite(got, eager)
    if why and not _eager_alone_non_finite(got, eager, ref):
        return why
    if got.numel() == 0:
        return None
    fin = eager.isfinite() & got.isfinite()
    g, e = got[fin].double(), eager[fin].double()
    err = _units(g, e, eager.dtype)
    if err.numel() == 0 or float(err.max()) <= 1:
        return None
    i = int(err.argmax())
    detail = (f"max error {float(err.max()):.3g} x tolerance at element {i} of the finite ones: "
              f"gac {g[i].item():.8g}, eager {e[i].item():.8g}")
    r = ref()
    if r is None or r.shape != eager.shape:
        return detail + " (no float64 reference)"
    r = r.detach().cpu().to(eager.dtype).double()[fin]
    ok = r.isfinite()
    if not bool(ok.any()):
        return detail + " (float64 reference not finite)"
    err_g = float(_units(g[ok], r[ok], eager.dtype).max())
    err_e = float(_units(e[ok], r[ok], eager.dtype).max())
    if err_g <= max(1.0, err_e):
        return None
    return detail + f"; against float64: gac {err_g:.3g}, eager {err_e:.3g} x tolerance"


def compare(got: Sequence, eager: Sequence, ref: Callable[[], Sequence | None], what: str = "output"
            ) -> str | None:
    """Compares output lists; ref() computes the float64 reference outputs (lazily, once)."""
    if len(got) != len(eager):
        return f"{len(got)} {what}s, eager has {len(eager)}"
    cache: list = []

    def ref_i(i: int):
        def get():
            if not cache:
                try:
                    cache.append(ref())
                except Exception:  # float64 eager rejects the program: no tie-break  # noqa: BLE001
                    cache.append(None)
            return None if cache[0] is None else cache[0][i]
        return get

    for i, (g, e) in enumerate(zip(got, eager, strict=True)):
        why = compare_tensor(g, e, ref_i(i))
        if why:
            return f"{what} {i}: {why}"
    return None
