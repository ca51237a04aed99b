"""`fuse-pointwise`: group pointwise and reduction chains into the kernels `torch.compile` would generate.

A captured graph is pre-fusion: every elementwise op is its own kernel that
reads its inputs from and writes its result to HBM. Inductor, the compiler
behind ``torch.compile``, fuses chains of pointwise and reduction ops into
one generated kernel each; only the values entering and leaving the chain
touch memory. This pass forms those groups on the IR and prices each as one
kernel.

Grouping (:func:`fusion_groups`, shared with the check against inductor's
own scheduler, :mod:`flint.validate.inductor_fusion`), per function, in
program order, following inductor's scheduler (``torch/_inductor/scheduler.py``
and the size rules of ``codegen/simd.py``'s ``can_fuse``):

- *fusible* ops are the op classes ``elementwise`` and ``reduction``, the
  loop-like ``memory`` ops inductor lowers to generated loops (casts, copies,
  concatenation, gathers/embeddings, factory fills, scatters into a fresh
  tensor: :data:`LOOP_MEMORY_OPS`) and ``view`` ops (free: they join the
  group of what they view; a view of a value no kernel of the function
  computes, an argument or a GEMM's result, joins none). GEMMs, attention,
  scatter-adds, collectives and everything else end a group. Every op of the
  function is a node of the dependency graph, collectives and waits
  included, so a path through a collective counts for cycles.
- a *column* reduction (one that keeps the innermost dim: a weight or bias
  gradient, a sum over the rows) iterates in an order no row-wise op
  shares. Its kernel holds the producers only it reads (inductor inlines
  them into its loop); a producer something else reads too stays with that
  reader (inductor computes it in both kernels).
- a fusible op joins the group of each fusible producer (vertical fusion)
  when the sizes are compatible: every member's iteration space is one of
  the group's (numel of its outputs, a row reduction's input and output
  numel, a column reduction's output numel, or the parts of a concatenation
  or scatter, whose producers it computes inline), two reductions join only
  with the same input and output numel and kind, and the group stays within
  inductor's ``max_fusion_size`` (64) ops. Producer -> consumer edges are
  tried again until nothing merges (at most 10 rounds, as inductor's
  scheduler repeats its fusion pass): a group that grew can take a
  neighbour it could not take before.
- groups that read a common value merge (horizontal fusion) when they
  reduce the same way (the same reductions) or, both pointwise, iterate over
  the same largest size. For a column reduction's group, a value its
  pointwise producers read counts as read: inductor computes them inside
  it.
- a merge that would create a cycle (a non-member on a path between the two
  groups) is refused.

Pricing: a group is one kernel whose ``bytes`` are its *external* inputs
(values produced outside the group, each counted once; a value only
gathered from reads just the selected elements) plus its external
outputs (values used outside the group or returned); its duration is the
device roofline of those bytes (``reduction`` efficiency if the group
reduces, else ``elementwise``), at least the kernel floor. The group's last
op that is not a view carries the kernel (``flops`` = the group's FLOPs,
``bytes``, ``duration_us``); the other members get ``bytes = 0`` and
``duration_us = 0``, keeping their own ``flops`` (PyTorch counts pointwise
work as 0).
Every member gets ``fusion_group = "<function>:<n>"``. Ops outside any group
of two or more are annotated as by ``annotate-cost``.

Options: ``device`` (preset or TOML path, as ``annotate-cost``); ``parts``
(comma-separated captured part names, default all): fuse only in these
parts' functions (``<part>_fwd``, ``<part>_bwd``, ``<part>_optim``) and price
every other op on its own, as ``annotate-cost`` does. This is how a program
that compiles only some of its modules runs: torchtitan's ``apply_compile``
compiles each transformer block and leaves the embedding and the loss eager;
Megatron fuses its layers' pointwise ops by hand and runs its cross-entropy
eagerly. A name that is no part of the module is an error naming the parts.

Guarantees: no op is added, removed or reordered; FLOPs are conserved; the
bytes of every group are at most the sum of its members' own bytes; every
`aten.op` carries ``flops``/``bytes``/``duration_us`` afterwards, so
``lower-to-chakra`` prices the step with the fused kernels.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import FloatAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, f64, i64
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from flint.cost import load_device, tensor_bytes
from flint.cost.flops import GATHERS, gathered_bytes
from flint.cost.opclass import ELEMENTWISE, MEMORY, OTHER, REDUCTION, VIEW, classify_target, split_target
from flint.ir.aten import AtenOp
from flint.passes.annotate_cost import BYTES_ATTR, DURATION_ATTR, FLOPS_ATTR, aten_op_cost
from flint.sharding.engine import int_list

GROUP_ATTR = "fusion_group"
# ops whose kernel computes their inputs inline, one part at a time: a concatenation or a scatter into a
# fresh tensor iterates over its output and evaluates each part's (smaller) producer where it lands
INLINING_OPS = frozenset({"cat", "stack", "select_scatter", "slice_scatter"})
MAX_FUSION_SIZE = 64  # torch._inductor.config.max_fusion_size
# memory-class ops inductor lowers as generated loops (fusible); scatters / index_put / sort are not.
LOOP_MEMORY_OPS = frozenset({"clone", "cat", "copy", "copy_", "_to_copy", "index", "index_select", "gather",
                             "embedding", "slice_backward", "select_backward", "new_zeros", "new_empty",
                             "new_ones", "zeros", "ones", "zeros_like", "ones_like", "empty_like", "full",
                             "full_like", "empty", "empty_strided", "arange", "constant_pad_nd", "repeat",
                             "contiguous", "fill", "fill_", "zero_", "_unsafe_index", "scalar_tensor",
                             "stack", "slice_scatter", "select_scatter", "expand_copy", "permute_copy"})


@dataclass
class FusionNode:
    """One op as the grouping sees it: its class, producers (node keys), output numel and reduction size."""

    key: Hashable
    op_class: str
    name: str
    inputs: list[Hashable]
    out_numel: int
    reduces_from: int | None = None  # input numel of a reduction
    in_numels: tuple[int, ...] = ()  # inputs' numel (concatenation inlines producers of each part's size)
    column: bool = False  # a reduction that keeps the innermost dim (a weight or bias gradient's sum over rows)
    escapes: bool = False  # its value is also used by something outside the nodes (a return, a collective)


def keeps_inner_dim(in_shape: Sequence[int], dims: Sequence[int] | None) -> bool:
    """Whether a reduction of a tensor of ``in_shape`` over ``dims`` (None: all) keeps its innermost
    non-unit dim: a *column* reduction, such as a weight gradient's sum over the rows."""
    rank = len(in_shape)
    inner = next((d for d in range(rank - 1, -1, -1) if in_shape[d] > 1), None)
    if dims is None or inner is None:
        return False
    reduced = {d + rank if d < 0 else d for d in dims}
    return inner not in reduced and any(in_shape[d] > 1 for d in reduced if 0 <= d < rank)


def fusible(op_class: str, name: str) -> bool:
    """Whether an op of this class and ATen name joins fused kernels (module docstring)."""
    if op_class in (ELEMENTWISE, REDUCTION, VIEW):
        return not name.startswith(("native_dropout", "rand", "bernoulli"))
    return op_class in (MEMORY, OTHER) and name in LOOP_MEMORY_OPS


@dataclass
class _Group:
    members: list[int] = field(default_factory=list)
    sizes: set[int] = field(default_factory=set)              # iteration spaces (numel)
    reductions: set[tuple[int, int, bool]] = field(default_factory=set)  # (input numel, output numel, column)
    merged_into: "_Group | None" = None

    def merge_ok(self, other: "_Group") -> bool:
        if self.reductions and other.reductions and self.reductions != other.reductions:
            return False
        return not self.sizes or not other.sizes or bool(self.sizes & other.sizes)

    def absorb(self, node: FusionNode | None = None, other: "_Group | None" = None) -> None:
        if node is not None and node.op_class != VIEW:
            self.sizes.add(node.out_numel)
            if node.name in INLINING_OPS:
                self.sizes.update(node.in_numels)
            if node.reduces_from is not None:
                if not node.column:  # a column reduction's loop runs over the rows: no row-order op joins it
                    self.sizes.add(node.reduces_from)
                self.reductions.add((node.reduces_from, node.out_numel, node.column))
        if other is not None:
            self.members += other.members
            self.sizes |= other.sizes
            self.reductions |= other.reductions


def fusion_groups(nodes: Sequence[FusionNode]) -> list[list[int]]:
    """Indices of ``nodes`` (in program order) grouped into fused kernels; singletons included."""
    index = {n.key: i for i, n in enumerate(nodes)}
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for k in n.inputs:
            j = index.get(k)
            if j is not None and j < i:
                users[j].append(i)
    group_of: list[_Group | None] = [None] * len(nodes)
    ok = [fusible(n.op_class, n.name) for n in nodes]
    computed = [_computed_in_kernel(i, nodes, index, ok) for i in range(len(nodes))]
    pinned = _column_reductions(nodes, users, computed, group_of)
    for i, n in enumerate(nodes):
        if not computed[i] or i in pinned:
            continue  # a view of a buffer no kernel computes here (an argument, a GEMM's result) joins no group
        g = _Group([i])
        g.absorb(n)
        group_of[i] = g
        producers = sorted({index[k] for k in n.inputs if k in index and index[k] < i and ok[index[k]]})
        for j in producers:
            _try_merge(group_of[j], group_of[i], users, group_of)
    # later rounds, as inductor's scheduler fuses until nothing changes: groups that grew since a
    # producer -> consumer edge was first tried (a concatenation or scatter that inlines a smaller
    # size) may merge now
    for _ in range(10):
        merged = False
        for i, n in enumerate(nodes):
            for k in n.inputs:
                j = index.get(k)
                if j is not None and j < i and computed[j] and group_of[i] is not None and group_of[j] is not None:
                    merged |= _try_merge(group_of[j], group_of[i], users, group_of)
        if not merged:
            break
    _horizontal(nodes, index, users, group_of)
    seen: set[int] = set()
    out = []
    for i, g in enumerate(group_of):
        if g is None:
            out.append([i])
        elif id(g) not in seen:
            seen.add(id(g))
            out.append(sorted(g.members))
    return sorted(out, key=lambda m: m[0])


def _computed_in_kernel(i: int, nodes: Sequence[FusionNode], index: dict, ok: list[bool]) -> bool:
    """Whether node ``i`` is computed by a fused kernel: a fusible op, or a view of one. A view of an
    argument or of a GEMM's or attention's result is a buffer that kernels read, which links no two of them."""
    while nodes[i].op_class == VIEW:
        j = next((index[k] for k in nodes[i].inputs if k in index), None)
        if j is None:
            return False
        i = j
    return ok[i]


def _try_merge(a: _Group | None, b: _Group | None, users: list[list[int]], group_of: list) -> bool:
    """Merge group ``b`` into ``a`` if inductor would fuse them (sizes, reductions, size cap, no cycle)."""
    if a is None or b is None or a is b:
        return False
    if len(a.members) + len(b.members) > MAX_FUSION_SIZE or not a.merge_ok(b):
        return False
    limit = max(max(a.members), max(b.members))
    if _creates_cycle(a, b, users, group_of, limit) or _creates_cycle(b, a, users, group_of, limit):
        return False
    a.absorb(other=b)
    for m in b.members:
        group_of[m] = a
    b.members = []
    b.merged_into = a
    return True


def _column_reductions(nodes: Sequence[FusionNode], users: list[list[int]], computed: list[bool],
                       group_of: list) -> set[int]:
    """Give every column reduction its own group with the producers only it reads (inductor inlines those
    into its loop; a producer something else reads too is computed where that reader is, and inductor
    recomputes it inside the reduction). Returns the nodes so placed, which no later merge pulls apart."""
    pinned: set[int] = set()
    for c, n in enumerate(nodes):
        if not (computed[c] and n.column and n.reduces_from is not None):
            continue
        g = _Group([c])
        g.absorb(n)
        group_of[c] = g
        pinned.add(c)
        tree = {c}
        for j in range(c - 1, -1, -1):
            m = nodes[j]
            if (computed[j] and j not in pinned and m.reduces_from is None and m.op_class != REDUCTION
                    and not m.escapes and users[j] and all(u in tree for u in users[j])):
                tree.add(j)
                g.members.append(j)
                group_of[j] = g
                pinned.add(j)
    return pinned


def _reads(g: _Group, nodes: Sequence[FusionNode], index: dict, users: list[list[int]],
           group_of: list) -> list[Hashable]:
    """The values a group's kernel loads: its external inputs, and for a column reduction's group, what its
    pointwise producers read (inductor computes those inside the kernel again)."""
    column = any(col for _, _, col in g.reductions)
    out: dict[Hashable, None] = {}  # ordered: merges happen in a deterministic order
    seen: set[int] = set()
    stack = [k for m in g.members for k in nodes[m].inputs]
    while stack:
        k = stack.pop()
        j = index.get(k)
        if j is not None and group_of[j] is g:
            continue
        if column and j is not None and j not in seen and _recomputed(j, nodes, users):
            seen.add(j)
            stack += nodes[j].inputs
            continue
        out[k] = None
    return list(out)


def _recomputed(j: int, nodes: Sequence[FusionNode], users: list[list[int]]) -> bool:
    """Whether inductor would compute pointwise node ``j`` inside each kernel that reads it rather than
    store it: only kernels read it (a GEMM, attention or collective needs it stored, as does a return)."""
    n = nodes[j]
    if n.escapes or n.reduces_from is not None or n.op_class in (REDUCTION, VIEW) or not fusible(n.op_class, n.name):
        return False
    return all(fusible(nodes[u].op_class, nodes[u].name) for u in users[j])


def _horizontal(nodes: Sequence[FusionNode], index: dict, users: list[list[int]], group_of: list) -> None:
    """Merge groups that read a common value (inductor's horizontal fusion), in program order."""
    readers: dict[Hashable, list[_Group]] = {}
    done: set[int] = set()
    for i, n in enumerate(nodes):
        g = group_of[i]
        if g is None or n.op_class == VIEW or id(g) in done:
            continue
        done.add(id(g))
        for k in _reads(g, nodes, index, users, group_of):
            readers.setdefault(k, []).append(g)
    for groups in readers.values():
        for a, b in itertools.combinations(groups, 2):
            a, b = _live(a, group_of), _live(b, group_of)
            if a is b or a.reductions != b.reductions:
                continue
            if not a.reductions and (not a.sizes or not b.sizes or max(a.sizes) != max(b.sizes)):
                continue  # pointwise kernels join when they iterate over the same size
            first, second = (a, b) if min(a.members) < min(b.members) else (b, a)
            _try_merge(first, second, users, group_of)


def _live(g: _Group, group_of: list) -> _Group:
    while getattr(g, "merged_into", None) is not None:
        g = g.merged_into
    return g


def _creates_cycle(a: _Group, b: _Group, users: list[list[int]], group_of: list, limit: int) -> bool:
    """Whether a path leaves ``a`` through a non-member and comes back into ``b`` (nodes up to ``limit``)."""
    inside = set(a.members) | set(b.members)
    stack = [u for m in a.members for u in users[m] if u not in inside and u <= limit]
    seen = set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        for u in users[x]:
            if u in inside:
                return True
            if u <= limit:
                stack.append(u)
    return False


def _numel(v: SSAValue) -> int:
    t = v.type
    return math.prod(t.get_shape()) if isinstance(t, TensorType) else 0


def _value_bytes(v: SSAValue) -> int:
    t = v.type
    return tensor_bytes(tuple(t.get_shape()), str(t.element_type)) if isinstance(t, TensorType) else 0


def _nodes_of(ops: list[Operation]) -> list[FusionNode]:
    """Every op of a function body as a node: ``aten`` ops by their class, anything else (collectives,
    waits, sends) as a node no kernel fuses, so that a dependency through it is seen."""
    inside = set(ops)
    nodes = []
    for op in ops:
        escapes = any(use.operation not in inside for r in op.results for use in r.uses)
        if not isinstance(op, AtenOp):
            nodes.append(FusionNode(op, "dist", op.name, list(op.operands),
                                    max((_numel(r) for r in op.results), default=0), escapes=escapes))
            continue
        cls = classify_target(op.overload)
        _, name, _ = split_target(op.overload)
        out = max((_numel(r) for r in op.outputs), default=0)
        inp = max((_numel(v) for v in op.inputs), default=0)
        red = inp if cls == REDUCTION and inp != out else None
        column = False
        if red is not None and op.inputs and isinstance(op.inputs[0].type, TensorType):
            dims = int_list(op.args.data.get("dim")) if op.args is not None else None
            column = keeps_inner_dim(op.inputs[0].type.get_shape(), dims)
        nodes.append(FusionNode(op, cls, name, [v for v in op.inputs], out, red,
                                tuple(_numel(v) for v in op.inputs), column, escapes))
    return nodes


@dataclass(frozen=True)
class FusePointwisePass(ModulePass):
    """Group pointwise and reduction chains into fused kernels and price each as one (module docstring).

    Options: ``device`` (a preset name such as ``h100-sxm``, or a TOML path); ``parts`` (the captured
    parts to fuse in, default all; the others run eagerly, one kernel per op).
    """

    name = "fuse-pointwise"

    device: str = "h100-sxm"
    parts: tuple[str, ...] = ()

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        device = load_device(self.device)
        funcs = [fn for fn in op.walk() if isinstance(fn, func.FuncOp)]
        if self.parts:
            known = sorted({part_of(fn.sym_name.data) for fn in funcs})
            unknown = [p for p in self.parts if p not in known]
            if unknown:
                raise VerifyException(f"fuse-pointwise: parts={','.join(self.parts)}: "
                                      f"{', '.join(repr(p) for p in unknown)} is no part of this module; "
                                      f"its parts are {', '.join(known)}")
        for fn in funcs:
            if not self.parts or part_of(fn.sym_name.data) in self.parts:
                self._fuse(fn, device)
            else:  # eager: every op its own kernel
                for o in fn.walk():
                    if isinstance(o, AtenOp):
                        _annotate(o, *aten_op_cost(_fresh(o), device))

    def _fuse(self, fn: func.FuncOp, device) -> None:
        ops = [o for o in fn.walk() if o is not fn and not isinstance(o, func.ReturnOp)]
        if not any(isinstance(o, AtenOp) for o in ops):
            return
        # values are keyed by the producing op's results: map each input value to its producer op
        producer: dict[SSAValue, Operation] = {}
        for o in ops:
            for r in o.results:
                producer[r] = o
        nodes = _nodes_of(ops)
        for n in nodes:
            n.inputs = [producer[v] for v in n.inputs if v in producer]
        groups = fusion_groups(nodes)
        k = 0
        for members in groups:
            group_ops = [ops[i] for i in members if isinstance(ops[i], AtenOp)]
            if len([o for o in group_ops if classify_target(o.overload) != VIEW]) < 2:
                for o in group_ops:
                    _annotate(o, *aten_op_cost(_fresh(o), device))
                continue
            nbytes, reduces = _group_bytes(group_ops)
            flops = 0
            label = StringAttr(f"{fn.sym_name.data}:{k}")
            k += 1
            for o in group_ops:
                f, _, _ = aten_op_cost(_fresh(o), device)
                flops += f
                o.attributes[GROUP_ATTR] = label
                _annotate(o, f, 0, 0.0)
            cls = REDUCTION if reduces else ELEMENTWISE
            duration = device.compute_time_us(0, nbytes, cls) if nbytes or flops else device.kernel_floor_us
            # the kernel sits on the group's last computing member: a trailing view only aliases its result
            # (and would otherwise name the kernel in traces, e.g. a fused log-softmax backward as "aten.t")
            carrier = [o for o in group_ops if classify_target(o.overload) != VIEW][-1]
            _annotate(carrier, flops, nbytes, duration)


def part_of(function: str) -> str:
    """The captured part a function belongs to: ``block_ac_bwd`` -> ``block_ac`` (the importer names
    functions ``<part>_<phase>``)."""
    for phase in ("_fwd", "_bwd", "_optim"):
        if function.endswith(phase):
            return function[: -len(phase)]
    return function


def _fresh(op: Operation) -> Operation:
    for key in (FLOPS_ATTR, BYTES_ATTR, DURATION_ATTR, GROUP_ATTR):
        op.attributes.pop(key, None)
    return op


def _annotate(op: Operation, flops: int, nbytes: int, duration: float) -> None:
    op.attributes[FLOPS_ATTR] = IntegerAttr(int(flops), i64)
    op.attributes[BYTES_ATTR] = IntegerAttr(int(nbytes), i64)
    op.attributes[DURATION_ATTR] = FloatAttr(round(duration, 6), f64)


def _group_bytes(group_ops: list[AtenOp]) -> tuple[int, bool]:
    """External input and output bytes of a group (views alias: a viewed value counts as its base)."""
    members = set(group_ops)
    base: dict[SSAValue, SSAValue] = {}

    def root(v: SSAValue) -> SSAValue:
        while v in base:
            v = base[v]
        return v

    for o in group_ops:
        if classify_target(o.overload) == VIEW and o.inputs:
            for r in o.results:
                base[r] = o.inputs[0]
    ext_in: dict[SSAValue, int] = {}
    for o in group_ops:
        if classify_target(o.overload) == VIEW:
            continue
        for i, v in enumerate(o.inputs):
            r = root(v)
            owner = r.owner if isinstance(r.owner, AtenOp) else None
            if owner not in members:
                read = _value_bytes(v)
                if i == 0 and o.overload in GATHERS and o.outputs:  # reads only the selected elements
                    read = gathered_bytes(read, str(v.type.element_type), _numel(o.outputs[0]))
                ext_in[r] = max(ext_in.get(r, 0), read)
    ext_out = 0
    for o in group_ops:
        if classify_target(o.overload) == VIEW:
            continue
        for r in o.results:
            if _escapes(r, members):
                ext_out += _value_bytes(r)
    reduces = any(classify_target(o.overload) == REDUCTION for o in group_ops)
    return sum(ext_in.values()) + ext_out, reduces


def _escapes(v: SSAValue, members: set) -> bool:
    """Whether ``v`` (or a view of it made inside the group) is used outside the group."""
    for use in v.uses:
        user = use.operation
        if user not in members:
            return True
        if classify_target(user.overload) == VIEW and any(_escapes(r, members) for r in user.results):
            return True
    return False
