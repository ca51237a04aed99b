"""`fuse-pointwise`: grouping rules, pricing invariants, and agreement with inductor's own scheduler."""

import pytest
from xdsl.context import Context

from flint.cost.opclass import VIEW, classify_target
from flint.ir.aten import AtenOp
from flint.ir.parse import load_ir
from flint.passes.annotate_cost import AnnotateCostPass
from flint.passes.fuse_pointwise import FusePointwisePass, FusionNode, fusion_groups

IR = """
func.func @f(%x: tensor<8x64xbf16>, %w: tensor<64x64xbf16>) -> tensor<8x64xbf16> {
  %0 = aten.op "aten.neg.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %1 = aten.op "aten.exp.default"(%0) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %2 = aten.op "aten.sum.dim_IntList"(%1) args = {dim = [-1 : i64], keepdim = true} : (tensor<8x64xbf16>) -> tensor<8x1xbf16>
  %3 = aten.op "aten.div.Tensor"(%1, %2) : (tensor<8x64xbf16>, tensor<8x1xbf16>) -> tensor<8x64xbf16>
  %4 = aten.op "aten.mm.default"(%3, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %5 = aten.op "aten.mul.Tensor"(%4, %1) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
  func.return %5 : tensor<8x64xbf16>
}
"""


def parse_ir(text, tmp_path):
    p = tmp_path / "f.mlir"
    p.write_text(text)
    return load_ir(str(p))


def _run(pass_, tmp_path):
    m = parse_ir(IR, tmp_path)
    pass_.apply(Context(), m)
    m.verify()
    return [o for o in m.walk() if isinstance(o, AtenOp)]


def _attr(op, key):
    a = op.attributes.get(key)
    return None if a is None else getattr(a, "data", None) if not hasattr(a, "value") else a.value.data


def test_softmax_chain_is_one_kernel_and_conserves_flops(tmp_path):
    fused, plain = _run(FusePointwisePass(), tmp_path), _run(AnnotateCostPass(), tmp_path)
    groups = [_attr(o, "fusion_group") for o in fused]
    assert groups[:4] == ["f:0"] * 4 and groups[4] is None and groups[5] == "f:1"
    assert sum(_attr(o, "flops") for o in fused) == sum(_attr(o, "flops") for o in plain)
    # neg/exp/sum/div: reads x, writes the div result (used by mm): 2 x 1 KiB. exp(-x) reads one buffer and
    # has two readers: inductor inlines it, so the last mul's kernel computes it again from x (reads x and
    # the mm result, writes its own: 3 x 1 KiB) and nothing writes it
    assert [_attr(o, "bytes") for o in fused[:4]] == [0, 0, 0, 2 * 1024] and _attr(fused[5], "bytes") == 3 * 1024
    assert [str(fused[i].attributes.get("fusion_inlined_in")) for i in (0, 1)] == ['["f:1"]'] * 2
    assert sum(_attr(o, "bytes") for o in fused[:4]) <= sum(_attr(o, "bytes") for o in plain[:4])
    assert sum(_attr(o, "duration_us") for o in fused) < sum(_attr(o, "duration_us") for o in plain)


def test_pass_is_deterministic_and_idempotent(tmp_path):
    a = parse_ir(IR, tmp_path)
    FusePointwisePass().apply(Context(), a)
    once = str(a)
    FusePointwisePass().apply(Context(), a)
    assert str(a) == once


def _n(key, cls, inputs=(), numel=64, red=None, name="add"):
    return FusionNode(key, cls, name, list(inputs), numel, red)


def test_grouping_rules():
    # two reductions over different sizes stay apart; a GEMM between two pointwise ops is a barrier
    nodes = [_n("a", "elementwise"), _n("r1", "reduction", ["a"], 8, 64, "sum"),
             _n("r2", "reduction", ["a"], 4, 64, "sum"), _n("mm", "gemm", ["a"], name="mm"),
             _n("b", "elementwise", ["mm", "a"])]
    groups = fusion_groups(nodes)
    assert [0, 1] in groups and [2] in groups and [3] in groups and [4] in groups
    # a pointwise op of an unrelated size does not join
    assert fusion_groups([_n("a", "elementwise", numel=64), _n("b", "elementwise", ["a"], numel=7)]) == [[0], [1]]
    # dropout (random) is not fused
    assert fusion_groups([_n("a", "elementwise"), _n("d", "elementwise", ["a"], name="native_dropout")]) == [[0], [1]]


def test_merge_never_creates_a_cycle():
    # a -> mm -> c and a -> c: fusing a with c would put the GEMM inside a kernel's dependencies
    nodes = [_n("a", "elementwise"), _n("mm", "gemm", ["a"], name="mm"), _n("c", "elementwise", ["a", "mm"])]
    assert fusion_groups(nodes) == [[0], [1], [2]]


@pytest.mark.slow
def test_kernel_groups_agree_with_inductors_scheduler():
    from flint.validate.inductor_fusion import check_models, total

    results = check_models()
    t = total(results)
    assert {r.graph for r in results} == {"llama-tiny fwd", "llama-tiny bwd", "gpt2-tiny fwd", "gpt2-tiny bwd"}
    # measured (session 35): 28 of 29 inductor kernels formed exactly (0.97), pair precision 1.00, recall
    # 0.99 (session 34, before Flint inlined values into each kernel reading them: 24 of 29, 1.00, 0.94)
    assert t.kernel_agreement >= 0.95
    assert t.pair_precision >= 0.95 and t.pair_recall >= 0.95


def test_compare_counts_a_node_inlined_into_two_kernels_in_both():
    from flint.validate.inductor_fusion import compare

    theirs = [frozenset({"a", "b", "c"}), frozenset({"a", "d"})]
    r = compare("g", [frozenset({"a", "b", "c"}), frozenset({"a", "d"})], theirs)
    assert (r.exact, r.pair_precision, r.pair_recall) == (2, 1.0, 1.0)
    # holding "a" in one kernel only misses a kernel and a pair
    r = compare("g", [frozenset({"a", "b", "c"}), frozenset({"d"})], theirs)
    assert r.exact == 1 and r.pair_precision == 1.0 and r.pair_recall == 0.75


@pytest.mark.parametrize("shape, dims, column", [
    ((8, 64), [0], True),            # a bias gradient: the sum over the rows
    ((2, 32, 64), [0, 1], True),     # a norm weight's gradient over batch and sequence
    ((8, 64), [-1], False),          # a row reduction (softmax, norm statistics)
    ((8, 64, 1), [1], False),        # the innermost dim of size 1 does not count
    ((8, 64), None, False),          # a reduction to a scalar
    ((1, 64), [0], False),           # reduces only a dim of size 1: nothing to loop over
])
def test_column_reductions_keep_the_innermost_dim(shape, dims, column):
    from flint.passes.fuse_pointwise import keeps_inner_dim

    assert keeps_inner_dim(shape, dims) is column


def test_a_column_reduction_takes_only_the_producers_it_alone_reads():
    # g feeds the weight gradient's column sum (through p) and the row-wise chain (q -> r); inductor
    # computes p inside the column reduction's kernel and g with the row-wise ops (g is stored: returned)
    nodes = [_n("g", "elementwise", numel=512), _n("p", "elementwise", ["g"], numel=512),
             FusionNode("s", "reduction", "sum", ["p"], 64, 512, (512,), column=True),
             _n("q", "elementwise", ["g"], numel=512), _n("r", "elementwise", ["q"], numel=512)]
    nodes[0].escapes = True
    assert fusion_groups(nodes) == [[0, 3, 4], [1, 2]]
    # p also returned: it is stored, so it is computed with g's kernel and the column sum reads it
    nodes[1].escapes = True
    assert fusion_groups(nodes) == [[0, 1, 3, 4], [2]]


def test_a_cheap_value_two_kernels_read_is_computed_in_both():
    """Inductor inlines a pointwise value with several readers unless it reads more than 4 buffers, its
    expression is large, or (CPU only) it computes a transcendental op (torch/_inductor/graph.py,
    ir.py's should_realize_on_reuse): each kernel reading it computes it, and nothing stores it."""
    from flint.passes.fuse_pointwise import CPU

    # g = f(a, b) feeds the column sum (through p) and the row-wise chain (q -> r)
    def nodes(reads=2, name="add"):
        return [_n("g", "elementwise", [f"in{k}" for k in range(reads)], 512, name=name),
                _n("p", "elementwise", ["g"], numel=512),
                FusionNode("s", "reduction", "sum", ["p"], 64, 512, (512,), column=True),
                _n("q", "elementwise", ["g"], numel=512), _n("r", "elementwise", ["q"], numel=512)]
    assert fusion_groups(nodes()) == [[0, 1, 2], [0, 3, 4]]
    # five buffers read: stored, with the row-wise ops; the column sum reads it
    assert fusion_groups(nodes(reads=5)) == [[0, 3, 4], [1, 2]]
    # tanh: inlined for a GPU, stored by the CPU backend
    assert fusion_groups(nodes(name="tanh")) == [[0, 1, 2], [0, 3, 4]]
    assert fusion_groups(nodes(name="tanh"), CPU) == [[0, 3, 4], [1, 2]]
    # a GEMM reads it: stored
    gemm = nodes() + [_n("mm", "gemm", ["g"], name="mm")]
    assert fusion_groups(gemm) == [[0, 3, 4], [1, 2], [5]]


GATHER_IR = """
func.func @g(%logp: tensor<8x4096xf32>, %idx: tensor<8x1xi64>) -> tensor<8x1xf32> {
  %0 = aten.op "aten.gather.default"(%logp, %idx) args = {dim = 1 : i64} : (tensor<8x4096xf32>, tensor<8x1xi64>) -> tensor<8x1xf32>
  %1 = aten.op "aten.neg.default"(%0) : (tensor<8x1xf32>) -> tensor<8x1xf32>
  func.return %1 : tensor<8x1xf32>
}
"""


@pytest.mark.parametrize("pass_", [FusePointwisePass(), AnnotateCostPass()], ids=["fused", "per-op"])
def test_a_gather_reads_only_the_selected_elements(tmp_path, pass_):
    """The loss's target-logit gather reads 8 of 8 x 4,096 log-probabilities (and the index), not the
    whole tensor; it used to be priced as a read of all 128 KiB, fused or not."""
    m = parse_ir(GATHER_IR, tmp_path)
    pass_.apply(Context(), m)
    m.verify()
    gather, neg = [o for o in m.walk() if isinstance(o, AtenOp)]
    total = _attr(gather, "bytes") + _attr(neg, "bytes")
    if isinstance(pass_, FusePointwisePass):  # one kernel: 8 f32 gathered + 8 i64 index + 8 f32 written
        assert _attr(gather, "fusion_group") == "g:0" and total == 8 * 4 + 8 * 8 + 8 * 4
    else:  # gather: 8 gathered + index + 8 written; neg: 8 read + 8 written
        assert total == (8 * 4 + 8 * 8 + 8 * 4) + 2 * 8 * 4


def test_part_of_strips_the_phase_the_importer_appends():
    from flint.passes.fuse_pointwise import part_of

    assert [part_of(f) for f in ("block_ac_bwd", "block_fwd", "head_optim", "lone")] == \
        ["block_ac", "block", "head", "lone"]


@pytest.mark.slow
def test_kernel_groups_agree_with_inductor_on_whole_steps():
    """Whole training steps of six tiny models (embedding, blocks, head, loss), none of which the grouping
    rules were written against."""
    from flint.validate.inductor_fusion import STEP_MODELS, check_steps, total

    results = check_steps()
    assert len(results) == 2 * len(STEP_MODELS)
    t = total(results)
    # measured (session 35): 156 of 309 inductor kernels formed exactly (0.50), pair precision 0.80, recall
    # 0.89 (session 34: 124 of 309, 0.81, 0.70); the rest: mostly the CPU backend's own loop rules (a norm in
    # two or three kernels; no fusion across a transposing copy, which a GPU's loop reordering allows)
    assert t.kernel_agreement >= 0.45 and t.pair_precision >= 0.75 and t.pair_recall >= 0.85


@pytest.mark.parametrize("inline", [True, False], ids=["inlined", "stored"])
def test_pricing_invariants_on_a_captured_step(inline):
    """On a whole captured step (llama-tiny, FSDP x TP 2 on 4 ranks): FLOPs are
    conserved; a kernel's bytes are at most its members' own; an inlined op carries no kernel and names
    kernels that exist; every fused op is priced by exactly one carrier; exactly the values that never
    leave their kernels are marked fusion_in_kernel."""
    from collections import defaultdict

    from tests.captures import imported

    _, module = imported("llama-tiny", "fsdp+tp", 4, 2)
    fused, plain = module.clone(), module.clone()
    FusePointwisePass(inline=inline).apply(Context(), fused)
    AnnotateCostPass().apply(Context(), plain)
    fused.verify()
    ops = [o for o in fused.walk() if isinstance(o, AtenOp)]
    own = {id(o): _attr(p, "bytes") for o, p in zip(ops, [o for o in plain.walk() if isinstance(o, AtenOp)])}
    assert sum(_attr(o, "flops") for o in ops) == sum(_attr(o, "flops") for o in plain.walk()
                                                      if isinstance(o, AtenOp))
    members, carried = defaultdict(list), defaultdict(int)
    inlined = [o for o in ops if "fusion_inlined_in" in o.attributes]
    for o in ops:
        labels = labels_of(o)
        for label in labels:
            members[label].append(o)
        if labels and _attr(o, "duration_us") > 0:
            carried[labels[0]] += 1
    assert set(carried) == set(members) and set(carried.values()) == {1}
    for label, group in members.items():
        kernel = sum(_attr(o, "bytes") for o in group if "fusion_inlined_in" not in o.attributes)
        assert kernel <= sum(own[id(o)] for o in group), label
    assert all(_attr(o, "duration_us") == 0 for o in inlined)
    assert bool(inlined) == inline
    # fusion_in_kernel (nothing allocates it) exactly on the fused values no one outside their kernels reads
    kernels = {id(o): set(labels_of(o)) for o in ops}
    in_kernel = 0
    for o in ops:
        if not kernels[id(o)] or classify_target(o.overload) == VIEW:
            assert "fusion_in_kernel" not in o.attributes
            continue
        readers = [u for r in o.results for u in _readers(r)]
        kept = all(isinstance(u, AtenOp) and kernels[id(u)] and kernels[id(u)] <= kernels[id(o)]
                   for u in readers)
        assert ("fusion_in_kernel" in o.attributes) == (kept or o in inlined), o
        in_kernel += kept
    assert in_kernel > 0


def labels_of(op) -> list[str]:
    """The kernels computing ``op``: its fusion group, then those it is inlined into."""
    labels = [_attr(op, "fusion_group")] if "fusion_group" in op.attributes else []
    if "fusion_inlined_in" in op.attributes:
        labels += [a.data for a in op.attributes["fusion_inlined_in"].data]
    return labels


def _readers(v):
    """The ops reading ``v``, through views."""
    out = []
    for use in v.uses:
        u = use.operation
        if isinstance(u, AtenOp) and classify_target(u.overload) == VIEW:
            out += [x for r in u.results for x in _readers(r)]
        else:
            out.append(u)
    return out


STORED_INPUT_IR = """
func.func @f(%x: tensor<8x64xbf16>, %w: tensor<64x64xbf16>) -> (tensor<8x64xbf16>, tensor<8x64xbf16>) {
  %r = aten.op "aten.sum.dim_IntList"(%x) args = {dim = [-1 : i64], keepdim = true} : (tensor<8x64xbf16>) -> tensor<8x1xbf16>
  %p = aten.op "aten.mul.Tensor"(%x, %r) : (tensor<8x64xbf16>, tensor<8x1xbf16>) -> tensor<8x64xbf16>
  %u1 = aten.op "aten.neg.default"(%p) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %m = aten.op "aten.mm.default"(%u1, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %u2 = aten.op "aten.add.Tensor"(%p, %m) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
  func.return %u1, %u2 : tensor<8x64xbf16>, tensor<8x64xbf16>
}
"""


def test_a_value_an_inlined_op_reads_is_written_for_the_other_kernels(tmp_path):
    """p = x * sum(x) is inlined into u1's kernel and into u2's (which the GEMM keeps apart). u2's kernel
    computes p again, so it reads the row sums: the first kernel must write them (16 B), though their
    only reader is an op of its own."""
    m = parse_ir(STORED_INPUT_IR, tmp_path)
    FusePointwisePass().apply(Context(), m)
    m.verify()
    r, p, u1, mm, u2 = [o for o in m.walk() if isinstance(o, AtenOp)]
    assert [_attr(o, "fusion_group") for o in (r, p, u1, u2)] == ["f:0", "f:0", "f:0", "f:1"]
    assert str(p.attributes["fusion_inlined_in"]) == '["f:1"]'
    # kernel 0 reads x, writes u1 and the sums; kernel 1 reads x, the sums and the GEMM's result, writes u2
    assert (_attr(u1, "bytes"), _attr(u2, "bytes")) == (1024 + 1024 + 16, 1024 + 16 + 1024 + 1024)


MEMORY_IR = """
builtin.module attributes {flint.schedule = [["f_fwd", 1]]} {
  shard.grid @mesh(shape = 2)
  func.func @f_fwd(%x: tensor<8x64xf32> {flint.role = "input"}) -> tensor<8x1xf32> {
    %0 = aten.op "aten.mul.Tensor"(%x, %x) phase = "fwd" : (tensor<8x64xf32>, tensor<8x64xf32>) -> tensor<8x64xf32>
    %1 = aten.op "aten.add.Tensor"(%0, %x) phase = "fwd" : (tensor<8x64xf32>, tensor<8x64xf32>) -> tensor<8x64xf32>
    %2 = aten.op "aten.sum.dim_IntList"(%1) phase = "fwd" args = {dim = [-1 : i64], keepdim = true} : (tensor<8x64xf32>) -> tensor<8x1xf32>
    func.return %2 : tensor<8x1xf32>
  }
}
"""


def test_a_value_that_never_leaves_its_kernel_takes_no_memory(tmp_path):
    """Inductor gives no buffer to a value only its own kernel reads. x (8 x 64 f32, 2048 B) is resident.
    Eager: x * x and (x * x) + x are both live at the add, 2 x 2048 B, so the peak is 6144 B. Fused into
    one kernel with the row sum, neither is written: the peak is x and the 32 B of sums, 2080 B."""
    from flint.sim.lifetimes import step_memory

    eager = step_memory(parse_ir(MEMORY_IR, tmp_path))
    assert eager.report.peak_bytes == 6144
    m = parse_ir(MEMORY_IR, tmp_path)
    FusePointwisePass().apply(Context(), m)
    mul, add, total = [o for o in m.walk() if isinstance(o, AtenOp)]
    assert ["fusion_in_kernel" in o.attributes for o in (mul, add, total)] == [True, True, False]
    assert step_memory(m).report.peak_bytes == 2048 + 32
