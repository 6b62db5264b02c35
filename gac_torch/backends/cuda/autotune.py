"""The autotuner of the cuda target (options `autotune`, torch.compile's mode="max-autotune").

For one partition: compile it with the current choices to learn which kernels have a choice
(gpu/tuning.py), then once per candidate index with that candidate forced on every key that has
it, time every kernel on the device (torch.profiler: CUPTI sees the driver-API launches), and
keep per key the candidate whose kernels took the least time. The result goes into the arch's
tuning table on disk; the partition is then compiled (and cached) with it. Compile time grows by
the number of variants (2-3 today), which is what max-autotune means in every backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from gac_torch.backends.gpu import tuning

log = logging.getLogger("gac_torch.tuning")
ITERS = 10


def tune(build: Callable[[], Any], measure: Callable[[Any], Mapping[str, float]], arch: str) -> dict[str, str]:
    """`build()` compiles the partition (inside a tuning session) and returns what `measure`
    runs; `measure(x)` gives ms per call of each kernel by name. Returns the new table entries."""
    with tuning.session(tuning.load_table(arch)) as base:
        build()
    tunable: dict[str, tuning.Choice] = {}
    for choices in base.kernels.values():
        for c in choices:
            if len(c.candidates) > 1:
                tunable.setdefault(c.key, c)
    if not tunable:
        return {}
    times: dict[str, dict[str, float]] = {}
    for j in range(max(len(c.candidates) for c in tunable.values())):
        force = {k: c.candidates[j] for k, c in tunable.items() if j < len(c.candidates)}
        with tuning.session(force=force) as s:
            ms = measure(build())
        for name, choices in s.kernels.items():
            for c in choices:
                if c.key in force and c.chosen == force[c.key] and name in ms:
                    per = times.setdefault(c.key, {})
                    per[c.chosen] = per.get(c.chosen, 0.0) + ms[name]
    best = {k: min(t, key=t.__getitem__) for k, t in times.items() if len(t) == len(tunable[k].candidates)}
    if best:
        path = tuning.save_table(arch, best, {k: times[k] for k in best})
        log.info("gac autotune: %d keys measured, table %s: %s", len(best), path,
                 ", ".join(f"{k}={v}" for k, v in best.items()))
    return best


def kernel_times(call: Callable[[], Any], iters: int = ITERS) -> dict[str, float]:
    """ms per call of every kernel `call()` launches (after a warm-up)."""
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            out[e.name] = out.get(e.name, 0.0) + us / iters / 1e3
    return out


def random_inputs(signature: Any, device: str = "cuda") -> list | None:
    """Seeded inputs of the signature's static shapes; None when a shape is dynamic or an input
    is not floating point (random indices could address outside a tensor)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for spec in signature.inputs:
        dtype = getattr(spec, "dtype", None)
        shape = getattr(spec, "shape", None)
        if dtype is None or shape is None or not all(isinstance(d, int) for d in shape) \
                or not dtype.is_floating_point:
            return None
        out.append(torch.randn(tuple(shape), generator=g).to(device, dtype))
    return out
