"""The `chakra` dialect: one rank role's Chakra node graph before emission.

A ``chakra.graph`` holds the nodes every rank of one role executes, in
program order. Each node yields a ``!chakra.node`` value; a node's
dependencies are the node values it names in ``data(...)`` (it consumes their
output) and ``ctrl(...)`` (it merely runs after them, e.g. to keep a stream's
program order). SSA dominance makes dangling dependencies and cycles
unrepresentable.

The graph is still SPMD: collectives name a grid and grid axes, sends and
recvs an offset along one axis; the Chakra writer turns these into concrete
communicator groups and peer ranks per rank. Traces read back from disk are
concrete instead: their collectives carry ``group = <comm-group id>`` and
their sends/recvs ``peer = <rank>``.

``chakra.repeat`` keeps a repeated layer compact: its body runs ``count``
times; the body's block arguments are the nodes the previous iteration
yielded (the loop's operands for the first iteration), and its results are
what the last iteration yields. The writer and simulator unroll it; the IR
never does.

Units: ``flops`` (count), ``bytes`` (count), ``duration_us`` (microseconds).
For collectives, ``bytes`` is Chakra's ``comm_size``: the bytes of each
rank's *input* buffer.
"""

from __future__ import annotations

import math
from enum import auto
from typing import Sequence

from xdsl.dialects.builtin import (
    I64,
    DenseArrayBase,
    Float64Type,
    FloatAttr,
    FlatSymbolRefAttr,
    IntegerAttr,
    StringAttr,
    SymbolNameConstraint,
    f64,
    i64,
)
from xdsl.dialects.shard import ShardAxesAttr
from xdsl.dialects.utils import EnumAttribute
from xdsl.ir import Attribute, Dialect, ParametrizedAttribute, Region, SSAValue, SpacedOpaqueSyntaxAttribute, TypeAttribute
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    irdl_attr_definition,
    irdl_op_definition,
    opt_prop_def,
    prop_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.traits import HasParent, IsTerminator, NoTerminator, SymbolOpInterface
from xdsl.utils.exceptions import VerifyException
from xdsl.utils.str_enum import StrEnum

from flint.ir.dist import grid_shape
from flint.limits import INT32_MAX, MAX_REPEAT, MAX_SMS, MAX_WORLD_SIZE


@irdl_attr_definition
class NodeType(ParametrizedAttribute, TypeAttribute):
    """A Chakra node: the value other nodes name as a dependency."""

    name = "chakra.node"


NODE = NodeType()


class CollKind(StrEnum):
    """Chakra's CollectiveCommType, in lower case."""

    ALL_REDUCE = auto()
    REDUCE = auto()
    ALL_GATHER = auto()
    GATHER = auto()
    SCATTER = auto()
    BROADCAST = auto()
    ALL_TO_ALL = auto()
    REDUCE_SCATTER = auto()
    REDUCE_SCATTER_BLOCK = auto()
    BARRIER = auto()


@irdl_attr_definition
class CollKindAttr(EnumAttribute[CollKind], SpacedOpaqueSyntaxAttribute):
    """The kind of a ``chakra.coll`` node."""

    name = "chakra.coll_kind"

    assembly_format = "$value"


_DEPS = "(`data` `(` $data_deps^ `)`)? (`ctrl` `(` $ctrl_deps^ `)`)?"


class NodeOp(IRDLOperation):
    """Base of every node: a name, dependencies, one ``!chakra.node`` result."""

    node_name = prop_def(StringAttr)
    duration_us = opt_prop_def(FloatAttr[Float64Type])
    data_deps = var_operand_def(NodeType)
    ctrl_deps = var_operand_def(NodeType)
    node = result_def(NodeType)

    irdl_options = (AttrSizedOperandSegments(as_property=True),)

    def _verify_nonneg(self, what: str, attr: IntegerAttr | FloatAttr | None) -> None:
        if attr is not None and attr.value.data < 0:
            raise VerifyException(f"'{self.name}' op {what} {attr.value.data} must be non-negative")

    def verify_(self) -> None:
        self._verify_nonneg("duration_us", self.duration_us)
        if self.duration_us is not None and not math.isfinite(self.duration_us.value.data):
            raise VerifyException(f"'{self.name}' op duration_us {self.duration_us.value.data} must be finite")


def _props(name: str, duration_us: float | None, **ints: int | None) -> dict[str, Attribute]:
    props: dict[str, Attribute] = {"node_name": StringAttr(name)}
    if duration_us is not None:
        props["duration_us"] = FloatAttr(float(duration_us), f64)
    for k, v in ints.items():
        if v is not None:
            props[k] = IntegerAttr(int(v), i64)
    return props


@irdl_op_definition
class CompOp(NodeOp):
    """A compute node (Chakra COMP_NODE): ``flops`` is its num_ops,
    ``bytes`` its tensor_size (bytes read and written)."""

    name = "chakra.comp"

    flops = opt_prop_def(IntegerAttr[I64])
    bytes = opt_prop_def(IntegerAttr[I64])

    assembly_format = (
        "$node_name (`flops` `=` $flops^)? (`bytes` `=` $bytes^)? (`duration_us` `=` $duration_us^)? "
        + _DEPS + " attr-dict"
    )

    def __init__(self, name: str, *, flops: int | None = None, bytes: int | None = None,
                 duration_us: float | None = None, data_deps: Sequence[SSAValue] = (), ctrl_deps: Sequence[SSAValue] = ()):
        super().__init__(operands=[list(data_deps), list(ctrl_deps)], result_types=[NODE],
                         properties=_props(name, duration_us, flops=flops, bytes=bytes))

    def verify_(self) -> None:
        super().verify_()
        self._verify_nonneg("flops", self.flops)
        self._verify_nonneg("bytes", self.bytes)


class CommNodeOp(NodeOp):
    """Shared fields of communication nodes: bytes and where the peers are.

    SPMD form: ``grid`` + ``grid_axes``; concrete form (read from disk):
    ``group`` (collectives) or ``peer`` (send/recv). Exactly one form is set.
    """

    bytes = prop_def(IntegerAttr[I64])
    grid = opt_prop_def(FlatSymbolRefAttr)
    grid_axes = opt_prop_def(ShardAxesAttr)

    def axes(self) -> tuple[int, ...]:
        return tuple(self.grid_axes.get_values()) if self.grid_axes is not None else ()

    def verify_spmd(self, concrete: Attribute | None, concrete_name: str) -> None:
        self._verify_nonneg("bytes", self.bytes)
        if (self.grid is None) != (self.grid_axes is None):
            raise VerifyException(f"'{self.name}' op needs both grid and grid_axes, or neither")
        if self.grid is None and concrete is None:
            raise VerifyException(f"'{self.name}' op needs either grid and grid_axes (SPMD) or {concrete_name} (concrete)")
        if self.grid is not None and concrete is not None:
            raise VerifyException(f"'{self.name}' op has both grid and grid_axes (SPMD) and {concrete_name} (concrete)")
        if self.grid is not None:
            shape = grid_shape(self, self.grid)
            for a in self.axes():
                if not 0 <= a < len(shape):
                    raise VerifyException(
                        f"'{self.name}' op grid axis {a} out of range for rank-{len(shape)} grid {self.grid}"
                    )


@irdl_op_definition
class CollOp(CommNodeOp):
    """A collective node (Chakra COMM_COLL_NODE) of one ``kind``.

    ``stream`` names the communication stream it is queued on (absent: the
    default collective stream); the simulator runs one in-order queue per
    stream.
    """

    name = "chakra.coll"

    kind = prop_def(CollKindAttr)
    group = opt_prop_def(IntegerAttr[I64])
    stream = opt_prop_def(StringAttr)

    assembly_format = (
        "$kind $node_name (`on` $grid^ `grid_axes` `=` $grid_axes)? (`group` `=` $group^)? "
        "(`stream` `=` $stream^)? `bytes` `=` $bytes "
        "(`duration_us` `=` $duration_us^)? " + _DEPS + " attr-dict"
    )

    def verify_(self) -> None:
        super().verify_()
        self.verify_spmd(self.group, "group")
        if self.group is not None and not 0 <= self.group.value.data <= INT32_MAX:
            raise VerifyException(f"'chakra.coll' op group {self.group.value.data} out of range: comm-group ids "
                                  f"are int32 (0..{INT32_MAX})")


class P2PNodeOp(CommNodeOp):
    """Send/recv fields: SPMD ``offset`` (or a per-coordinate ``peers`` table, 0 = the rank skips the
    node, as on `dist.send`), or a concrete ``peer`` rank; ``stream``: the named channel it is queued
    on (absent: the rank's one send / one recv queue), as on `chakra.coll`; ``sms``: SMs its
    communication kernel holds from issue to finish, slowing the rank's compute meanwhile (absent:
    none, a copy-engine transfer)."""

    tag = prop_def(IntegerAttr[I64])
    offset = opt_prop_def(IntegerAttr[I64])
    peers = opt_prop_def(DenseArrayBase)
    peer = opt_prop_def(IntegerAttr[I64])
    stream = opt_prop_def(StringAttr)
    sms = opt_prop_def(IntegerAttr[I64])

    def verify_(self) -> None:
        super().verify_()
        self.verify_spmd(self.peer, "peer")
        if self.sms is not None and not 1 <= self.sms.value.data <= MAX_SMS:
            raise VerifyException(f"'{self.name}' op sms {self.sms.value.data} out of range 1..{MAX_SMS}")
        if not -1 <= self.tag.value.data <= INT32_MAX:
            raise VerifyException(f"'{self.name}' op tag {self.tag.value.data} out of range: Chakra's comm_tag is "
                                  f"an int32 (0..{INT32_MAX}; -1: absent in an imported trace)")
        if self.peer is not None and not 0 <= self.peer.value.data < MAX_WORLD_SIZE:
            raise VerifyException(f"'{self.name}' op peer {self.peer.value.data} out of range 0..{MAX_WORLD_SIZE - 1}")
        if self.grid is not None:
            if len(self.axes()) != 1:
                raise VerifyException(f"'{self.name}' op needs exactly one grid axis, got {list(self.axes())}")
            if self.offset is None:
                raise VerifyException(f"'{self.name}' op in SPMD form needs an offset")


_P2P = (
    "$node_name (`on` $grid^ `grid_axes` `=` $grid_axes `offset` `=` $offset)? (`peers` `=` qualified($peers)^)? "
    "(`peer` `=` $peer^)? (`stream` `=` $stream^)? (`sms` `=` $sms^)? "
    "`tag` `=` $tag `bytes` `=` $bytes (`duration_us` `=` $duration_us^)? " + _DEPS + " attr-dict"
)


@irdl_op_definition
class SendOp(P2PNodeOp):
    """A send node (Chakra COMM_SEND_NODE) to the peer at ``offset`` (or rank ``peer``)."""

    name = "chakra.send"
    assembly_format = _P2P


@irdl_op_definition
class RecvOp(P2PNodeOp):
    """A receive node (Chakra COMM_RECV_NODE) from the peer at ``offset`` (or rank ``peer``)."""

    name = "chakra.recv"
    assembly_format = _P2P


@irdl_op_definition
class YieldOp(IRDLOperation):
    """Ends a ``chakra.repeat`` body: the nodes the next iteration depends on."""

    name = "chakra.yield"

    values = var_operand_def(NodeType)

    traits = traits_def(IsTerminator())

    assembly_format = "($values^)? attr-dict"


@irdl_op_definition
class RepeatOp(IRDLOperation):
    """Run the body ``count`` times; see the module docstring."""

    name = "chakra.repeat"

    count = prop_def(IntegerAttr[I64])
    inits = var_operand_def(NodeType)
    outs = var_result_def(NodeType)
    body = region_def("single_block")

    def __init__(self, count: int, inits: Sequence[SSAValue], body: Region):
        super().__init__(operands=[list(inits)], result_types=[[NODE] * len(inits)],
                         properties={"count": IntegerAttr(count, i64)}, regions=[body])

    @classmethod
    def parse(cls, parser: Parser) -> RepeatOp:
        count = parser.parse_integer(allow_boolean=False, allow_negative=False)
        unresolved = parser.parse_comma_separated_list(parser.Delimiter.PAREN, parser.parse_unresolved_operand)
        inits = [parser.resolve_operand(u, NODE) for u in unresolved]
        attrs = parser.parse_optional_attr_dict_with_keyword()
        op = cls(count, inits, parser.parse_region())
        if attrs is not None:
            op.attributes.update(attrs.data)
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(f" {self.count.value.data} (")
        printer.print_list(self.inits, printer.print_operand)
        printer.print_string(")")
        printer.print_op_attributes(self.attributes, print_keyword=True)
        printer.print_string(" ")
        printer.print_region(self.body)

    def verify_(self) -> None:
        if not 1 <= self.count.value.data <= MAX_REPEAT:
            raise VerifyException(f"'chakra.repeat' op count {self.count.value.data:,} out of range 1..{MAX_REPEAT:,}")
        block = self.body.block
        n = len(self.inits)
        if len(block.args) != n or len(self.outs) != n:
            raise VerifyException(
                f"'chakra.repeat' op has {n} initial nodes, {len(block.args)} block arguments and "
                f"{len(self.outs)} results; all three must match"
            )
        term = block.last_op
        if not isinstance(term, YieldOp) or len(term.values) != n:
            raise VerifyException(f"'chakra.repeat' op body must end in 'chakra.yield' of {n} nodes")


@irdl_op_definition
class GraphOp(IRDLOperation):
    """The node graph of one rank role, named by ``sym_name``."""

    name = "chakra.graph"

    sym_name = prop_def(SymbolNameConstraint())
    body = region_def("single_block")

    traits = traits_def(SymbolOpInterface(), NoTerminator())

    assembly_format = "$sym_name attr-dict-with-keyword $body"

    def verify_(self) -> None:
        _verify_deps_defined(self.body.block, set())


def _verify_deps_defined(block, seen: set) -> None:
    """Every dependency names a node defined earlier (SSA dominance; a node cannot depend on itself)."""
    for op in block.ops:
        for v in op.operands:
            owner = getattr(v, "op", None)
            if owner is not None and owner not in seen:
                what = "itself" if owner is op else f"node '{getattr(owner, 'node_name', None) and owner.node_name.data}', defined later"
                e = VerifyException(f"'{op.name}' op depends on {what}: a dependency must name an earlier node "
                                    "(cycles cannot be expressed)")
                e.op = op  # type: ignore[attr-defined]
                raise e
        if isinstance(op, RepeatOp):
            _verify_deps_defined(op.body.block, seen)
        seen.add(op)


Chakra = Dialect(
    "chakra",
    [CompOp, CollOp, SendOp, RecvOp, RepeatOp, YieldOp, GraphOp],
    [NodeType, CollKindAttr],
)
