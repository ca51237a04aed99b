"""`assign-streams`: put collectives on named communication streams."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass

from flint.errors import FlintError
from flint.ir import dist
from flint.passes.scheduling import data_parallel_axes, functions


@dataclass(frozen=True)
class AssignStreamsPass(ModulePass):
    """Queue each collective kind on a named communication stream (``stream`` attribute).

    The simulator gives every rank one in-order queue per stream, so
    collectives on different streams overlap each other (the default: one
    collective stream for all). Collectives over the same communicator
    (grid axes) still run one at a time in program order, on any stream: as
    one NCCL communicator does, and as FSDP2's all-gather and reduce-scatter
    streams share the shard process group. ``lower-to-chakra`` keeps that
    order in the Chakra traces, so consumers that serialize all communication
    of a rank (ASTRA-sim) see every group's collectives in the same order on
    every member.

    Options, one stream name per kind (empty: leave the kind on the default
    stream): ``all-gather`` (default ``all_gather``), ``reduce-scatter``
    (default ``reduce_scatter``), ``all-reduce``, ``all-to-all``,
    ``broadcast`` (default empty: tensor-parallel all-reduces stay in the
    compute stream's order, as DTensor issues them). FSDP2 runs all-gathers
    and reduce-scatters on two streams of their own: the defaults.

    ``data-parallel`` (default empty: by kind only): every collective over
    data-parallel grid axes only (the plan's ``dp`` axes, else the axes named
    ``dp_shard`` / ``dp_replicate``) goes to this stream, whatever its kind, so
    that a tensor-parallel all-gather / reduce-scatter never queues behind a
    gradient reduction: Megatron-LM's distributed optimizer reduce-scatters
    gradients and all-gathers parameters on the data-parallel communicator,
    apart from the tensor-parallel one.
    """

    name = "assign-streams"

    all_gather: str = "all_gather"
    reduce_scatter: str = "reduce_scatter"
    all_reduce: str = ""
    all_to_all: str = ""
    broadcast: str = ""
    data_parallel: str = ""

    def __post_init__(self) -> None:
        for field in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "data_parallel"):
            v = getattr(self, field)
            if v and not v.replace("_", "").replace("-", "").isalnum():
                raise FlintError(f"{self.name}: option {field.replace('_', '-')}=\"{v}\" is not a stream name "
                                 "(letters, digits, '_' and '-')")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        names = {dist.AllGatherOp: self.all_gather, dist.ReduceScatterOp: self.reduce_scatter,
                 dist.AllReduceOp: self.all_reduce, dist.AllToAllOp: self.all_to_all,
                 dist.BroadcastOp: self.broadcast}
        dp_axes = data_parallel_axes(op) if self.data_parallel else frozenset()
        for fn in functions(op):
            for o in fn.body.block.ops:
                stream = names.get(type(o))
                if dp_axes and isinstance(o, dist.CollectiveOp) and o.axes() and set(o.axes()) <= dp_axes:
                    stream = self.data_parallel
                if stream:
                    o.attributes[dist.STREAM_ATTR] = StringAttr(stream)
