"""Pipeline parallelism: the per-rank action order of PyTorch's own schedules."""

from flint.pipeline.schedules import SCHEDULES, Action, rank_actions, stage_ranks

__all__ = ["PIPELINE_FIELDS", "SCHEDULES", "Action", "rank_actions", "split_by_plan", "stage_ranks"]

# The plan fields pipeline-split reads (flint.plan.Plan).
PIPELINE_FIELDS = ("pp", "microbatches", "pp_schedule", "pp_virtual_stages", "pp_layers", "grad_sync", "pp_p2p")


def split_by_plan(module, plan) -> bool:
    """Run ``pipeline-split`` on ``module`` (ONE microbatch's step) as ``plan`` says; False if it asks for none.

    Both ways in use it: the importer on a captured step, ``flint expand`` on an
    expanded one.
    """
    if plan.pp <= 1 and plan.microbatches <= 1:
        return False
    from xdsl.context import Context

    from flint.passes.pipeline_split import PipelineSplitPass

    PipelineSplitPass(stages=plan.pp, schedule=plan.pp_schedule, microbatches=plan.microbatches,
                      virtual=plan.pp_virtual_stages, grad_sync=plan.grad_sync,
                      # ZeRO-2: the gathered parameters stay through the step (torch pipelining's
                      # set_reshard_after_backward(False) on non-last backwards; see pipeline-split)
                      reshard_after_backward=plan.zero != 2,
                      layers=tuple(plan.pp_layers or ()), p2p=plan.pp_p2p).apply(Context(), module)
    return True
