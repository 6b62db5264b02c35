"""Static memory plan for a program's intermediate buffers (target-neutral).

A backend lists every intermediate buffer with its size and the first and last step (kernel
launch, call, ...) that touches it; the planner packs them into one workspace so that buffers
whose live ranges do not overlap share bytes. The runtime then allocates the workspace once per
run (through the framework's caching allocator) and hands out `base + offset` pointers.

Algorithm: greedy by size (largest first), each buffer placed at the lowest aligned offset that
does not collide with an already placed buffer whose live range overlaps. This is the usual
"greedy by size" offset planner (TFLite, XLA's heap simulator use variants of it); it is optimal
for chains and within a few percent on typical graphs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BufferUse:
    """One intermediate buffer: `first`..`last` are inclusive step indices where it is live."""

    name: str
    size: int  # bytes
    first: int
    last: int
    align: int = 256


@dataclass(frozen=True)
class MemoryPlan:
    offsets: dict[str, int]  # buffer name -> byte offset in the workspace
    workspace_size: int  # bytes; 0 when there are no intermediates
    unplanned_size: int  # what one allocation per buffer would take (for reports)

    def reuse_ratio(self) -> float:
        return self.workspace_size / self.unplanned_size if self.unplanned_size else 1.0


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def plan_memory(buffers: list[BufferUse]) -> MemoryPlan:
    placed: list[tuple[BufferUse, int]] = []
    offsets: dict[str, int] = {}
    # Largest first; ties by earlier start so plans are deterministic.
    for buf in sorted(buffers, key=lambda b: (-b.size, b.first, b.name)):
        size = max(buf.size, 1)
        # Byte ranges already taken by buffers live at the same time as `buf`.
        taken = sorted(
            (off, off + max(other.size, 1))
            for other, off in placed
            if other.first <= buf.last and buf.first <= other.last
        )
        offset = 0
        for lo, hi in taken:
            if offset + size <= lo:
                break
            offset = max(offset, _round_up(hi, buf.align))
        placed.append((buf, offset))
        offsets[buf.name] = offset
    workspace = max((off + max(b.size, 1) for b, off in placed), default=0)
    unplanned = sum(_round_up(max(b.size, 1), b.align) for b in buffers)
    return MemoryPlan(offsets, _round_up(workspace, 256) if workspace else 0, unplanned)


def check_plan(buffers: list[BufferUse], plan: MemoryPlan) -> None:
    """Raise if two buffers that are live at the same time overlap in the workspace."""
    for i, a in enumerate(buffers):
        oa = plan.offsets[a.name]
        assert oa % a.align == 0 and oa + a.size <= plan.workspace_size, a
        for b in buffers[i + 1 :]:
            ob = plan.offsets[b.name]
            live_together = a.first <= b.last and b.first <= a.last
            bytes_overlap = oa < ob + b.size and ob < oa + a.size
            if live_together and bytes_overlap and a.size and b.size:
                raise AssertionError(f"buffers {a.name} and {b.name} overlap while both live")
