"""`overlap-report`: per collective, how long it takes, how much compute can hide it, what stays exposed."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass

from flint.cost import collective_time_us, load_device, load_network, tensor_bytes
from flint.ir import dist
from flint.ir.aten import AtenOp, get_schedule
from flint.mesh import Mesh
from flint.passes.annotate_cost import aten_op_cost
from flint.passes.lower_to_chakra import _COLL_KIND, BARRIER_BYTES


def _payload_bytes(v) -> int:
    t = v.type.value_type if isinstance(v.type, dist.FutureType) else v.type
    return tensor_bytes(t.get_shape(), str(t.element_type))


def _future(op: Operation):
    if isinstance(op, dist.CollectiveOp | dist.RecvOp) and op.is_async:
        return op.result
    if isinstance(op, dist.SendOp | dist.BarrierOp):
        return op.token
    return None


@dataclass(frozen=True)
class OverlapReportPass(ModulePass):
    """Print, per communication op, its duration, the compute that can hide it and what stays exposed.

    For every `dist` collective, barrier, send and recv of every function (in
    program order), on ``device`` and ``network``:

    - ``duration_us``: the one collective formula
      (:func:`flint.cost.collective_time_us`, ring algorithm, on the network
      levels the group of rank 0 spans; sends and recvs by
      :meth:`flint.cost.Network.p2p_time_us` to rank 0's peer) with
      Chakra's sizes (the input buffer; broadcast as an all-reduce, barrier
      as 4 bytes), exactly what ``lower-to-chakra`` emits;
    - ``compute_us``: the roofline time of the `aten` ops between the start
      and its ``dist.wait`` (0 for the synchronous form), the compute that
      can run while it is in flight; a start marked ``flint.prefetch = K``
      (issued K iterations of its repeated function early) adds K whole
      bodies of compute;
    - ``exposed_us``: ``max(0, duration - compute)``.

    Each op is analysed alone: collectives in flight together share the
    compute between them, and a rank's collectives run one after another in
    the simulator, so the sum of exposed times is a lower bound on what the
    simulator reports. Totals are per step (a function repeated N times by the
    module's ``flint.schedule`` counts N times). Written to stderr; the module
    is unchanged.

    Options: ``device`` (preset or TOML path, default ``h100-sxm``),
    ``network`` (preset or TOML path, default ``dgx-h100``).
    """

    name = "overlap-report"

    device: str = "h100-sxm"
    network: str = "dgx-h100"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        device = load_device(self.device)
        network = load_network(self.network)
        weights: dict[str, int] = {}
        for name, count in get_schedule(op):
            weights[name] = weights.get(name, 0) + count
        lines = [f"overlap-report: device {self.device}, network {self.network}"]
        totals = [0.0, 0.0, 0.0]
        for fn in op.ops:
            if not isinstance(fn, func.FuncOp):
                continue
            rows = self._function(fn, device, network)
            if not rows:
                continue
            w = weights.get(fn.sym_name.data, 0)
            lines.append(f"@{fn.sym_name.data} (runs {w}x per step)")
            lines.append(f"  {'op':>5}  {'communication':<34} {'bytes':>12} {'duration_us':>12} "
                         f"{'compute_us':>12} {'exposed_us':>12}")
            for idx, what, nbytes, dur, comp in rows:
                exposed = max(0.0, dur - comp)
                lines.append(f"  {'#' + str(idx):>5}  {what:<34} {nbytes:>12} {dur:>12.3f} {comp:>12.3f} {exposed:>12.3f}")
                totals[0] += w * dur
                totals[1] += w * min(dur, comp)
                totals[2] += w * exposed
        if len(lines) == 1:
            lines.append("no communication ops: nothing to report")
        else:
            lines.append(f"per step: communication {totals[0]:.3f} us, hidden {totals[1]:.3f} us, "
                         f"exposed {totals[2]:.3f} us")
        print("\n".join(lines), file=sys.stderr)

    def _function(self, fn: func.FuncOp, device, network) -> list[tuple]:
        ops = list(fn.body.block.ops)
        pos = {o: i for i, o in enumerate(ops)}
        points = dist.prefetch_points(fn.body.block)  # prefetched ops issued elsewhere: where
        compute = [aten_op_cost(o, device)[2] if isinstance(o, AtenOp) else 0.0 for o in ops]
        rows = []
        for i, o in enumerate(ops):
            if not isinstance(o, dist.DistCommOp):
                continue
            shape = dist.grid_shape(o, o.grid)
            mesh = Mesh(shape)
            net = network.for_world(mesh.world_size)
            axes = o.axes()
            group = mesh.group(0, axes)
            if isinstance(o, dist.CollectiveOp | dist.BarrierOp):
                if len(group) == 1:
                    dur = 0.0
                    nbytes = _payload_bytes(o.input) if isinstance(o, dist.CollectiveOp) else 0
                else:
                    kind = _COLL_KIND[type(o)] if isinstance(o, dist.CollectiveOp) else _COLL_KIND[dist.AllReduceOp]
                    nbytes = _payload_bytes(o.input) if isinstance(o, dist.CollectiveOp) else BARRIER_BYTES
                    dur = collective_time_us(kind, nbytes, len(group), net.group_levels(group))
                what = f"{o.name.removeprefix('dist.')} axes {list(axes)} (n={len(group)})"
            else:
                nbytes = _payload_bytes(o.input if isinstance(o, dist.SendOp) else o.result)
                peer = mesh.peer(0, axes[0], o.offset.value.data)
                dur = net.p2p_time_us(0, peer, nbytes)
                what = f"{o.name.removeprefix('dist.')} axis {axes[0]} offset {o.offset.value.data}"
            fut = _future(o)
            comp = 0.0
            ahead = dist.prefetch_of(o)
            # where it is issued: after itself, or at its issue point (flint.prefetch_at) `ahead` iterations early
            issued = pos[points[o]] if ahead and o in points else i + 1
            if fut is not None:
                waits = [u.operation for u in fut.uses if isinstance(u.operation, dist.WaitOp) and u.operation in pos]
                if waits:
                    w = pos[waits[0]]
                    comp = sum(compute[issued:w]) if issued <= w else -sum(compute[w:issued])
            if ahead:  # issued `ahead` iterations early: that many whole bodies run in between
                comp += ahead * sum(compute)
                what += f" prefetch {ahead}"
            rows.append((i, what, nbytes, dur, comp))
        return rows
