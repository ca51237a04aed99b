"""Pipeline parallelism: the per-rank action order of PyTorch's own schedules."""

from flint.pipeline.schedules import SCHEDULES, Action, rank_actions, stage_ranks

__all__ = ["SCHEDULES", "Action", "rank_actions", "stage_ranks"]
