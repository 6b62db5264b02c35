"""Shared by the benchmark scripts: CUDA-event timing (METHOD.md: events, after warm-up)."""

from __future__ import annotations

import torch


def time_ms(fn, args, iters: int) -> float:
    """Mean milliseconds of `iters` back-to-back calls, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
