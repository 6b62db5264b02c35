"""The memory planner (passes/memory_plan.py) on its own."""

from __future__ import annotations

from gac_torch.passes.memory_plan import BufferUse, check_plan, plan_memory


def test_memory_planner_unit() -> None:
    bufs = [BufferUse("a", 1000, 0, 1), BufferUse("b", 1000, 1, 2), BufferUse("c", 1000, 2, 3),
            BufferUse("d", 4000, 4, 5), BufferUse("e", 10, 0, 5)]
    plan = plan_memory(bufs)
    check_plan(bufs, plan)
    assert plan.offsets["a"] == plan.offsets["c"] or plan.offsets["d"] in (plan.offsets["a"], plan.offsets["b"])
    assert plan.workspace_size <= 4096 + 256
    assert plan_memory([]).workspace_size == 0
