"""Any Chakra trace into the `chakra` dialect, and back.

:func:`trace_to_ir` turns a :class:`~flint.trace.Trace` (typically from
:func:`flint.chakra.read_trace`: Flint's own files, ``chakra_converter``
output, other generators') into one ``chakra.graph @rank<N>`` per requested
rank, in the dialect's *concrete* form: collectives carry ``group = <id>``
(the comm-group id; 0 means all ranks, Chakra's empty ``pg_name``) and
sends/recvs ``peer = <rank>``. Rows become ops in table order, which is
topological, so every dependency names an earlier node value.

The module records what the graphs alone cannot hold, as module attributes:
``flint.world_size`` and ``flint.comm_groups`` (``{"<id>" = [ranks...]}``).
Per node, a node id different from its row position is kept as
``flint.node_id``, and the node types the dialect has no op for (Chakra
METADATA_NODE, MEM_LOAD_NODE, MEM_STORE_NODE; the simulator runs them on the
compute stream) become ``chakra.comp`` with ``flint.node_kind = "metadata" |
"mem_load" | "mem_store"``. Send/recv tags absent in the file stay ``-1``.
A node's named stream (Flint's ``comm_stream`` attribute) becomes the op's
``stream`` (on ``chakra.comp``, the discardable ``stream`` attribute the
lowering sets on a decomposed collective's reductions) and a send's
``comm_sms`` its ``sms``. Everything else a ``ReadNodeTable`` keeps verbatim
(unknown attributes, ``is_cpu_op``) is dropped: the IR is for analysis and
rewriting, the files are the archive.

:func:`trace_from_concrete_ir` goes back to a :class:`Trace` (ranks without a
graph are an error), so ``read_trace -> trace_to_ir -> print -> parse ->
trace_from_concrete_ir`` round-trips the columns the simulator reads (durations to the 7 significant
digits xDSL prints floats with).

Scale: xDSL parses roughly 650 generic ops per second (``DESIGN.md``), so a
module is capped at :data:`MAX_OPS` nodes; pick ranks with ``ranks=`` (the
CLI's ``--rank``) for bigger traces.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Sequence

from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, FloatAttr, IntegerAttr, ModuleOp, StringAttr, f64, i64
from xdsl.ir import Block, Region, SSAValue

from flint.errors import FlintError, run_cli
from flint.ir import chakra
from flint.trace import CollKind, NodeKind, NodeTableBuilder, RankProgram, Trace

MAX_OPS = 50_000
WORLD_ATTR = "flint.world_size"
GROUPS_ATTR = "flint.comm_groups"
NODE_ID_ATTR = "flint.node_id"
NODE_KIND_ATTR = "flint.node_kind"
_OTHER_KINDS = {NodeKind.METADATA: "metadata", NodeKind.MEM_LOAD: "mem_load", NodeKind.MEM_STORE: "mem_store"}
_OTHER_BY_NAME = {v: k for k, v in _OTHER_KINDS.items()}


def _check_ranks(trace: Trace, ranks: Sequence[int] | None) -> list[int]:
    if ranks is None:
        return list(range(trace.world_size))
    out = []
    for r in ranks:
        if not 0 <= int(r) < trace.world_size:
            raise FlintError(f"rank {r} out of range: the trace has ranks 0..{trace.world_size - 1}")
        if int(r) not in out:
            out.append(int(r))
    if not out:
        raise FlintError("no ranks requested")
    return out


def _graph_of(program: RankProgram, rank: int) -> chakra.GraphOp:
    t = program.table
    groups = program.groups()
    peers = program.peers()
    block = Block()
    values: list[SSAValue] = []
    for row in range(len(t)):
        data = [values[int(i)] for i in t.data_deps(row)]
        ctrl = [values[int(i)] for i in t.ctrl_deps(row)]
        kind = int(t.kind[row])
        name = t.names[row]
        dur = float(t.duration_us[row])
        props: dict = {"node_name": StringAttr(name)}
        stream = t.stream_names[int(t.comm_stream[row])] if t.comm_stream is not None and t.comm_stream[row] >= 0 else ""
        if stream and kind in (NodeKind.COLL, NodeKind.SEND, NodeKind.RECV):
            props["stream"] = StringAttr(stream)
        if t.comm_sms is not None and kind == NodeKind.SEND and t.comm_sms[row] > 0:
            props["sms"] = IntegerAttr(int(t.comm_sms[row]), i64)
        if not math.isnan(dur):
            props["duration_us"] = FloatAttr(max(dur, 0.0), f64)
        if kind == NodeKind.COLL:
            props.update(kind=chakra.CollKindAttr(chakra.CollKind[CollKind(int(t.comm_type[row])).name]),
                         group=IntegerAttr(int(groups[row]), i64),
                         bytes=IntegerAttr(max(int(t.comm_bytes[row]), 0), i64))
            op = chakra.CollOp.build(operands=[data, ctrl], result_types=[chakra.NODE], properties=props)
        elif kind in (NodeKind.SEND, NodeKind.RECV):
            peer = int(peers[row])
            if peer < 0:
                raise FlintError(f"rank {rank}: {'send' if kind == NodeKind.SEND else 'recv'} node "
                                 f"{int(t.node_ids[row])} ('{name}') has no peer rank (comm_dst / comm_src); "
                                 "the concrete IR needs one")
            props.update(peer=IntegerAttr(peer, i64), tag=IntegerAttr(int(t.comm_tag[row]), i64),
                         bytes=IntegerAttr(max(int(t.comm_bytes[row]), 0), i64))
            cls = chakra.SendOp if kind == NodeKind.SEND else chakra.RecvOp
            op = cls.build(operands=[data, ctrl], result_types=[chakra.NODE], properties=props)
        else:
            flops, nbytes = int(t.flops[row]), int(t.tensor_bytes[row])
            op = chakra.CompOp(name, flops=flops if flops >= 0 else None, bytes=nbytes if nbytes >= 0 else None,
                               duration_us=max(dur, 0.0) if not math.isnan(dur) else None,
                               data_deps=data, ctrl_deps=ctrl)
            if stream:  # a decomposed collective's reduction kernel, on its communication stream
                op.attributes["stream"] = StringAttr(stream)
            if kind in _OTHER_KINDS:
                op.attributes[NODE_KIND_ATTR] = StringAttr(_OTHER_KINDS[NodeKind(kind)])
            elif kind != NodeKind.COMP:
                raise FlintError(f"rank {rank}: node {int(t.node_ids[row])} ('{name}') has node type {kind}, "
                                 "which the chakra dialect cannot hold")
        if int(t.node_ids[row]) != row:
            op.attributes[NODE_ID_ATTR] = IntegerAttr(int(t.node_ids[row]), i64)
        block.add_op(op)
        values.append(op.node)
    return chakra.GraphOp.create(properties={"sym_name": StringAttr(f"rank{rank}")}, regions=[Region(block)])


def trace_to_ir(trace: Trace, ranks: Sequence[int] | None = None, *, max_ops: int = MAX_OPS) -> ModuleOp:
    """One concrete ``chakra.graph @rank<N>`` per rank of ``ranks`` (default: all); see the module docstring."""
    chosen = _check_ranks(trace, ranks)
    total = sum(len(trace.ranks[r].table) for r in chosen)
    if total > max_ops:
        per = total / len(chosen)
        fit = max(int(max_ops // per), 0) if per else 0
        raise FlintError(
            f"{total:,} nodes on {len(chosen)} rank(s) is more than the IR handles well ({max_ops:,} ops; "
            f"xDSL parses about 650 ops/s); choose ranks with --rank"
            + (f" (about {fit} rank(s) of this trace fit)" if fit else
               " (a single rank of this trace is already too big; raise the limit with --max-ops at your own risk)"))
    from flint.chakra.check import cycle_rows

    checked: set[int] = set()
    for r in chosen:
        t = trace.ranks[r].table
        if id(t) in checked:
            continue
        checked.add(id(t))
        cyc = cycle_rows(t)
        if len(cyc):
            row = int(cyc[0])
            where = getattr(t, "source", "") or f"rank {r}"
            raise FlintError(f"{where}: node {int(t.node_ids[row])} ('{t.names[row]}') is on a dependency cycle "
                             f"({len(cyc)} node(s) can never run); the chakra dialect cannot express cycles")
    graphs = [_graph_of(trace.ranks[r], r) for r in chosen]
    module = ModuleOp(graphs)
    module.attributes[WORLD_ATTR] = IntegerAttr(trace.world_size, i64)
    module.attributes[GROUPS_ATTR] = DictionaryAttr(
        {str(g): ArrayAttr([IntegerAttr(int(m), i64) for m in members]) for g, members in sorted(trace.comm_groups.items())})
    return module


def trace_from_concrete_ir(module: ModuleOp) -> Trace:
    """The :class:`Trace` of a module :func:`trace_to_ir` made (every rank needs its ``@rank<N>`` graph)."""
    world_attr = module.attributes.get(WORLD_ATTR)
    if not isinstance(world_attr, IntegerAttr):
        raise FlintError(f"module has no '{WORLD_ATTR}' attribute; it was not made by trace_to_ir / flint import-trace")
    world = world_attr.value.data
    graphs: dict[int, chakra.GraphOp] = {}
    for op in module.ops:
        if isinstance(op, chakra.GraphOp):
            name = op.sym_name.data
            if not (name.startswith("rank") and name[4:].isdigit()):
                raise FlintError(f"chakra.graph @{name} is not named @rank<N>")
            graphs[int(name[4:])] = op
    missing = [r for r in range(world) if r not in graphs]
    if missing:
        raise FlintError(f"module holds graphs for {len(graphs)} of {world} ranks (missing rank {missing[0]}); "
                         "a Trace needs every rank: import the trace without --rank")
    programs = []
    for r in range(world):
        b = NodeTableBuilder()
        rows: dict[SSAValue, int] = {}
        for op in graphs[r].body.block.ops:
            if not isinstance(op, chakra.NodeOp):
                raise FlintError(f"@rank{r}: '{op.name}' is not a concrete Chakra node (only comp, coll, send, recv)")
            data = [rows[v] for v in op.data_deps]
            ctrl = [rows[v] for v in op.ctrl_deps]
            nid = op.attributes.get(NODE_ID_ATTR)
            kw = dict(duration_us=op.duration_us.value.data if op.duration_us is not None else float("nan"),
                      data_deps=data, ctrl_deps=ctrl, node_id=nid.value.data if isinstance(nid, IntegerAttr) else None)
            name = op.node_name.data
            if isinstance(op, chakra.CompOp):
                stream = op.attributes.get("stream")
                row = b.add_comp(name, flops=op.flops.value.data if op.flops is not None else -1,
                                 tensor_bytes=op.bytes.value.data if op.bytes is not None else -1,
                                 stream=stream.data if isinstance(stream, StringAttr) else "", **kw)
            elif isinstance(op, chakra.CollOp):
                if op.group is None:
                    raise FlintError(f"@rank{r}: chakra.coll '{name}' is SPMD (grid_axes); expected group = <id>")
                row = b.add_coll(name, CollKind[op.kind.data.name], op.bytes.value.data, op.group.value.data,
                                 stream=op.stream.data if op.stream is not None else "", **kw)
            else:
                if op.peer is None:
                    raise FlintError(f"@rank{r}: {op.name} '{name}' is SPMD (offset); expected peer = <rank>")
                kw["stream"] = op.stream.data if op.stream is not None else ""
                if isinstance(op, chakra.SendOp):
                    row = b.add_send(name, op.bytes.value.data, op.peer.value.data, op.tag.value.data,
                                     sms=op.sms.value.data if op.sms is not None else 0, **kw)
                else:
                    row = b.add_recv(name, op.bytes.value.data, op.peer.value.data, op.tag.value.data, **kw)
            rows[op.node] = row
        table = b.build()
        for row, op in enumerate(graphs[r].body.block.ops):
            k = op.attributes.get(NODE_KIND_ATTR)
            if isinstance(k, StringAttr):
                if k.data not in _OTHER_BY_NAME:
                    raise FlintError(f"@rank{r}: {NODE_KIND_ATTR} \"{k.data}\" is not one of {', '.join(_OTHER_BY_NAME)}")
                table.kind[row] = _OTHER_BY_NAME[k.data]
        programs.append(RankProgram(table))
    groups_attr = module.attributes.get(GROUPS_ATTR)
    groups = ({int(k): tuple(m.value.data for m in v.data) for k, v in groups_attr.data.items()}
              if isinstance(groups_attr, DictionaryAttr) else {})
    return Trace(world, programs, groups)


def write_module_atomic(module: ModuleOp, path: str | os.PathLike) -> Path:
    """Print ``module`` to ``path`` through a temporary file and a rename."""
    from xdsl.printer import Printer

    from flint.fileio import atomic_text_file

    with atomic_text_file(path) as f:
        Printer(stream=f).print_op(module)
        f.write("\n")
    return Path(path)


def main(argv: Sequence[str] | None = None) -> int:
    """``flint import-trace DIR [--rank R ...] -o out.mlir``."""
    from flint.chakra.reader import COMM_GROUPS_HELP, read_trace

    ap = argparse.ArgumentParser(
        prog="flint import-trace",
        description="Import any Chakra ET trace (directory or DIR/PREFIX) into the chakra dialect: one concrete "
                    "chakra.graph @rank<N> per rank (collectives name their comm-group id, send/recv their peer).")
    ap.add_argument("trace", help="trace directory, DIR/PREFIX, or one rank file")
    ap.add_argument("--rank", type=int, action="append", dest="ranks", metavar="R",
                    help="import only rank R (repeatable; default: every rank)")
    ap.add_argument("--comm-groups", help=COMM_GROUPS_HELP)
    ap.add_argument("-o", "--output", required=True, help="output .mlir (written atomically; '-' for stdout)")
    ap.add_argument("--max-ops", type=int, default=MAX_OPS, help=f"refuse bigger modules (default {MAX_OPS:,})")
    args = ap.parse_args(argv)
    return run_cli("flint import-trace", _import, args)


def _import(args) -> int:
    from flint.chakra.reader import read_trace
    from flint.fileio import check_writable

    try:
        if args.output != "-":
            check_writable(args.output)
        trace = read_trace(args.trace, comm_groups=args.comm_groups)
        module = trace_to_ir(trace, args.ranks, max_ops=args.max_ops)
        module.verify()
        if args.output == "-":
            print(module)
        else:
            write_module_atomic(module, args.output)
            n = sum(len(list(g.body.block.ops)) for g in module.ops if isinstance(g, chakra.GraphOp))
            print(f"wrote {args.output}: {len(list(module.ops))} rank graph(s), {n} nodes", file=sys.stderr)
    except FlintError as e:
        print(f"flint import-trace: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
