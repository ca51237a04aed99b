"""Pass pipelines outside `flint-opt`: the default scheduling pipeline per recipe, and a runner.

``flint estimate``, ``flint simulate`` and ``flint emit`` run a pipeline on
step IR before lowering it: ``--passes 'p1{opt=v},p2'`` (the syntax of
``flint-opt -p``, parsed by xDSL's own pipeline parser, plug-in passes
included), ``--passes ''`` for none, and without ``--passes`` the default
pipeline of the plan recorded on the module (``flint.plan``), which
reproduces what PyTorch's runtime does for that recipe:

- FSDP (``dp_shard`` > 1, alone or with TP/HSDP): FSDP2 issues each block's
  all-gather one block ahead, in forward (implicit prefetch: the CPU runs
  ahead, rate-limited to one pending all-gather) and in backward (explicit
  backward prefetch), runs all-gathers and reduce-scatters on two streams of
  their own, and waits for reduce-scatters only at the end of backward:
  ``reorder-all-gather{prefetch=1},sink-waits,assign-streams``.
- DDP (``dp_replicate`` > 1 without ``dp_shard``): gradients are all-reduced
  in 25 MiB buckets (``bucket_cap_mb=25``), each issued asynchronously when
  its last gradient is ready and waited for before the optimizer:
  ``bucket-collectives{bytes=26214400},sink-waits``.
- anything else (TP alone, no plan): no pass; DTensor issues TP collectives
  in the compute stream's order, which is the captured order.

IR that ``flint-opt`` has already scheduled (a ``-p`` pipeline with a
scheduling pass: one of ``SCHEDULING_PASSES`` or a plug-in) records that
pipeline on the module (``flint.scheduled_by``), and gets no default
pipeline: the default's passes would redo the schedule on top of the
user's (``reorder-all-gather{prefetch=1}`` moving gathers back,
``assign-streams`` replacing their streams). ``--passes`` still runs.
"""

from __future__ import annotations

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.utils.exceptions import DiagnosticException, VerifyException

from flint.errors import FlintError
from flint.pass_flags import DDP_PIPELINE, FSDP_PIPELINE

# Flint's passes that schedule communication (move, regroup or re-stream it); plug-in passes count as such too.
SCHEDULING_PASSES = frozenset({"reorder-all-gather", "sink-waits", "hoist-starts", "assign-streams",
                               "bucket-collectives", "split-collectives", "micro-pipeline-tp"})
SCHEDULED_ATTR = "flint.scheduled_by"


def record_scheduling(module: ModuleOp, spec: str, builtin: frozenset[str] | set[str]) -> None:
    """Record on a module with a plan that the pipeline ``spec`` (flint-opt's ``-p``) scheduled it, if one of
    its passes schedules: one of :data:`SCHEDULING_PASSES`, or a plug-in (a pass not in ``builtin``)."""
    from xdsl.dialects.builtin import StringAttr
    from xdsl.utils.arg_spec import parse_pipeline

    from flint.plan import PLAN_ATTR

    if PLAN_ATTR not in module.attributes or not spec.strip():
        return
    if not any(p.name in SCHEDULING_PASSES or p.name not in builtin for p in parse_pipeline(spec)):
        return
    before = scheduled_by(module)
    module.attributes[SCHEDULED_ATTR] = StringAttr(f"{before},{spec.strip()}" if before else spec.strip())


def scheduled_by(module: ModuleOp) -> str | None:
    """The scheduling pipeline(s) flint-opt ran on the module (:func:`record_scheduling`), or None."""
    from xdsl.dialects.builtin import StringAttr

    attr = module.attributes.get(SCHEDULED_ATTR)
    return attr.data if isinstance(attr, StringAttr) else None


def default_pipeline(module: ModuleOp) -> str:
    """The pipeline reproducing PyTorch's runtime for the module's recorded plan ("" for none, and for a module
    flint-opt has scheduled already)."""
    from flint.plan import plan_of

    if scheduled_by(module) is not None:
        return ""
    try:
        plan = plan_of(module)
    except Exception:
        return ""
    if plan is None:
        return ""
    if plan.dp_shard > 1 or plan.cp > 1:  # with context parallelism FSDP shards over dp_shard x cp
        return FSDP_PIPELINE
    if plan.dp_replicate > 1:
        return DDP_PIPELINE
    return ""


def resolve(module: ModuleOp, passes: str | None) -> str:
    """``passes`` as given (``""``: none), or the default pipeline when ``None``."""
    return default_pipeline(module) if passes is None else passes.strip()


def run_pipeline(module: ModuleOp, spec: str, source: str = "") -> None:
    """Run the comma-separated pipeline ``spec`` on ``module``, verifying after every pass.

    Errors (unknown pass, bad option, a pass failing, a module that no
    longer verifies) are :class:`FlintError` naming the pass.
    """
    if not spec:
        return
    from xdsl.utils.exceptions import ArgSpecParseError

    from flint.passes.registry import all_passes, parse_passes

    where = f"{source}: " if source else ""
    try:
        pipeline = parse_passes(all_passes(), spec)
    except (ValueError, ArgSpecParseError, FlintError) as e:
        raise FlintError(f"--passes '{spec}': {e}") from None
    ctx = Context()
    for p in pipeline.passes:
        try:
            p.apply(ctx, module)
            module.verify()
        except (VerifyException, DiagnosticException, FlintError, ValueError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FlintError(f"{where}pass '{p.name}' failed: {msg}") from None
