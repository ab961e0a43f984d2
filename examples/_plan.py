"""A small plan for the CPU examples (a real job loads the one ``entrain-data plan`` wrote)."""

from entrain_data.plan import ParallelPlan, StagePlan, StageSegment


def example_plan(dp: int, pp: int = 1, microbatches: int = 3) -> ParallelPlan:
    """dp x pp ranks over the reference model's 4 LLM layers (encoders on the first stage)."""
    bounds = [(0, 4)] if pp == 1 else [(0, 1), (1, 4)]
    stages = tuple(
        StagePlan(i, (StageSegment("llm", None, a, b, i == 0, i == pp - 1),))
        for i, (a, b) in enumerate(bounds)
    )
    return ParallelPlan(
        world_size=dp * pp, gpus_per_node=8, dp=dp, tp=1, pp=pp, stages=stages,
        microbatches=microbatches, global_batch=16, max_tokens=4096, defer_budget=4096,
    )  # fmt: skip
