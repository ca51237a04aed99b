"""Per-rank action orders taken from ``torch.distributed.pipelining``, not a copy.

PyTorch runs its schedules two ways, and Flint reads each the way it runs:

- *Single-stage* schedules (``ScheduleGPipe``, ``Schedule1F1B``) execute their
  own ``_step_microbatches`` loop. Flint runs that very loop with a recording
  stand-in for the ``PipelineStage`` (``forward_one_chunk`` /
  ``backward_one_chunk`` / ``get_*_send_ops`` / ``get_*_recv_ops`` append
  actions) and with ``_batch_p2p`` patched to record when each send or recv is
  issued. (Their ``pipeline_order`` attribute is not what runs: in torch 2.13
  ``Schedule1F1B._get_pipeline_order`` skips microbatch 0 on the last rank and
  fails torch's own ``_validate_schedule``.)
- *Multi-stage* schedules (``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``) execute
  ``pipeline_order_with_comms``, built by ``_PipelineScheduleRuntime`` from
  their ``pipeline_order``; Flint builds the schedule on stand-in stages
  (as ``torch.distributed.pipelining._schedule_visualizer`` does) and reads it.

The result per pipeline rank is a list of :class:`Action` in execution order:
``F`` (forward), ``B`` (full backward), ``I`` / ``W`` (input-gradient and
weight-gradient backward of the zero-bubble schedules), and ``SEND_F`` /
``RECV_F`` / ``SEND_B`` / ``RECV_B`` for the stage-boundary tensors.
``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` (FSDP hooks inside a stage) are
dropped: the captured program already holds its own collectives.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple
from unittest import mock

from flint.errors import FlintError

# Plan name -> torch schedule class name (torch.distributed.pipelining.schedules.get_schedule_class).
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "interleaved-zero-bubble": "InterleavedZeroBubble",
    "zbv-zero-bubble": "ZBVZeroBubble",
}
COMPUTE = ("F", "B", "I", "W")
# How stage-boundary send/recv wait (plan field pp_p2p, pipeline-split option p2p): see check_p2p.
P2P_MODES = ("schedule", "overlap", "blocking")
P2P = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class Action(NamedTuple):
    """One step of a pipeline rank: ``kind`` on ``stage`` for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:  # torch's own spelling, e.g. 2F0, 1SEND_B3
        return f"{self.stage}{self.kind}{self.microbatch}"


def check(schedule: str, pp: int, microbatches: int, virtual: int, source: str | None = None,
          counts: bool = True) -> None:
    """Refuse combinations torch's schedule classes do not run, naming the plan field.

    ``counts=False`` skips "1f1b needs at least pp microbatches" (a plan may
    name pp before its microbatches; capture and pipeline-split check it).
    """
    from flint.plan import PP_SCHEDULES, PlanError

    if schedule not in SCHEDULES:
        raise PlanError("pp_schedule", f"unknown schedule '{schedule}'; known: {', '.join(PP_SCHEDULES)}", source)
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise PlanError("pp_virtual_stages", f"schedule '{schedule}' runs one stage per rank, got {virtual}", source)
    if schedule == "zbv-zero-bubble" and virtual != 2:
        raise PlanError("pp_virtual_stages", f"schedule 'zbv-zero-bubble' runs exactly 2 stages per rank, got {virtual}", source)
    if schedule.startswith("interleaved") and virtual < 2:
        raise PlanError("pp_virtual_stages", f"schedule '{schedule}' needs at least 2 stages per rank, got {virtual}", source)
    if counts and schedule == "1f1b" and microbatches < pp:
        raise PlanError("microbatches", f"schedule '1f1b' needs at least pp = {pp} microbatches, got {microbatches}", source)
    if schedule.startswith("interleaved") and microbatches % pp:
        raise PlanError("microbatches", f"schedule '{schedule}' needs a multiple of pp = {pp} microbatches, "
                        f"got {microbatches}", source)


def check_p2p(mode: str, schedule: str, source: str | None = None) -> None:
    """Refuse a ``pp_p2p`` mode the schedule cannot run, naming the plan field.

    - ``schedule``: as torch runs ``schedule`` (:func:`sends_wait_at_step_end`): multi-stage
      schedules post every recv asynchronously at its ``RECV`` action and wait for it at the
      consuming compute, and wait for their sends after the last action; single-stage ones
      (GPipe, 1F1B) wait for each batched send/recv when issued.
    - ``overlap``: Megatron-LM's ``overlap_p2p_comm = True`` (recv of the next virtual
      micro-batch posted before the current compute, waited right before its use; sends
      asynchronous). On a multi-stage schedule that is what torch's runtime runs, so the order
      and lowering are the ``schedule`` ones. Megatron supports it only with virtual stages
      (``megatron/training/arguments.py``: "non-interleaved schedule does not support
      overlapping p2p communication"), so gpipe / 1f1b are refused.
    - ``blocking``: every send and recv waited where torch's order issues it, each recv issued
      after the compute before it (a CUDA stream runs the recv's kernel behind the compute queued
      before it). That is what torch's single-stage loops do (``_wait_batch_p2p(_batch_p2p(...))``
      right after issuing; Flint's ``schedule`` lowering of them posts each recv early and waits
      right before its use, which is more optimistic), and the semantics of Megatron-LM's
      ``overlap_p2p_comm = False``; but Megatron's non-overlapped interleaved schedule runs its own
      order, one batched exchange after each forward + backward pair, which is not reproduced: in
      torch's interleaved order, blocking synchronizes the ranks after every F and every B and
      overstates the cost.
    """
    from flint.plan import PlanError

    if mode not in P2P_MODES:
        raise PlanError("pp_p2p", f"unknown value '{mode}'; known: {', '.join(P2P_MODES)}", source)
    if mode == "overlap" and schedule in SCHEDULES and not sends_wait_at_step_end(schedule):
        raise PlanError("pp_p2p", f"'overlap' needs a schedule with virtual stages (Megatron-LM: \"non-interleaved "
                        f"schedule does not support overlapping p2p communication\"), got pp_schedule = '{schedule}'",
                        source)


def stage_ranks(schedule: str, pp: int, virtual: int) -> list[int]:
    """The pipeline rank of every stage (``[stage] -> rank``): round-robin, or a V for ZBV."""
    n = pp * virtual
    if schedule == "zbv-zero-bubble":
        return [s if s < pp else n - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


def _stub_stage(pp: int, n_stages: int, index: int, log: list | None, st=None):
    """A stand-in ``PipelineStage`` (``st``: an earlier one, reset and reused: autospec is slow)."""
    from torch.distributed.pipelining.stage import PipelineStage

    if st is None:
        st = mock.create_autospec(PipelineStage, instance=True)
    else:
        st.reset_mock()
    st.group_rank, st.group_size, st.submod, st.num_stages = 0, pp, None, n_stages
    st.stage_index, st.is_first, st.is_last = index, index == 0, index == n_stages - 1
    if log is not None:
        def op(kind: str, skip: bool):
            return lambda mb, *a, **k: [] if skip else [Action(kind, index, mb)]

        st.get_fwd_recv_ops.side_effect = op("RECV_F", st.is_first)
        st.get_fwd_send_ops.side_effect = op("SEND_F", st.is_last)
        st.get_bwd_recv_ops.side_effect = op("RECV_B", st.is_last)
        st.get_bwd_send_ops.side_effect = op("SEND_B", st.is_first)
        st.forward_one_chunk.side_effect = lambda mb, *a, **k: log.append(Action("F", index, mb))
        st.backward_one_chunk.side_effect = lambda mb, *a, **k: log.append(Action("B", index, mb))
    return st


@lru_cache(maxsize=64)
def _actions(schedule: str, pp: int, microbatches: int, virtual: int) -> tuple[tuple[Action, ...], ...]:
    from torch.distributed.pipelining import schedules as S

    cls = S.get_schedule_class(SCHEDULES[schedule])
    n_stages = pp * virtual
    if issubclass(cls, S.PipelineScheduleSingle):
        out = []
        # The constructor computes every rank's pipeline_order (O(pp x microbatches), not what runs, see the
        # module docstring): computed by torch once, and the same object handed to every rank's schedule.
        orders: dict = {}
        real = cls._get_pipeline_order

        def pipeline_order(self):
            key = (self._num_stages, self._n_microbatches)
            if key not in orders:
                orders[key] = real(self)
            return orders[key]

        stub = None
        for rank in range(pp):
            log: list[Action] = []
            stub = _stub_stage(pp, n_stages, rank, log, stub)
            with mock.patch.object(cls, "_get_pipeline_order", pipeline_order):
                sched = cls(stub, microbatches)

            def issue(ops, desc=None):
                log.extend(ops)
                return []

            # The stage's buffers and shapes (_initialize_stage) are runtime infrastructure, not order.
            with mock.patch.object(S, "_batch_p2p", issue), \
                    mock.patch.object(S, "_sorted_batch_p2p", lambda ops, desc=None: {0: issue(ops)} if ops else {}), \
                    mock.patch.object(S, "_wait_batch_p2p", lambda work: None), \
                    mock.patch.object(sched, "_initialize_stage", lambda *a, **k: None):
                sched._step_microbatches()
            out.append(tuple(log))
        return tuple(out)
    stub = _stub_stage(pp, n_stages, 0, None)
    sched = cls([stub] * virtual, microbatches)
    runtime = S._PipelineScheduleRuntime([stub] * virtual, microbatches)
    compute_only = {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in sched.pipeline_order.items()}
    runtime._prepare_schedule_with_comms(compute_only)
    kinds = set(COMPUTE) | set(P2P)
    out = []
    for rank in range(pp):
        acts = runtime.pipeline_order_with_comms[rank]
        out.append(tuple(Action(a.computation_type.value, a.stage_index, a.microbatch_index)
                         for a in acts if a.computation_type.value in kinds))
    return tuple(out)


def sends_wait_at_step_end(schedule: str) -> bool:
    """True when torch issues every send of ``schedule`` asynchronously and waits for it at the step's end.

    Multi-stage schedules run in ``_PipelineScheduleRuntime._step_microbatches``, which
    keeps each ``SEND_F`` / ``SEND_B``'s work in ``send_ops`` and waits them all after the
    last action; single-stage ones (GPipe, 1F1B) wait their sends at the next batched p2p.
    """
    from torch.distributed.pipelining import schedules as S

    return not issubclass(S.get_schedule_class(SCHEDULES[schedule]), S.PipelineScheduleSingle)


def rank_actions(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Every pipeline rank's actions, in the order PyTorch's schedule runs them."""
    check(schedule, pp, microbatches, virtual)
    try:
        return [list(a) for a in _actions(schedule, pp, microbatches, virtual)]
    except (ValueError, RuntimeError, AssertionError) as e:
        raise FlintError(f"torch.distributed.pipelining refuses schedule '{schedule}' with pp={pp}, "
                         f"microbatches={microbatches}, virtual stages={virtual}: {str(e).splitlines()[0]}") from None
