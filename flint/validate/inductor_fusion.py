"""`fuse-pointwise` against inductor's own scheduler: do the kernel groups agree?

For a small model this compiles one training step with ``torch.compile``'s
AOTAutograd front end and inductor's decompositions on CPU, and for every
forward and backward graph inductor would compile it runs inductor's own
lowering (``GraphLowering``) and ``Scheduler`` -- which forms the fused
kernels -- without generating or running any kernel. Each generated kernel
(a ``SchedulerNode`` / ``FusedSchedulerNode``; extern kernels such as GEMMs
and attention, and no-op nodes, excluded) is the set of FX nodes it was
lowered from (its IR nodes' ``origins``). The same FX graph goes through
:func:`flint.passes.fuse_pointwise.fusion_groups`, and the two partitions of
the fusible, non-view nodes are compared:

- *kernel agreement*: the fraction of inductor's kernels that Flint forms
  exactly (same set of nodes);
- *pair precision / recall*: over pairs of fusible nodes, how many pairs
  Flint puts in one kernel that inductor also does (precision), and how many
  of inductor's together-pairs Flint also has (recall). A cheap pointwise
  node inductor inlines into two kernels is in both (in Flint's partition
  too: :class:`flint.passes.fuse_pointwise.Backend`) and pairs with both.

Flint's side uses the CPU backend's store-or-recompute thresholds here
(:data:`~flint.passes.fuse_pointwise.CPU`), since the reference is inductor's
CPU backend, the one this machine runs; the pass prices with the GPU ones.

``python bench/inductor_fusion.py`` prints the table; the test suite checks a
floor on it.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flint.capture.opclass import classify_aten
from flint.opclasses import VIEW
from flint.passes.fuse_pointwise import CPU, FusionNode, fusible, fusion_groups, keeps_inner_dim


def _numel(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (list, tuple)):
        return max((_numel(v) for v in val), default=0)
    return 0


def _op_name(target: Any) -> str:
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(name).split(".")[0]


def _reduced_dims(node: torch.fx.Node) -> list[int] | None:
    """The dims an ATen reduction node reduces (None: all of them)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, int):
        return [dims]
    return list(dims) if isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims) else None


def fx_fusion_nodes(gm: torch.fx.GraphModule) -> list[FusionNode]:
    """The graph's ``call_function`` nodes as :class:`FusionNode` (class, producers, sizes)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        cls = VIEW if node.target is operator.getitem else classify_aten(node.target)  # a tuple element: free
        outs = _numel(node.meta.get("val"))
        ins = max((_numel(a.meta.get("val")) for a in node.all_input_nodes), default=0)
        red = ins if cls == "reduction" and ins != outs else None
        column = False
        if red is not None and isinstance(node.args[0], torch.fx.Node):
            column = keeps_inner_dim(tuple(node.args[0].meta["val"].shape), _reduced_dims(node))
        escapes = any(u.op != "call_function" for u in node.users)
        out.append(FusionNode(node.name, cls, _op_name(node.target), [a.name for a in node.all_input_nodes], outs,
                              red, tuple(_numel(a.meta.get("val")) for a in node.all_input_nodes), column, escapes))
    return out


def flint_kernels(gm: torch.fx.GraphModule) -> list[frozenset[str]]:
    """Flint's fused kernels over the graph: sets of fusible non-view node names (singletons included), under
    the CPU backend's store-or-recompute rule (the reference here is inductor's CPU backend)."""
    nodes = fx_fusion_nodes(gm)
    keep = {n.key for n in nodes if fusible(n.op_class, n.name) and n.op_class != VIEW}
    groups = [frozenset(nodes[i].key for i in g) & keep for g in fusion_groups(nodes, CPU)]
    return [g for g in groups if g]


def inductor_kernels(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], is_backward: bool,
                     keep: set[str]) -> list[frozenset[str]]:
    """The kernels inductor's scheduler forms for ``gm`` (lowering and fusion only; nothing is compiled)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    fake = detect_fake_mode(example_inputs)
    graph = GraphLowering(gm, example_inputs=example_inputs, is_inference=False, is_backward=is_backward)
    kernels = []
    with DebugContext(), V.set_fake_mode(fake), V.set_graph_handler(graph), V.set_extern_kernel_nodes([]):
        graph.run(*example_inputs)
        graph._update_scheduler()
        for sn in graph.scheduler.nodes:
            if isinstance(sn, (ExternKernelSchedulerNode, NopKernelSchedulerNode)):
                continue
            names: set[str] = set()
            for n in sn.get_nodes():
                if n.node is not None:
                    names |= {o.name for o in getattr(n.node, "origins", ())}
            names &= keep
            if names:
                kernels.append(frozenset(names))
    return kernels


@dataclass
class Agreement:
    """How Flint's fused kernels compare with inductor's on one graph (module docstring)."""

    graph: str
    nodes: int              # fusible non-view nodes
    flint_kernels: int
    inductor_kernels: int
    exact: int              # inductor kernels Flint forms exactly
    pair_precision: float
    pair_recall: float

    @property
    def kernel_agreement(self) -> float:
        return self.exact / self.inductor_kernels if self.inductor_kernels else 1.0


def _pairs(groups: Sequence[frozenset[str]]) -> set[tuple[str, str]]:
    out = set()
    for g in groups:
        out |= set(itertools.combinations(sorted(g), 2))
    return out


def compare(name: str, mine: Sequence[frozenset[str]], theirs: Sequence[frozenset[str]]) -> Agreement:
    """Compare two kernel partitions of the same nodes (module docstring)."""
    covered = set().union(*theirs) if theirs else set()
    mine = [g & covered for g in mine if g & covered]
    mine_set = set(mine)
    exact = sum(1 for k in theirs if k in mine_set)
    pm, pt = _pairs(mine), _pairs(theirs)
    precision = len(pm & pt) / len(pm) if pm else 1.0
    recall = len(pm & pt) / len(pt) if pt else 1.0
    return Agreement(name, len(covered), len(mine), len(theirs), exact, precision, recall)


def check_module(module: torch.nn.Module, args: Sequence[torch.Tensor], name: str) -> list[Agreement]:
    """Compile ``module(*args)`` and its backward on CPU; compare both graphs' kernel groups."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    results: list[Agreement] = []

    def compiler(phase: str) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
            nodes = fx_fusion_nodes(gm)
            keep = {n.key for n in nodes if fusible(n.op_class, n.name) and n.op_class != VIEW}
            theirs = inductor_kernels(gm, example_inputs, phase == "bwd", keep)
            results.append(compare(f"{name} {phase}", flint_kernels(gm), theirs))
            return make_boxed_func(gm.forward)
        return compile_graph

    backend = aot_autograd(fw_compiler=compiler("fwd"), bw_compiler=compiler("bwd"),
                           decompositions=select_decomp_table(), partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    try:
        out = torch.compile(module, backend=backend, fullgraph=True)(*args)
        (out if out.ndim == 0 else out.float().sum()).backward()
    finally:
        torch._dynamo.reset()
    return results


def check_models(models: Sequence[str] = ("llama-tiny", "gpt2-tiny"), batch: int = 2, seq: int = 32
                 ) -> list[Agreement]:
    """Agreement on one block of each zoo model (forward and backward graphs)."""
    from flint import models as zoo

    out = []
    torch.manual_seed(0)
    for name in models:
        block = zoo.build(name).layers[0]
        dim = zoo.config(name).dim
        x = torch.randn(batch, seq, dim, requires_grad=True)
        out += check_module(block, (x,), name)
    return out


class _Loss(torch.nn.Module):
    """A causal LM's training loss on ``tokens`` as its own labels (the zoo's ``model(tokens, labels)``,
    a Hugging Face model's ``labels=`` loss)."""

    def __init__(self, model: torch.nn.Module, hf: bool) -> None:
        super().__init__()
        self.model, self.hf = model, hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss if self.hf else self.model(tokens, tokens)


STEP_MODELS = ("llama-tiny", "gpt2-tiny", "moe-tiny", "hf-llama-tiny", "hf-olmo2-tiny", "hf-qwen3-tiny")


def check_steps(models: Sequence[str] = STEP_MODELS, batch: int = 2, seq: int = 32) -> list[Agreement]:
    """Agreement on whole training steps (embedding, every block, head and loss; forward and backward) of
    zoo and Hugging Face models: programs beyond the blocks the grouping rules were checked on."""
    from flint import models as zoo
    from flint.models import hf

    out = []
    torch.manual_seed(0)
    for name in models:
        model = hf.build_hf(name) if hf.is_hf(name) else zoo.build(name)
        tokens = torch.randint(0, 100, (batch, seq))
        out += check_module(_Loss(model, hf.is_hf(name)), (tokens,), f"{name} step")
    return out


def total(results: Sequence[Agreement]) -> Agreement:
    """All graphs together."""
    tk = sum(r.inductor_kernels for r in results)
    fk = sum(r.flint_kernels for r in results)
    pr = [r.pair_precision for r in results]
    rc = [r.pair_recall for r in results]
    return Agreement("all", sum(r.nodes for r in results), fk, tk, sum(r.exact for r in results),
                     math.fsum(pr) / len(pr) if pr else 1.0, math.fsum(rc) / len(rc) if rc else 1.0)
