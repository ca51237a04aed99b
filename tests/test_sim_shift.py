"""The simulator's one-representative-per-class reduction with send/recv (flint/sim/engine.py,
``_p2p_pairing``): uniform shifts inside a class (context-parallel rings, decomposed ring collectives)
and pipeline stages are simulated with one rank per class and give exactly the full simulation's per-rank
times; pairings that differ between members, or transfers of different cost, fall back to every rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from xdsl.context import Context
from xdsl.parser import Parser

from flint.chakra.from_ir import trace_from_ir
from flint.cost import Link, collective_time_us, load_device, load_network
from flint.cost.network import Network, NetworkDim
from flint.ir import flint_context
from flint.mesh import Mesh, assign_group_ids
from flint.passes.decompose_collectives import DecomposeCollectivesPass
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.passes.pipeline_split import PipelineSplitPass
from flint.passes.shard_annotate import ShardAnnotatePass
from flint.passes.shard_expand import ShardExpandPass
from flint.sim import simulate
from flint.trace import CollKind, NodeKind, NodeTableBuilder, RankProgram, Trace
from tests.test_pipeline import _module as pipeline_module  # the uniform-stage step the pipeline tests use

# nodes of 4 ranks on NVLink, InfiniBand between nodes
NODES_OF_4 = Network("two", (NetworkDim("nv", 4, Link(450.0, 1.0)), NetworkDim("ib", 0, Link(50.0, 3.0))))
NODES_OF_2 = Network("two", (NetworkDim("nv", 2, Link(450.0, 1.0)), NetworkDim("ib", 0, Link(50.0, 3.0))))
SWITCH = Network("switch", (NetworkDim("s", 0, Link(50.0, 2.0)),))


def _both(trace, network, device=None):
    fast = simulate(trace, device, network)
    full = simulate(trace, device, network, symmetric=False)
    assert not full.symmetric and len(full.simulated_ranks) == trace.world_size
    return fast, full


def _same(fast, full):
    """Exactly the full simulation's per-rank times (up to float rounding)."""
    assert fast.finish_us.shape == full.finish_us.shape
    np.testing.assert_allclose(fast.finish_us, full.finish_us, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(fast.exposed_comm_us, full.exposed_comm_us, rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(fast.comm_time_us, full.comm_time_us, rtol=1e-9, atol=1e-6)


def _ring_trace(mesh: Mesh, axis: str, nxt: np.ndarray | None = None, hops: int = 3) -> Trace:
    """Every rank: compute, then ``hops`` ring steps (send to the next rank, recv from the previous,
    compute on the received block), then an all-reduce over the mesh's first axis. One shared table."""
    groups, lookup = assign_group_ids(mesh, [(0,)])
    if nxt is None:
        nxt = mesh.peers(axis, 1)
    prv = np.empty_like(nxt)
    prv[nxt] = np.arange(nxt.size)
    b = NodeTableBuilder()
    prev = [b.add_comp("c0", duration_us=20.0)]
    for h in range(hops):
        s = b.add_send(f"send{h}", 300_000, 0, h, data_deps=prev)
        r = b.add_recv(f"recv{h}", 300_000, 1, h, data_deps=prev)
        prev = [b.add_comp(f"c{h + 1}", duration_us=10.0 + h, data_deps=[r, s])]
    b.add_coll("ar", CollKind.ALL_REDUCE, 80_000, 0, data_deps=prev)
    t = b.build()
    progs = [RankProgram(t, np.array([lookup[(0,)][r]]), np.array([nxt[r], prv[r]])) for r in range(mesh.world_size)]
    return Trace(mesh.world_size, progs, groups)


def test_ring_inside_a_class_is_one_representative():
    trace = _ring_trace(Mesh((2, 4), ("dp", "cp")), "cp")  # each cp ring inside one node of 4
    fast, full = _both(trace, NODES_OF_4)
    assert fast.symmetric and fast.simulated_ranks == [0]
    _same(fast, full)
    # by hand: 20 + 3 hops of (1 us + 300,000 B at 450 GB/s) + (10 + 11 + 12) + the dp all-reduce on IB
    hop = 1.0 + 300_000 / 450e3
    ar = collective_time_us("all_reduce", 80_000, 2, Link(50.0, 3.0))
    np.testing.assert_allclose(fast.finish_us, 20.0 + 3 * hop + 33.0 + ar, rtol=1e-12)


def test_any_permutation_of_uniform_cost_is_reduced():
    # not a shift: 0 -> 1 -> 3 -> 2 -> 0 (and the same inside 4..7), every hop on one switch
    nxt = np.array([1, 3, 0, 2, 5, 7, 4, 6])
    fast, full = _both(_ring_trace(Mesh((2, 4), ("dp", "cp")), "cp", nxt), SWITCH)
    assert fast.symmetric and fast.simulated_ranks == [0]
    _same(fast, full)


def test_ring_crossing_a_node_boundary_at_some_ranks_splits_the_class():
    # nodes of 2: hops 1 -> 2 and 3 -> 0 cross InfiniBand, 0 -> 1 and 2 -> 3 stay on NVLink: even positions
    # (send on NVLink, receive over InfiniBand) and odd ones are two classes; the dp all-reduce stays in one
    trace = _ring_trace(Mesh((2, 4), ("dp", "cp")), "cp")
    fast, full = _both(trace, NODES_OF_2)
    assert fast.symmetric and fast.simulated_ranks == [0, 1]
    _same(fast, full)
    # the ranks' timelines really differ (one class is not right): a recv over InfiniBand takes longer
    recv = [i for i, n in enumerate(trace.ranks[0].table.names) if n.startswith("recv")]
    assert len({float(full.raw.duration_us[r][recv].sum()) for r in range(2)}) == 2


def test_group_spanning_classes_meets_their_representatives():
    # the same ring, with the all-reduce over the cp axis (ranks of both classes): ranks 0 and 1, the
    # representatives, are in the same group and meet there
    mesh = Mesh((2, 4), ("dp", "cp"))
    trace = _ring_trace(mesh, "cp")
    groups, lookup = assign_group_ids(mesh, [(1,)])
    for r, p in enumerate(trace.ranks):
        p.group_ids = np.array([lookup[(1,)][r]])
    trace.comm_groups = groups
    fast, full = _both(trace, NODES_OF_2)
    assert fast.symmetric and fast.simulated_ranks == [0, 1]
    _same(fast, full)


@settings(max_examples=30)
@given(st.sampled_from([(2, 4), (4, 2), (2, 2, 2), (8,), (4, 4)]), st.integers(0, 2), st.integers(1, 3),
       st.sampled_from([1, 2, 4, 8]), st.integers(1, 3))
def test_reduced_equals_full_for_any_shift_and_network(shape, axis, offset, node, hops):
    """Whatever the grid, shift and node size: the result is the full simulation's (reduced or not)."""
    mesh = Mesh(shape)
    axis %= len(shape)
    trace = _ring_trace(mesh, axis, mesh.peers(axis, offset), hops)
    net = Network("two", (NetworkDim("nv", node, Link(450.0, 1.0)), NetworkDim("ib", 0, Link(50.0, 3.0))))
    fast, full = _both(trace, net)
    _same(fast, full)
    within = all(r // node == int(mesh.peers(axis, offset)[r]) // node for r in range(mesh.world_size))
    across = all(r // node != int(mesh.peers(axis, offset)[r]) // node for r in range(mesh.world_size))
    if within or (across and node == 1):  # every hop on the same link: one representative
        assert fast.symmetric and fast.simulated_ranks == [0]


def test_members_pairing_with_different_rows_fall_back():
    """Two sends (to +1 and +2) and two recvs of the same tag; ranks 0, 1 list their recvs (from -1, from
    -2), ranks 2, 3 the other way round: rank 0's first send pairs with its peer's first recv, rank 1's
    with its peer's second. Not uniform: every rank is simulated."""
    b = NodeTableBuilder()
    b.add_send("s1", 1_000_000, 0, 5)
    b.add_send("s2", 1_000_000, 1, 5)
    r1 = b.add_recv("r1", 1_000_000, 2, 5)
    b.add_comp("after_r1", duration_us=100.0, data_deps=[r1])
    r2 = b.add_recv("r2", 1_000_000, 3, 5)
    b.add_comp("after_r2", duration_us=10.0, data_deps=[r2])
    t = b.build()
    empty = np.zeros(0, dtype=np.int64)
    progs = []
    for r in range(4):
        m1, m2 = (r - 1) % 4, (r - 2) % 4
        progs.append(RankProgram(t, empty, np.array([(r + 1) % 4, (r + 2) % 4] + ([m1, m2] if r < 2 else [m2, m1]))))
    trace = Trace(4, progs, {})
    fast, full = _both(trace, SWITCH)
    assert not fast.symmetric and len(fast.simulated_ranks) == 4
    _same(fast, full)


# --- traces the passes produce --------------------------------------------------------------------------

CP_INPUT = Path(__file__).parent.parent / "lit_tests" / "passes" / "shard-expand-cp.mlir"


def _lowered(module):
    LowerToChakraPass(device="h100-sxm").apply(Context(), module)
    module.verify()
    return trace_from_ir(module)


@pytest.mark.parametrize("fields,classes", [({"cp": 4}, 1), ({"cp": 2, "dp_shard": 2}, 1),
                                            ({"cp": 2, "tp": 2}, 1), ({"cp": 4, "dp_shard": 2}, 1)], ids=str)
def test_context_parallel_step_is_one_representative(fields, classes):
    """shard-expand's ring attention (the K/V gradient passed round the cp ring with send/recv)."""
    text = "\n".join(line for line in CP_INPUT.read_text().splitlines() if not line.startswith("//"))
    m = Parser(flint_context(), text).parse_module()
    ShardAnnotatePass(**fields).apply(Context(), m)
    ShardExpandPass().apply(Context(), m)
    trace = _lowered(m)
    assert any((p.table.kind == NodeKind.SEND).any() for p in trace.ranks)
    fast, full = _both(trace, load_network("dgx-h100"), load_device("h100-sxm"))
    assert fast.symmetric and len(fast.simulated_ranks) == classes
    _same(fast, full)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv-zero-bubble", 2)], ids=str)
def test_pipeline_schedule_is_one_representative_per_stage(schedule, virtual):
    pp, dp = 4, 2
    m = Parser(flint_context(), pipeline_module(pp, 2 * pp * virtual, dp)).parse_module()
    PipelineSplitPass(stages=pp, schedule=schedule, microbatches=2 * pp, virtual=virtual).apply(Context(), m)
    m.verify()
    trace = _lowered(m)
    fast, full = _both(trace, NODES_OF_4, load_device("h100-sxm"))
    assert fast.symmetric and len(fast.simulated_ranks) == pp
    _same(fast, full)


_ATTRS = {"all_reduce": "", "all_gather": "gather_dim = 0", "reduce_scatter": "scatter_dim = 0",
          "all_to_all": "split_dim = 0 concat_dim = 0"}


def _collective_module(kind: str, shape: tuple[int, ...], axes: list[int], rows: int = 256, cols: int = 64) -> str:
    n = int(np.prod([shape[a] for a in axes]))
    i = o = f"{rows * n}x{cols}"
    if kind == "all_gather":
        i = f"{rows}x{cols}"
    if kind == "reduce_scatter":
        o = f"{rows}x{cols}"
    return f"""shard.grid @mesh(shape = {'x'.join(map(str, shape))})
func.func @f(%x: tensor<{i}xbf16>) -> tensor<{o}xbf16> {{
  %0 = dist.{kind} %x on @mesh grid_axes = {axes} {_ATTRS[kind]} : tensor<{i}xbf16> -> !dist.future<tensor<{o}xbf16>>
  %1 = dist.wait %0 : tensor<{o}xbf16>
  func.return %1 : tensor<{o}xbf16>
}}
"""


@pytest.mark.parametrize("alg,kind", [("ring", "all_reduce"), ("ring", "all_gather"), ("ring", "reduce_scatter"),
                                      ("halving-doubling", "all_reduce"), ("direct", "all_to_all")], ids=str)
def test_decomposed_collective_is_one_representative(alg, kind):
    m = Parser(flint_context(), _collective_module(kind, (2, 4), [1])).parse_module()
    DecomposeCollectivesPass(algorithm=alg, chunks=2).apply(Context(), m)
    trace = _lowered(m)
    fast, full = _both(trace, NODES_OF_4, load_device("h100-sxm"))
    assert fast.symmetric and fast.simulated_ranks == [0]
    _same(fast, full)
