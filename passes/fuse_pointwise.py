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
  the same largest size. A group reads what its members and the values it
  inlines (below) read.
- a merge that would create a cycle (a non-member on a path between the two
  groups) is refused.
- a cheap pointwise value read by two or more kernels is *inlined*, as
  inductor's lowering decides (``torch/_inductor/graph.py``, ``ir.py``'s
  ``should_realize_on_reuse``; :class:`Backend`): unless a GEMM, attention,
  a collective or a return reads it, or its expression reads more than 4
  buffers or holds more than 30 ops, every kernel that reads it computes it
  again from its inputs and nothing stores it (a residual sum read by the
  next norm and the next residual add; a gradient sum read by a norm
  backward's row and column reductions). Such an op is in each of those
  groups; its readers link no two of them.

Pricing: a group is one kernel whose ``bytes`` are its *external* inputs
(values produced outside the group, each counted once; a value only
gathered from reads just the selected elements) plus its external
outputs (values used outside the group or returned); its duration is the
device roofline of those bytes (``reduction`` efficiency if the group
reduces, else ``elementwise``), at least the kernel floor. The group's last
op that is not a view or inlined carries the kernel (``flops`` = the
group's FLOPs, ``bytes``, ``duration_us``); the other members get ``flops``,
``bytes`` and ``duration_us`` 0. An inlined op is never written; its inputs
are read by each kernel computing it, and its FLOPs count once.
Every member gets ``fusion_group = "<function>:<n>"`` (an inlined op: the
first of its kernels, the others in ``fusion_inlined_in``). A member that is
not a view and whose value is never written (no reader outside its kernels,
or inlined) gets ``fusion_in_kernel``: inductor gives it no buffer, and
:mod:`flint.sim.lifetimes` allocates nothing for it. Ops outside any
group of two or more are annotated as by ``annotate-cost``.

Options: ``device`` (preset or TOML path, as ``annotate-cost``); ``parts``
(comma-separated captured part names, default all): fuse only in these
parts' functions (``<part>_fwd``, ``<part>_bwd``, ``<part>_optim``) and price
every other op on its own, as ``annotate-cost`` does. This is how a program
that compiles only some of its modules runs: torchtitan's ``apply_compile``
compiles each transformer block and leaves the embedding and the loss eager;
Megatron fuses its layers' pointwise ops by hand and runs its cross-entropy
eagerly. A name that is no part of the module is an error naming the parts.
``inline`` (default true): false stores every value two kernels read, as
hand-written fused kernels do (Megatron's), instead of inductor's inlining.

Guarantees: no op is added, removed or reordered; FLOPs are conserved; the
bytes of every group are at most the sum of its members' own bytes; every
`aten.op` carries ``flops``/``bytes``/``duration_us`` afterwards, so
``lower-to-chakra`` prices the step with the fused kernels.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import (ArrayAttr, FloatAttr, IntegerAttr, ModuleOp, StringAttr, TensorType, UnitAttr, f64,
                                   i64)
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
INLINED_ATTR = "fusion_inlined_in"  # an op inductor inlines into several kernels: the kernels after the first
# a fused op whose value stays inside its kernel (no reader outside it, or inlined): never written to memory,
# so never allocated (flint.sim.lifetimes)
IN_KERNEL_ATTR = "fusion_in_kernel"
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


@dataclass(frozen=True)
class Backend:
    """Inductor's store-or-recompute rule for one code generator (``torch/_inductor/graph.py``'s
    ``run_node`` and ``ir.py``'s ``should_realize_on_reuse``, thresholds from ``torch/_inductor/config.py``).
    A pointwise value is *stored* (its kernel writes it, its readers load it) when something other than a
    generated kernel reads it (a GEMM, attention, a collective, a return) or its expression reads more than
    ``acc_reads`` buffers or holds more than ``opcount`` ops; read by two or more ops it is stored when it
    reads more than ``reads`` buffers, or (CPU only) computes a ``heavy`` op. Otherwise inductor inlines it:
    every kernel that reads it computes it again from what it reads."""

    name: str
    reads: int = 4              # realize_reads_threshold
    opcount: int = 30           # _realize_opcount_threshold_default (GPU); realize_cpu_opcount_threshold: 50
    acc_reads: int = 8          # _realize_acc_reads_threshold_default (GPU); realize_cpu_acc_reads_threshold: 12
    heavy: frozenset[str] = frozenset()


TRITON = Backend("triton")  # what the pass prices: torch.compile on a GPU
CPU = Backend("cpu", opcount=50, acc_reads=12,  # inductor's C++ backend: the one the check can run here
              heavy=frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}))


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
    inlined: set[int] = field(default_factory=set)            # inlined values it computes again (module docstring)
    sizes: set[int] = field(default_factory=set)              # iteration spaces (numel)
    reductions: set[tuple[int, int, bool]] = field(default_factory=set)  # (input numel, output numel, column)
    merged_into: "_Group | None" = None

    def nodes(self) -> set[int]:
        return set(self.members) | self.inlined

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
            self.inlined |= other.inlined
            self.sizes |= other.sizes
            self.reductions |= other.reductions


def fusion_groups(nodes: Sequence[FusionNode], backend: Backend | None = TRITON) -> list[list[int]]:
    """Indices of ``nodes`` (in program order) grouped into fused kernels; singletons included. A value
    inductor inlines into several kernels (``backend``'s rule, :class:`Backend`) is in each of them;
    ``backend=None``: none is (hand-written kernels, which store every value two kernels read)."""
    index = {n.key: i for i, n in enumerate(nodes)}
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for k in dict.fromkeys(n.inputs):
            j = index.get(k)
            if j is not None and j < i:
                users[j].append(i)
    group_of: list[_Group | None] = [None] * len(nodes)
    ok = [fusible(n.op_class, n.name) for n in nodes]
    computed = [_computed_in_kernel(i, nodes, index, ok) for i in range(len(nodes))]
    trees = _inlined_trees(nodes, index, users, ok, computed, backend) if backend else {}
    inlined = set().union(*trees.values()) if trees else set()
    pinned = _column_reductions(nodes, users, computed, group_of, inlined)
    users = _kernel_users(users, inlined)  # from here on: the kernels that read a value
    for c in sorted(pinned):
        _take_inlined(group_of[c], c, nodes, index, trees, inlined)
    for i, n in enumerate(nodes):
        if not computed[i] or i in pinned or i in inlined:
            continue  # a view of a buffer no kernel computes here (an argument, a GEMM's result) joins no group
        g = _Group([i])
        g.absorb(n)
        group_of[i] = g
        for j in _take_inlined(g, i, nodes, index, trees, inlined):
            _try_merge(group_of[j], group_of[i], users, group_of)
    # later rounds, as inductor's scheduler fuses until nothing changes: groups that grew since a
    # producer -> consumer edge was first tried (a concatenation or scatter that inlines a smaller
    # size) may merge now
    for _ in range(10):
        merged = False
        for i in range(len(nodes)):
            g = group_of[i]
            if g is None:
                continue
            for j in _producers(i, nodes, index, trees, inlined):
                if computed[j] and group_of[j] is not None:
                    merged |= _try_merge(group_of[j], _live(g, group_of), users, group_of)
        if not merged:
            break
    _horizontal(nodes, index, users, group_of)
    seen: set[int] = set()
    out = []
    for i, g in enumerate(group_of):
        if g is None:
            if i not in inlined:
                out.append([i])
        elif id(g) not in seen:
            seen.add(id(g))
            out.append(sorted(g.nodes()))
    return sorted(out, key=lambda m: m[0])


def _inlined_trees(nodes: Sequence[FusionNode], index: dict, users: list[list[int]], ok: list[bool],
                   computed: list[bool], backend: Backend) -> dict[int, set[int]]:
    """The values inductor inlines into two or more kernels, each with the inlined expression it computes
    (itself and the inlined values it reads): ``{node: tree}``. Decided in program order, as inductor's
    lowering decides (:class:`Backend`); only pointwise ops and their views are inlined."""
    stored = [False] * len(nodes)  # read by something no generated kernel is, through views
    for i in range(len(nodes) - 1, -1, -1):
        stored[i] = nodes[i].escapes or any(not ok[u] or (nodes[u].op_class == VIEW and stored[u])
                                            for u in users[i])
    tree: list[set[int] | None] = [None] * len(nodes)  # an inlined value's expression; None: a buffer
    reads: list[set[Hashable]] = [set() for _ in nodes]
    for i, n in enumerate(nodes):
        if not computed[i] or stored[i] or not users[i]:
            continue
        if n.op_class == VIEW:  # a view of an inlined value is inlined with it
            base = next((index[k] for k in n.inputs if k in index), None)
            if base is None or tree[base] is None:
                continue
        elif not ok[i] or n.op_class == REDUCTION or n.name in INLINING_OPS:
            continue  # a reduction is a buffer; a concatenation or scatter, a kernel of its own parts
        t, r = {i}, set()
        for k in n.inputs:
            j = index.get(k)
            if j is not None and tree[j] is not None:
                t |= tree[j]
                r |= reads[j]
            else:
                r.add(k)
        ops = sum(1 for j in t if nodes[j].op_class != VIEW) + len(r)  # arithmetic and loads
        if len(r) > backend.acc_reads or ops > backend.opcount:
            continue
        if len(users[i]) > 1 and (len(r) > backend.reads or any(nodes[j].name in backend.heavy for j in t)):
            continue
        tree[i], reads[i] = t, r
    return {i: t for i, t in enumerate(tree) if t is not None and len(users[i]) > 1}


def _kernel_users(users: list[list[int]], inlined: set[int]) -> list[list[int]]:
    """Each node's readers with the inlined values seen through: a kernel that computes an inlined value
    reads that value's inputs, so it depends on their producers, not on another kernel computing it."""
    out: list[list[int]] = [[] for _ in users]
    for i in range(len(users) - 1, -1, -1):
        seen: dict[int, None] = {}
        for u in users[i]:
            for v in (out[u] if u in inlined else [u]):
                seen[v] = None
        out[i] = list(seen)
    return out


def _producers(i: int, nodes: Sequence[FusionNode], index: dict, trees: dict[int, set[int]],
               inlined: set[int]) -> list[int]:
    """The nodes whose buffers node ``i``'s kernel reads: its inputs, and through an inlined value what
    that value's expression reads."""
    out: dict[int, None] = {}
    stack = [k for k in nodes[i].inputs]
    seen: set[int] = set()
    while stack:
        j = index.get(stack.pop())
        if j is None or j >= i or j in seen:
            continue
        seen.add(j)
        if j in trees:
            stack += [k for m in trees[j] for k in nodes[m].inputs]
        elif j not in inlined:
            out[j] = None
    return sorted(out)


def _take_inlined(g: _Group, i: int, nodes: Sequence[FusionNode], index: dict, trees: dict[int, set[int]],
                  inlined: set[int]) -> list[int]:
    """Add to ``g`` the inlined values node ``i`` reads (its kernel computes them); return ``i``'s producers."""
    for k in nodes[i].inputs:
        j = index.get(k)
        if j is not None and j in trees:
            g.inlined |= trees[j]
            for m in trees[j]:
                g.absorb(nodes[m])
    return _producers(i, nodes, index, trees, inlined)


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
    if a is None or b is None:
        return False
    a, b = _live(a, group_of), _live(b, group_of)
    if a is b:
        return False
    if len(a.members) + len(b.members) > MAX_FUSION_SIZE or not a.merge_ok(b):
        return False
    if _creates_cycle(a, b, users):
        return False
    a.absorb(other=b)
    for m in b.members:
        group_of[m] = a
    b.members = []
    b.inlined = set()
    b.merged_into = a
    return True


def _column_reductions(nodes: Sequence[FusionNode], users: list[list[int]], computed: list[bool],
                       group_of: list, inlined: set[int]) -> set[int]:
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
            if (computed[j] and j not in pinned and j not in inlined and m.reduces_from is None
                    and m.op_class != REDUCTION and not m.escapes and users[j] and all(u in tree for u in users[j])):
                tree.add(j)
                g.members.append(j)
                group_of[j] = g
                pinned.add(j)
    return pinned


def _reads(g: _Group, nodes: Sequence[FusionNode], index: dict) -> list[Hashable]:
    """The values a group's kernel loads: what its members and the values it inlines read from outside."""
    inside = g.nodes()
    out: dict[Hashable, None] = {}  # ordered: merges happen in a deterministic order
    for m in sorted(inside):
        for k in nodes[m].inputs:
            if index.get(k) not in inside:
                out[k] = None
    return list(out)


def _horizontal(nodes: Sequence[FusionNode], index: dict, users: list[list[int]], group_of: list) -> None:
    """Merge groups that read a common value (inductor's horizontal fusion), in program order."""
    readers: dict[Hashable, list[_Group]] = {}
    done: set[int] = set()
    for i, n in enumerate(nodes):
        g = group_of[i]
        if g is None or n.op_class == VIEW or id(g) in done:
            continue
        done.add(id(g))
        for k in _reads(g, nodes, index):
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


def _creates_cycle(a: _Group, b: _Group, users: list[list[int]]) -> bool:
    """Whether a path leaves the two groups through an op computed elsewhere and comes back into them:
    merging them would then make a kernel wait for itself. ``users``: :func:`_kernel_users`."""
    inside = set(a.members) | set(b.members)
    limit = max(inside)
    stack = [u for m in inside for u in users[m] if u not in inside and u <= limit]
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
    parts to fuse in, default all; the others run eagerly, one kernel per op); ``inline`` (default true:
    inductor's store-or-recompute rule for a GPU; false: every value two kernels read is stored, as
    hand-written fused kernels do).
    """

    name = "fuse-pointwise"

    device: str = "h100-sxm"
    parts: tuple[str, ...] = ()
    inline: bool = True

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
        groups = fusion_groups(nodes, TRITON if self.inline else None)
        seen = Counter(i for g in groups for i in g)
        shared = {ops[i] for i, c in seen.items() if c > 1}  # inlined: computed inside each kernel reading it
        counted: set[Operation] = set()
        carriers: set[Operation] = set()
        k = 0
        for members in groups:
            group_ops = [ops[i] for i in members if isinstance(ops[i], AtenOp)]
            if len([o for o in group_ops if classify_target(o.overload) != VIEW]) < 2:
                for o in group_ops:
                    _annotate(o, *aten_op_cost(_fresh(o), device))
                continue
            nbytes, reduces, in_kernel = _group_bytes(group_ops, shared)
            flops = 0
            label = StringAttr(f"{fn.sym_name.data}:{k}")
            k += 1
            for o in group_ops:
                if o not in counted:  # an inlined op's FLOPs count once, in the first kernel computing it
                    counted.add(o)
                    flops += aten_op_cost(_fresh(o), device)[0]
                    o.attributes[GROUP_ATTR] = label
                else:
                    prior = o.attributes.get(INLINED_ATTR)
                    o.attributes[INLINED_ATTR] = ArrayAttr([*(prior.data if prior else ()), label])
                if o not in carriers:
                    _annotate(o, 0, 0, 0.0)
                if o in in_kernel:
                    o.attributes[IN_KERNEL_ATTR] = UnitAttr()
            cls = REDUCTION if reduces else ELEMENTWISE
            duration = device.compute_time_us(0, nbytes, cls)  # the kernel floor when it moves nothing
            # the kernel sits on the group's last computing member: a trailing view only aliases its result
            # (and would otherwise name the kernel in traces, e.g. a fused log-softmax backward as "aten.t");
            # an inlined op is not one: other kernels compute it too
            computing = [o for o in group_ops if classify_target(o.overload) != VIEW]
            carrier = ([o for o in computing if o not in shared] or computing)[-1]
            carriers.add(carrier)
            _annotate(carrier, flops, nbytes, duration)


def part_of(function: str) -> str:
    """The captured part a function belongs to: ``block_ac_bwd`` -> ``block_ac`` (the importer names
    functions ``<part>_<phase>``)."""
    for phase in ("_fwd", "_bwd", "_optim"):
        if function.endswith(phase):
            return function[: -len(phase)]
    return function


def _fresh(op: Operation) -> Operation:
    for key in (FLOPS_ATTR, BYTES_ATTR, DURATION_ATTR, GROUP_ATTR, INLINED_ATTR, IN_KERNEL_ATTR):
        op.attributes.pop(key, None)
    return op


def _annotate(op: Operation, flops: int, nbytes: int, duration: float) -> None:
    op.attributes[FLOPS_ATTR] = IntegerAttr(int(flops), i64)
    op.attributes[BYTES_ATTR] = IntegerAttr(int(nbytes), i64)
    op.attributes[DURATION_ATTR] = FloatAttr(round(duration, 6), f64)


def _group_bytes(group_ops: list[AtenOp], shared: set[Operation]) -> tuple[int, bool, set[AtenOp]]:
    """External input and output bytes of a group (views alias: a viewed value counts as its base), whether
    it reduces, and its ops whose values stay inside the kernel (never written). An op of ``shared`` is
    inlined: every kernel that reads it computes it from its inputs, so it is never written, and a value
    it reads is written by the kernel that computes that value."""
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
    in_kernel: set[AtenOp] = set()
    for o in group_ops:
        if classify_target(o.overload) == VIEW:
            continue
        written = [_value_bytes(r) for r in o.results if o not in shared and _escapes(r, members, shared)]
        ext_out += sum(written)
        if not written:
            in_kernel.add(o)
    reduces = any(classify_target(o.overload) == REDUCTION for o in group_ops)
    return sum(ext_in.values()) + ext_out, reduces, in_kernel


def _escapes(v: SSAValue, members: set, shared: set[Operation]) -> bool:
    """Whether ``v`` (or a view of it made inside the group) is used outside the group, or by an inlined op
    that other kernels compute too."""
    for use in v.uses:
        user = use.operation
        if user not in members or user in shared:
            return True
        if classify_target(user.overload) == VIEW and any(_escapes(r, members, shared) for r in user.results):
            return True
    return False
