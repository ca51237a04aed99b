"""Flint's dialects: `aten` (captured compute), `dist` (SPMD communication)
and `chakra` (per-rank node graphs before emission). Sharding annotations
and the device grid come from xDSL's `shard` dialect."""

from xdsl.context import Context
from xdsl.dialects.builtin import Builtin
from xdsl.dialects.func import Func
from xdsl.dialects.shard import Shard

from flint.ir.aten import Aten
from flint.ir.chakra import Chakra
from flint.ir.dist import Dist

FLINT_DIALECTS = (Aten, Dist, Chakra)


def flint_context() -> Context:
    """A context with builtin, func, shard and Flint's dialects loaded."""
    ctx = Context()
    for d in (Builtin, Func, Shard, *FLINT_DIALECTS):
        ctx.load_dialect(d)
    return ctx
