"""The `dist` dialect: SPMD collectives and point-to-point communication.

Every op is rank-independent: it names a device grid (a ``shard.grid``
symbol) and the grid axes it runs over, never concrete ranks. The group of a
rank along axes ``A`` is every rank that shares its coordinates on the other
axes (see :mod:`flint.mesh`, the one rank <-> coordinate mapping).

Collectives come in two forms, as in PyTorch's functional collectives:

- synchronous: the result is the tensor itself;
- asynchronous: the result is a ``!dist.future<tensor<...>>`` and a separate
  ``dist.wait`` yields the tensor, so scheduling passes can move the start and
  the wait independently.

``dist.send`` / ``dist.recv`` name their peer as an ``offset`` along one grid
axis: the peer of the rank at coordinate ``c`` is at ``(c + offset) mod n``.
A send with offset ``k`` matches the recv with offset ``-k`` and the same tag.
When the peer depends on the coordinate (a tree, a broadcast from a root),
``peers = array<i64: ...>`` gives the offset per coordinate instead (and
``offset`` is 0); a ``0`` entry means the rank at that coordinate does not
run the op. An `aten.op` may likewise carry ``flint.active = array<i64:
...>`` (1 = runs) over the grid axis ``flint.active_axis``: where it does
not run, its result is its first operand (a skipped reduction leaves the
buffer as it was).
"""

from __future__ import annotations

from abc import ABC
from typing import ClassVar, Sequence

from xdsl.dialects.builtin import (
    BytesAttr,
    DenseArrayBase,
    FlatSymbolRefAttr,
    IntegerAttr,
    I64,
    NoneType,
    SymbolRefAttr,
    TensorType,
    i16,
    i64,
)
from xdsl.dialects.shard import GridOp, ReductionKind, ReductionKindAttr, ShardAxesAttr
from xdsl.ir import Attribute, Block, Dialect, Region, Operation, ParametrizedAttribute, SSAValue, TypeAttribute
from xdsl.irdl import (
    IRDLOperation,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    opt_result_def,
    prop_def,
    result_def,
    traits_def,
    region_def,
    var_operand_def,
    var_result_def,
)
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.traits import IsTerminator, SymbolTable
from xdsl.utils.exceptions import VerifyException

from flint.limits import INT32_MAX, MAX_TENSOR_ELEMENTS


@irdl_attr_definition
class FutureType(ParametrizedAttribute, TypeAttribute):
    """The pending result of an asynchronous communication op.

    ``!dist.future<T>`` holds a value of type ``T`` (a tensor, or ``none`` for
    ops without a payload such as ``dist.send`` and ``dist.barrier``) that is
    available only after the matching ``dist.wait``.
    """

    name = "dist.future"

    value_type: Attribute

    def __init__(self, value_type: Attribute):
        super().__init__(value_type)


def axes_attr(axes: Sequence[int]) -> ShardAxesAttr:
    """Build the grid-axes property (a ``array<i16: ...>``) from a list of ints."""
    return ShardAxesAttr(i16, BytesAttr(i16.pack(list(axes))))


def lookup_grid(op: Operation, grid: SymbolRefAttr) -> GridOp:
    """Find the ``shard.grid`` named by ``grid`` from ``op``, or raise."""
    found = SymbolTable.lookup_symbol(op, grid)
    if not isinstance(found, GridOp):
        raise VerifyException(f"'{op.name}' op grid {grid} does not name a 'shard.grid'")
    return found


def grid_shape(op: Operation, grid: SymbolRefAttr) -> tuple[int, ...]:
    return tuple(lookup_grid(op, grid).shape.get_values())


class DistCommOp(IRDLOperation, ABC):
    """Base of every `dist` communication op: a grid and the axes it spans."""

    grid = prop_def(FlatSymbolRefAttr)
    grid_axes = prop_def(ShardAxesAttr)

    def axes(self) -> tuple[int, ...]:
        return tuple(self.grid_axes.get_values())

    def group_size(self) -> int:
        """Number of ranks in each group along this op's axes."""
        shape = grid_shape(self, self.grid)
        n = 1
        for a in self.axes():
            n *= shape[a]
        return n

    def verify_axes(self) -> None:
        axes = self.axes()
        shape = grid_shape(self, self.grid)
        if not axes:
            raise VerifyException(f"'{self.name}' op needs at least one grid axis")
        if len(set(axes)) != len(axes):
            raise VerifyException(f"'{self.name}' op grid axes {list(axes)} repeat an axis")
        for a in axes:
            if not 0 <= a < len(shape):
                raise VerifyException(
                    f"'{self.name}' op grid axis {a} out of range for rank-{len(shape)} grid {self.grid}"
                )


def _payload_type(op: Operation, result: Attribute) -> Attribute:
    """The tensor a (possibly asynchronous) result carries."""
    if isinstance(result, FutureType):
        return result.value_type
    return result


def verify_static_tensor(op: Operation, t: Attribute, what: str) -> None:
    """A tensor Flint can price: static, non-negative dimensions and at most MAX_TENSOR_ELEMENTS elements."""
    if not isinstance(t, TensorType):
        return
    shape = list(t.get_shape())
    if any(d < 0 for d in shape):
        raise VerifyException(f"'{op.name}' op {what} {t} has a dynamic dimension; Flint needs static shapes "
                              "(capture with concrete sizes)")
    n = 1
    for d in shape:
        n *= d
    if n > MAX_TENSOR_ELEMENTS:
        raise VerifyException(f"'{op.name}' op {what} {t} has {n:,} elements; the limit is {MAX_TENSOR_ELEMENTS:,}")


def _tensor(op: Operation, t: Attribute, what: str) -> TensorType:
    if not isinstance(t, TensorType):
        raise VerifyException(f"'{op.name}' op {what} must be a tensor, got {t}")
    return t


class CollectiveOp(DistCommOp, ABC):
    """A collective over the group along ``grid_axes``: one input, one result.

    The result is the output tensor (synchronous form) or a
    ``!dist.future`` of it (asynchronous form, completed by ``dist.wait``).
    """

    input = operand_def(TensorType)
    result = result_def(TensorType | FutureType)

    def __init__(
        self,
        input: SSAValue,
        grid: str,
        axes: Sequence[int],
        result_type: Attribute,
        *,
        reduction: str | None = None,
        **int_props: int,
    ):
        """Build from Python: ``AllGatherOp(x, "grid", [1], out_t, gather_dim=0)``.

        ``result_type`` is the output tensor type, or a ``FutureType`` of it
        for the asynchronous form; ``int_props`` are the op's integer
        properties (``gather_dim``, ``scatter_dim``, ``split_dim``,
        ``concat_dim``, ``root``).
        """
        props: dict[str, Attribute] = {"grid": FlatSymbolRefAttr(grid), "grid_axes": axes_attr(axes)}
        props.update({k: IntegerAttr(v, i64) for k, v in int_props.items()})
        if reduction is not None:
            props["reduction"] = ReductionKindAttr(ReductionKind(reduction))
        super().__init__(operands=[input], result_types=[result_type], properties=props)

    @property
    def is_async(self) -> bool:
        return isinstance(self.result.type, FutureType)

    def output_type(self) -> TensorType:
        return _tensor(self, _payload_type(self, self.result.type), "result")

    def expected_shape(self, in_shape: list[int], n: int) -> list[int]:
        return in_shape

    def verify_dim(self, dim: int, rank: int, what: str) -> None:
        if not 0 <= dim < rank:
            raise VerifyException(f"'{self.name}' op {what} {dim} out of range for rank-{rank} tensor")

    def verify_(self) -> None:
        self.verify_axes()
        in_t = self.input.type
        assert isinstance(in_t, TensorType)
        out_t = self.output_type()
        verify_static_tensor(self, in_t, "input")
        verify_static_tensor(self, out_t, "result")
        if in_t.element_type != out_t.element_type:
            raise VerifyException(
                f"'{self.name}' op element type {out_t.element_type} of the result does not match "
                f"{in_t.element_type} of the input"
            )
        in_shape = list(in_t.get_shape())
        expected = self.expected_shape(in_shape, self.group_size())
        if list(out_t.get_shape()) != expected:
            raise VerifyException(
                f"'{self.name}' op result shape {list(out_t.get_shape())} does not match expected "
                f"{expected} for input {in_shape} over a group of {self.group_size()}"
            )


_COLL_FORMAT = "$input `on` $grid `grid_axes` `=` $grid_axes {extra} attr-dict `:` type($input) `->` type($result)"


@irdl_op_definition
class AllReduceOp(CollectiveOp):
    """Reduce the input over the group; every member receives the full result.

    Chakra ``comm_size`` is the input's bytes. Output shape = input shape.
    """

    name = "dist.all_reduce"

    reduction = prop_def(ReductionKindAttr, default_value=ReductionKindAttr(ReductionKind.SUM))

    assembly_format = _COLL_FORMAT.format(extra="(`reduction` `=` $reduction^)?")


@irdl_op_definition
class AllGatherOp(CollectiveOp):
    """Concatenate every member's input along ``gather_dim``, in group order.

    Output shape = input shape with ``gather_dim`` multiplied by the group size.
    """

    name = "dist.all_gather"

    gather_dim = prop_def(IntegerAttr[I64])

    assembly_format = _COLL_FORMAT.format(extra="`gather_dim` `=` $gather_dim")

    def expected_shape(self, in_shape: list[int], n: int) -> list[int]:
        d = self.gather_dim.value.data
        self.verify_dim(d, len(in_shape), "gather_dim")
        return [s * n if i == d else s for i, s in enumerate(in_shape)]


@irdl_op_definition
class ReduceScatterOp(CollectiveOp):
    """Reduce the inputs over the group, then give member ``i`` the ``i``-th
    slice along ``scatter_dim``.

    Output shape = input shape with ``scatter_dim`` divided by the group size
    (which must divide it).
    """

    name = "dist.reduce_scatter"

    scatter_dim = prop_def(IntegerAttr[I64])
    reduction = prop_def(ReductionKindAttr, default_value=ReductionKindAttr(ReductionKind.SUM))

    assembly_format = _COLL_FORMAT.format(extra="`scatter_dim` `=` $scatter_dim (`reduction` `=` $reduction^)?")

    def expected_shape(self, in_shape: list[int], n: int) -> list[int]:
        d = self.scatter_dim.value.data
        self.verify_dim(d, len(in_shape), "scatter_dim")
        if in_shape[d] % n:
            raise VerifyException(
                f"'{self.name}' op scatter_dim {d} of size {in_shape[d]} is not divisible by the group size {n}"
            )
        return [s // n if i == d else s for i, s in enumerate(in_shape)]


@irdl_op_definition
class AllToAllOp(CollectiveOp):
    """Split the input into group-size chunks along ``split_dim``, send chunk
    ``j`` to member ``j``, and concatenate what arrives along ``concat_dim``.
    """

    name = "dist.all_to_all"

    split_dim = prop_def(IntegerAttr[I64])
    concat_dim = prop_def(IntegerAttr[I64])

    assembly_format = _COLL_FORMAT.format(extra="`split_dim` `=` $split_dim `concat_dim` `=` $concat_dim")

    def expected_shape(self, in_shape: list[int], n: int) -> list[int]:
        s, c = self.split_dim.value.data, self.concat_dim.value.data
        self.verify_dim(s, len(in_shape), "split_dim")
        self.verify_dim(c, len(in_shape), "concat_dim")
        if in_shape[s] % n:
            raise VerifyException(
                f"'{self.name}' op split_dim {s} of size {in_shape[s]} is not divisible by the group size {n}"
            )
        out = list(in_shape)
        out[s] //= n
        out[c] *= n
        return out


@irdl_op_definition
class BroadcastOp(CollectiveOp):
    """Every member receives the input of the member at position ``root`` of the group."""

    name = "dist.broadcast"

    root = prop_def(IntegerAttr[I64])

    assembly_format = _COLL_FORMAT.format(extra="`root` `=` $root")

    def verify_(self) -> None:
        super().verify_()
        r = self.root.value.data
        if not 0 <= r < self.group_size():
            raise VerifyException(f"'{self.name}' op root {r} out of range for a group of {self.group_size()}")


class _NoPayloadMixin:
    def verify_no_payload_result(self: DistCommOp, res) -> None:  # type: ignore[misc]
        if res is not None and res.type != FutureType(NoneType()):
            raise VerifyException(f"'{self.name}' op asynchronous result must be !dist.future<none>, got {res.type}")


@irdl_op_definition
class BarrierOp(DistCommOp, _NoPayloadMixin):
    """Every member waits until all members of the group arrived.

    With a ``!dist.future<none>`` result the barrier is asynchronous.
    """

    name = "dist.barrier"

    token = opt_result_def(FutureType)

    assembly_format = "`on` $grid `grid_axes` `=` $grid_axes attr-dict (`:` type($token)^)?"

    def verify_(self) -> None:
        self.verify_axes()
        self.verify_no_payload_result(self.token)


class PointToPointOp(DistCommOp, ABC):
    """Base of send and recv: one grid axis, a peer offset along it, a tag."""

    offset = prop_def(IntegerAttr[I64])
    tag = prop_def(IntegerAttr[I64])
    peers = opt_prop_def(DenseArrayBase)
    # Inside a `dist.steps` body: at step i the op's offset is offset + i * offset_step and its tag
    # tag + i * tag_step (absent: 0, the same every step).
    offset_step = opt_prop_def(IntegerAttr[I64])
    tag_step = opt_prop_def(IntegerAttr[I64])

    def offset_at(self, i: int = 0) -> int:
        """The uniform offset at step ``i`` of the enclosing `dist.steps` (0 outside one)."""
        step = self.offset_step.value.data if self.offset_step is not None else 0
        return self.offset.value.data + i * step

    def tag_at(self, i: int = 0) -> int:
        step = self.tag_step.value.data if self.tag_step is not None else 0
        return self.tag.value.data + i * step

    def peer_offsets(self) -> tuple[int, ...] | None:
        """The per-coordinate offsets (0: the rank skips the op), or None when ``offset`` is uniform."""
        return tuple(self.peers.get_values()) if self.peers is not None else None

    def verify_p2p(self) -> None:
        self.verify_axes()
        if len(self.axes()) != 1:
            raise VerifyException(f"'{self.name}' op needs exactly one grid axis, got {list(self.axes())}")
        n = self.group_size()
        k = self.offset.value.data
        table = self.peer_offsets()
        if table is not None:
            if k != 0:
                raise VerifyException(f"'{self.name}' op has both offset {k} and a peers table; give one")
            if len(table) != n:
                raise VerifyException(f"'{self.name}' op peers table has {len(table)} entries for an axis of size {n}")
            if all(o % n == 0 for o in table):
                raise VerifyException(f"'{self.name}' op peers table names no peer on any coordinate")
        elif k % n == 0:
            raise VerifyException(
                f"'{self.name}' op offset {k} names the rank itself on an axis of size {n}"
            )
        if self.offset_step is not None and table is not None:
            raise VerifyException(f"'{self.name}' op has a peers table and a per-step offset; give one")
        if not 0 <= self.tag.value.data <= INT32_MAX:
            raise VerifyException(f"'{self.name}' op tag {self.tag.value.data} out of range: Chakra's comm_tag is "
                                  f"an int32 (0..{INT32_MAX})")


@irdl_op_definition
class SendOp(PointToPointOp, _NoPayloadMixin):
    """Send the input to the rank at ``offset`` along the single grid axis.

    Matches the ``dist.recv`` on that rank with offset ``-offset`` and the same
    tag. With a ``!dist.future<none>`` result the send is asynchronous.
    """

    name = "dist.send"

    input = operand_def(TensorType)
    token = opt_result_def(FutureType)

    assembly_format = (
        "$input `to` $grid `grid_axes` `=` $grid_axes `offset` `=` $offset (`peers` `=` qualified($peers)^)? `tag` `=` $tag "
        "(`offset_step` `=` $offset_step^)? (`tag_step` `=` $tag_step^)? attr-dict `:` type($input) (`->` type($token)^)?"
    )

    def verify_(self) -> None:
        self.verify_p2p()
        self.verify_no_payload_result(self.token)


@irdl_op_definition
class RecvOp(PointToPointOp):
    """Receive a tensor from the rank at ``offset`` along the single grid axis.

    Matches the ``dist.send`` on that rank with offset ``-offset`` and the
    same tag. The result is the tensor, or a ``!dist.future`` of it.
    """

    name = "dist.recv"

    result = result_def(TensorType | FutureType)

    assembly_format = (
        "`from` $grid `grid_axes` `=` $grid_axes `offset` `=` $offset (`peers` `=` qualified($peers)^)? `tag` `=` $tag "
        "(`offset_step` `=` $offset_step^)? (`tag_step` `=` $tag_step^)? attr-dict `:` type($result)"
    )

    @property
    def is_async(self) -> bool:
        return isinstance(self.result.type, FutureType)

    def verify_(self) -> None:
        self.verify_p2p()
        _tensor(self, _payload_type(self, self.result.type), "result")


@irdl_op_definition
class WaitOp(IRDLOperation):
    """Complete an asynchronous communication op.

    ``%t = dist.wait %f : T`` takes a ``!dist.future<T>`` and yields the ``T``;
    for ``!dist.future<none>`` there is no result (``dist.wait %f``).
    """

    name = "dist.wait"

    future = operand_def(FutureType)
    result = opt_result_def(TensorType)

    def __init__(self, future: SSAValue):
        t = future.type
        assert isinstance(t, FutureType)
        payload = t.value_type
        super().__init__(operands=[future], result_types=[[] if isinstance(payload, NoneType) else [payload]])

    def verify_(self) -> None:
        t = self.future.type
        assert isinstance(t, FutureType)
        if isinstance(t.value_type, NoneType):
            if self.result is not None:
                raise VerifyException(f"'dist.wait' op waits on {t} and must not have a result")
        elif self.result is None or self.result.type != t.value_type:
            got = "no result" if self.result is None else str(self.result.type)
            raise VerifyException(f"'dist.wait' op result must be {t.value_type} to match {t}, got {got}")

    @classmethod
    def parse(cls, parser: Parser) -> WaitOp:
        unresolved = parser.parse_unresolved_operand()
        attrs = parser.parse_optional_attr_dict()
        payload: Attribute = NoneType()
        if parser.parse_optional_punctuation(":") is not None:
            payload = parser.parse_type()
        future = parser.resolve_operand(unresolved, FutureType(payload))
        op = cls(future)
        op.attributes.update(attrs)
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_operand(self.future)
        if self.attributes:
            printer.print_op_attributes(self.attributes)
        if self.result is not None:
            printer.print_string(" : ")
            printer.print_attribute(self.result.type)


@irdl_op_definition
class YieldOp(IRDLOperation):
    """Ends a `dist.steps` body: the values the next step starts from."""

    name = "dist.yield"

    values = var_operand_def(TensorType)

    traits = traits_def(IsTerminator())

    assembly_format = "($values^ `:` type($values))? attr-dict"


# The step index of an op inside a `dist.steps` body shifts a slice of the carried buffer:
# ``flint.step_shift = array<i64: shift, modulus[, base]>`` on an `aten.slice.Tensor` /
# `aten.slice_scatter.default` (dim 0) means that at step i its ``start`` is
# ``base + (start - base + i * shift) mod modulus`` (base 0 when absent: the slice cycles through
# [base, base + modulus)) and its length stays ``end - start`` (a slice never wraps around: the emitting
# pass checks it for every step).
STEP_SHIFT_ATTR = "flint.step_shift"
# ``flint.in_place`` (unit) on an `aten.slice_scatter.default`: the op places its second operand into its
# first in place (a peer-to-peer copy or a kernel writing straight into a buffer), so its result is that
# buffer, not a new tensor: the memory model aliases it (flint.sim.lifetimes).
IN_PLACE_ATTR = "flint.in_place"


def step_slice(op: Operation, start: int, end: int, i: int) -> tuple[int, int]:
    """``(start, end)`` of a slice at step ``i`` (``flint.step_shift``; unchanged without it)."""
    attr = op.attributes.get(STEP_SHIFT_ATTR)
    if attr is None or i == 0:
        return start, end
    shift, modulus, *base = attr.get_values()
    b = base[0] if base else 0
    lo = b + (start - b + i * shift) % modulus
    return lo, lo + end - start


@irdl_op_definition
class StepsOp(IRDLOperation):
    """``count`` steps of a decomposed collective, one body: SPMD and compact however large the group.

    ``%token, %outs = dist.steps N (%inits) : T { ^bb0(%carried: T): ... dist.yield %next : T }``
    runs the body ``N`` times, step ``i`` (0-based) starting from what step ``i - 1`` yielded (step 0
    from ``%inits``); ``%outs`` is what the last step yielded. What varies with the step index is
    affine in it: a `dist.send` / `dist.recv` peer ``offset + i * offset_step`` and tag ``tag + i *
    tag_step``, and a slice of the carried buffer at ``(start + i * shift) mod modulus``
    (``flint.step_shift``). The body's sends are asynchronous: ``%token`` (a ``!dist.future<none>``)
    completes when all of them have. Consumers that need concrete steps (lower-to-chakra, verify-p2p)
    expand the body per step; the IR never does.
    """

    name = "dist.steps"

    count = prop_def(IntegerAttr[I64])
    inits = var_operand_def(TensorType)
    token = result_def(FutureType)
    outs = var_result_def(TensorType)
    body = region_def("single_block")

    def __init__(self, count: int, inits: Sequence[SSAValue], body: Region):
        super().__init__(operands=[list(inits)], result_types=[FutureType(NoneType()), [v.type for v in inits]],
                         properties={"count": IntegerAttr(count, i64)}, regions=[body])

    @classmethod
    def parse(cls, parser: Parser) -> "StepsOp":
        count = parser.parse_integer(allow_boolean=False, allow_negative=False)
        unresolved = parser.parse_comma_separated_list(parser.Delimiter.PAREN, parser.parse_unresolved_operand)
        types = []
        if parser.parse_optional_punctuation(":") is not None:
            types = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_type)
        if len(types) != len(unresolved):
            parser.raise_error(f"'dist.steps' expects {len(unresolved)} types after ':', got {len(types)}")
        inits = [parser.resolve_operand(u, t) for u, t in zip(unresolved, types)]
        attrs = parser.parse_optional_attr_dict_with_keyword()
        op = cls(count, inits, parser.parse_region())
        if attrs is not None:
            op.attributes.update(attrs.data)
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(f" {self.count.value.data} (")
        printer.print_list(self.inits, printer.print_operand)
        printer.print_string(")")
        if self.inits:
            printer.print_string(" : ")
            printer.print_list([v.type for v in self.inits], printer.print_attribute)
        printer.print_op_attributes(self.attributes, print_keyword=True)
        printer.print_string(" ")
        printer.print_region(self.body)

    def verify_(self) -> None:
        count = self.count.value.data
        if count < 1:
            raise VerifyException(f"'dist.steps' op count {count} must be >= 1")
        block = self.body.block
        types = [v.type for v in self.inits]
        if [a.type for a in block.args] != types:
            raise VerifyException(f"'dist.steps' op block arguments {[str(a.type) for a in block.args]} must match "
                                  f"its initial values {[str(t) for t in types]}")
        last = block.last_op
        if not isinstance(last, YieldOp) or [v.type for v in last.values] != types:
            raise VerifyException("'dist.steps' op body must end with a 'dist.yield' of the carried values' types")
        for o in block.ops:
            if isinstance(o, StepsOp | WaitOp | CollectiveOp | BarrierOp):
                raise VerifyException(f"'dist.steps' op body may hold sends, recvs and aten ops, not '{o.name}'")
            if isinstance(o, PointToPointOp):
                if isinstance(o, RecvOp) and o.is_async:
                    raise VerifyException("'dist.recv' op in a 'dist.steps' body must be synchronous")
                n = o.group_size()
                for i in (0, count - 1):
                    if not 0 <= o.tag_at(i) <= INT32_MAX:
                        raise VerifyException(f"'{o.name}' op tag at step {i} is {o.tag_at(i)}: out of range")
                if o.offset_step is not None and any(o.offset_at(i) % n == 0 for i in range(count)):
                    bad = next(i for i in range(count) if o.offset_at(i) % n == 0)
                    raise VerifyException(f"'{o.name}' op offset at step {bad} is {o.offset_at(bad)}: the rank itself "
                                          f"on an axis of size {n}")


def steps_of(op: Operation) -> int:
    """How many steps the `dist.steps` enclosing ``op`` runs (1 outside one)."""
    parent = op.parent_op()
    return parent.count.value.data if isinstance(parent, StepsOp) else 1


COLLECTIVE_OPS: tuple[type[CollectiveOp], ...] = (AllReduceOp, AllGatherOp, ReduceScatterOp, AllToAllOp, BroadcastOp)

Dist = Dialect(
    "dist",
    [AllReduceOp, AllGatherOp, ReduceScatterOp, AllToAllOp, BroadcastOp, BarrierOp, SendOp, RecvOp, WaitOp, StepsOp, YieldOp],
    [FutureType],
)


# -- scheduling attributes ----------------------------------------------------------
# Scheduling passes express *when* and *where* communication runs with two
# discardable attributes, so the IR keeps one body per repeated block:
#
#   stream = "ag"            on a collective: the named communication stream it is
#                            queued on (default: the one collective stream). Each
#                            stream is an in-order queue; collectives over the same
#                            group still run one at a time in program order (one
#                            NCCL communicator).
#   flint.prefetch = K : i64 on an all-gather start in a repeated function (and on
#                            the ops computing its input): the op at this position of
#                            iteration i works for iteration i + K ("issue K blocks
#                            ahead"). Iterations 0..K-1 are issued in a prologue (at
#                            the start of the preceding part of the schedule), and the
#                            last K iterations issue nothing. The wait stays in its own
#                            iteration. lower-to-chakra and the memory model honour it.
#   flint.prefetch_at = "L"  with flint.prefetch, on the same ops: they are issued (K
#                            iterations ahead) where the op marked
#   flint.prefetch_point = "L" runs, not where they stand: a block of several FSDP
#                            groups gathers its next iteration's first group when its
#                            own last group starts, as FSDP2 prefetches one module
#                            ahead. The ops stay at the top, so every value is still
#                            defined before its use; without the marked op in the
#                            function they are issued where they stand.

STREAM_ATTR = "stream"
# ``flint.where = array<i64: axis, coord>`` on a `dist.send` / `dist.recv` / `aten.op` of a decomposed
# collective: only ranks whose coordinate on grid axis ``axis`` is ``coord`` run it (a hierarchical
# broadcast's phase in the root's column); elsewhere the op is skipped (an aten op's result is then its
# first operand), as for a 0 entry of a ``peers`` table or ``flint.active``.
WHERE_ATTR = "flint.where"


def where_of(op: Operation) -> tuple[int, int] | None:
    attr = op.attributes.get(WHERE_ATTR)
    if attr is None:
        return None
    axis, coord = attr.get_values()
    return int(axis), int(coord)
PREFETCH_ATTR = "flint.prefetch"
PREFETCH_AT_ATTR = "flint.prefetch_at"
PREFETCH_POINT_ATTR = "flint.prefetch_point"
# ``flint.sms = N : i64`` on a `dist.send`: its communication kernel holds N SMs from issue to finish
# (Transformer Engine's userbuffers reduce-scatter kernels; set by micro-pipeline-tp{sms=N});
# lower-to-chakra carries it to the chakra.send, the simulator slows the rank's compute meanwhile.
SMS_ATTR = "flint.sms"


def sms_of(op: Operation) -> int:
    """SMs a send's kernel holds while in flight (``flint.sms``; 0 when absent: a copy-engine transfer)."""
    attr = op.attributes.get(SMS_ATTR)
    return attr.value.data if isinstance(attr, IntegerAttr) else 0


def stream_of(op: Operation) -> str:
    """The named stream of a communication op ("" for the default collective stream)."""
    from xdsl.dialects.builtin import StringAttr

    attr = op.attributes.get(STREAM_ATTR)
    return attr.data if isinstance(attr, StringAttr) else ""


def prefetch_of(op: Operation) -> int:
    """How many iterations ahead ``op`` runs (``flint.prefetch``; 0 when absent)."""
    attr = op.attributes.get(PREFETCH_ATTR)
    return attr.value.data if isinstance(attr, IntegerAttr) else 0


def prefetch_points(block: Block) -> dict[Operation, Operation]:
    """Prefetched ops of ``block`` issued elsewhere (``flint.prefetch_at``) -> the op they are issued right
    before (the one whose ``flint.prefetch_point`` names their label); ops whose label no op holds are left out
    (issued where they stand)."""
    from xdsl.dialects.builtin import StringAttr

    points, out = {}, {}
    for op in block.ops:
        attr = op.attributes.get(PREFETCH_POINT_ATTR)
        if isinstance(attr, StringAttr):
            points[attr.data] = op
    for op in block.ops:
        attr = op.attributes.get(PREFETCH_AT_ATTR)
        if isinstance(attr, StringAttr) and attr.data in points and prefetch_of(op):
            out[op] = points[attr.data]
    return out
