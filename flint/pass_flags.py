"""The default pass pipelines and the ``--passes`` help of ``flint estimate``, ``simulate`` and ``emit``.

A module of its own so that ``flint --help`` and ``flint emit --help`` need not import xDSL; the
pipelines themselves run in :mod:`flint.schedule.pipelines`.
"""

#: FSDP2: each block's all-gather one block ahead, waits sunk, all-gathers and reduce-scatters on their streams
FSDP_PIPELINE = "reorder-all-gather{prefetch=1},sink-waits,assign-streams"
#: DDP: gradients all-reduced in 25 MiB buckets, asynchronously, waited for before the optimizer
DDP_PIPELINE = "bucket-collectives{bytes=26214400},sink-waits"
PASSES_HELP = ("step IR only: pass pipeline to run before lowering, flint-opt -p syntax, e.g. "
               "'reorder-all-gather{prefetch=2},assign-streams'; '' runs none; default: the plan's "
               f"default pipeline (FSDP: {FSDP_PIPELINE}; DDP: {DDP_PIPELINE}; otherwise none), and none on IR "
               "that flint-opt has scheduled (module attribute flint.scheduled_by)")
