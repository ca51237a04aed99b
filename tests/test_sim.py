"""The simulator on small graphs with known answers."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flint.cost import Link, collective_time_us, load_device
from flint.cost.network import Network, NetworkDim
from flint.mesh import Mesh, assign_group_ids
from flint.sim import SimDeadlock, simulate, write_chrome_trace
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

# 1 GB/s and no latency: a transfer of N bytes takes N / 1000 us
NET = Network("test", (NetworkDim("x", 0, Link(1.0, 0.0)),))
AR_2 = 40_000  # all-reduce of 40,000 bytes over 2 ranks: 2 * 1/2 * 40,000 / 1000 = 40 us


def spmd(table, world=2, groups=None, group_ids=(1,)):
    groups = groups or {1: tuple(range(world))}
    progs = [RankProgram(table, np.asarray(group_ids, dtype=np.int64), np.zeros(0, dtype=np.int64)) for _ in range(world)]
    return Trace(world, progs, groups)


def test_compute_overlaps_independent_collective():
    b = NodeTableBuilder()
    b.add_comp("c", duration_us=100.0)
    b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)
    r = simulate(spmd(b.build()), None, NET)
    assert r.iteration_time_us == pytest.approx(100.0)
    assert r.comm_time_us[0] == pytest.approx(40.0)
    assert r.exposed_comm_us[0] == pytest.approx(0.0)


def test_dependent_collective_is_exposed():
    b = NodeTableBuilder()
    c = b.add_comp("c", duration_us=100.0)
    ar = b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0, data_deps=[c])
    b.add_comp("d", duration_us=10.0, data_deps=[ar])
    r = simulate(spmd(b.build()), None, NET)
    assert r.iteration_time_us == pytest.approx(150.0)
    assert r.exposed_comm_us[0] == pytest.approx(40.0)
    assert r.compute_busy_us[0] == pytest.approx(110.0)
    assert r.busy_us[0] == pytest.approx(150.0)


def test_partial_overlap_exposed_part():
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)        # 0..40
    b.add_comp("c", duration_us=25.0)                      # 0..25
    r = simulate(spmd(b.build()), None, NET)
    assert r.exposed_comm_us[0] == pytest.approx(15.0)


def _sharing(comm_sms=24):
    """The H100 (132 SMs) with collectives holding ``comm_sms`` SMs each."""
    return load_device("h100-sxm").calibrated({"comm_sms": comm_sms})


def test_compute_under_a_collective_runs_on_the_sms_it_leaves():
    b = NodeTableBuilder()
    b.add_comp("c", duration_us=100.0)
    b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)  # 0..40: compute at 108/132 of its speed meanwhile
    r = simulate(spmd(b.build()), _sharing(), NET)
    slowed = 100.0 + 40.0 * 24 / 132
    assert r.iteration_time_us == pytest.approx(slowed)
    assert r.compute_busy_us[0] == pytest.approx(slowed)  # the busy time is the slowed one
    assert r.exposed_comm_us[0] == pytest.approx(0.0)
    assert simulate(spmd(b.build()), _sharing(0), NET).iteration_time_us == pytest.approx(100.0)
    # two collectives on one stream hold one kernel's SMs at a time: 80 us at 108/132
    b.add_coll("ar2", CollKind.ALL_REDUCE, AR_2, 0)
    assert simulate(spmd(b.build()), _sharing(), NET).iteration_time_us == pytest.approx(100.0 + 80.0 * 24 / 132)


def test_sm_sharing_leaves_serialized_communication_alone():
    b = NodeTableBuilder()
    c = b.add_comp("c", duration_us=100.0)
    ar = b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0, data_deps=[c])
    b.add_comp("d", duration_us=10.0, data_deps=[ar])
    r = simulate(spmd(b.build()), _sharing(), NET)
    assert r.iteration_time_us == pytest.approx(150.0) and r.compute_busy_us[0] == pytest.approx(110.0)


def test_a_collective_waiting_for_its_peer_holds_its_sms():
    """NCCL's kernel occupies its SMs from launch, while it waits for a late peer too."""
    def table(pre_us):
        b = NodeTableBuilder()
        if pre_us:
            pre = b.add_comp("pre", duration_us=pre_us)
            b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0, data_deps=[pre])
        else:
            b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)  # issued at 0, runs 50..90
            b.add_comp("c", duration_us=100.0)
        return b.build()

    gid = np.array([1])
    trace = Trace(2, [RankProgram(table(p), gid, np.zeros(0, dtype=np.int64)) for p in (0.0, 50.0)], {1: (0, 1)})
    r = simulate(trace, _sharing(), NET)
    rate = 108 / 132
    assert r.finish_us[0] == pytest.approx(90.0 + (100.0 - 90.0 * rate))
    assert r.finish_us[1] == pytest.approx(90.0)


def test_comm_sms_is_checked_against_the_device():
    from flint.errors import FlintError

    with pytest.raises(FlintError, match=r"h100-sxm.toml: device 'h100-sxm': comm_sms = 132 \(calibration .*\) "
                       r"needs sm_count above it"):
        _sharing(132)
    with pytest.raises(FlintError, match=r"comm_sms = -1 is out of range \(valid: 0 <= comm_sms <= 1024"):
        _sharing(-1)
    assert load_device("h100-sxm").compute_rate(2 * 24) == pytest.approx(84 / 132)
    assert load_device("h100-sxm").compute_rate(9 * 24) == pytest.approx(24 / 132)  # never below one kernel's share
    assert load_device("h100-sxm").compute_rate(0) == 1.0


def _send_pair(sms):
    """Rank 0 sends 40,000 bytes (40 us) to rank 1 while both compute 100 us; the send's kernel holds
    ``sms`` SMs."""
    b = NodeTableBuilder()
    b.add_send("s", 40_000, peer=1, tag=0, sms=sms)
    b.add_comp("c", duration_us=100.0)
    t0 = b.build()
    b = NodeTableBuilder()
    b.add_recv("r", 40_000, peer=0, tag=0)
    b.add_comp("c", duration_us=100.0)
    return Trace(2, [RankProgram(t0), RankProgram(b.build())])


def test_a_send_whose_kernel_holds_sms_slows_its_ranks_compute():
    """Transformer Engine's userbuffers reduce-scatter runs on 16 SMs (micro-pipeline-tp{sms=16}): the
    sender's compute runs on 116 of 132 SMs while it is in flight; the receiver's does not slow, and a
    plain send (a copy-engine transfer) slows nothing. On a device without comm_sms (B200) too."""
    for device in ("h100-sxm", "b200"):
        dev = load_device(device)
        r = simulate(_send_pair(16), dev, NET)
        assert r.finish_us[0] == pytest.approx(100.0 + 40.0 * 16 / dev.sm_count)
        assert r.finish_us[1] == pytest.approx(100.0)
        assert simulate(_send_pair(0), dev, NET).iteration_time_us == pytest.approx(100.0)
    assert _send_pair(16).ranks[0].table.comm_sms.tolist() == [16, 0]
    assert _send_pair(0).ranks[0].table.comm_sms is None


def test_two_collectives_on_one_stream_serialize():
    b = NodeTableBuilder()
    b.add_coll("ar1", CollKind.ALL_REDUCE, AR_2, 0)
    b.add_coll("ar2", CollKind.ALL_REDUCE, AR_2, 0)
    r = simulate(spmd(b.build()), None, NET)
    assert r.iteration_time_us == pytest.approx(80.0)


def test_dependency_chain_and_parallel_streams():
    b = NodeTableBuilder()
    a = b.add_comp("a", duration_us=10.0)
    c = b.add_comp("b", duration_us=20.0, data_deps=[a])
    b.add_comp("c", duration_us=30.0, ctrl_deps=[c])
    r = simulate(spmd(b.build(), world=1, groups={1: (0,)}), None, NET)
    assert r.iteration_time_us == pytest.approx(60.0)
    # independent compute nodes still share the one compute stream
    b = NodeTableBuilder()
    b.add_comp("a", duration_us=10.0)
    b.add_comp("b", duration_us=20.0)
    assert simulate(spmd(b.build(), world=1, groups={1: (0,)}), None, NET).iteration_time_us == pytest.approx(30.0)


def _straggler_trace(slow_us):
    def table(pre_us):
        b = NodeTableBuilder()
        c = b.add_comp("fwd", duration_us=pre_us)
        ar = b.add_coll("ar", CollKind.ALL_REDUCE, 60_000, 0, data_deps=[c])
        b.add_comp("after", duration_us=5.0, data_deps=[ar])
        return b.build()

    fast, slow = table(10.0), table(slow_us)
    gid = np.array([1])
    progs = [RankProgram(slow if r == 2 else fast, gid, np.zeros(0, dtype=np.int64)) for r in range(4)]
    return Trace(4, progs, {1: (0, 1, 2, 3)})


def test_straggler_delays_the_collective_for_everyone():
    ar_us = collective_time_us("all_reduce", 60_000, 4, Link(1.0, 0.0))
    r = simulate(_straggler_trace(50.0), None, NET)
    assert not r.symmetric and len(r.simulated_ranks) == 4
    assert r.iteration_time_us == pytest.approx(50.0 + ar_us + 5.0)
    assert np.allclose(r.finish_us, 50.0 + ar_us + 5.0)
    assert r.comm_wait_us[0] == pytest.approx(40.0) and r.comm_wait_us[2] == pytest.approx(0.0)
    same = simulate(_straggler_trace(10.0), None, NET)
    assert same.iteration_time_us == pytest.approx(10.0 + ar_us + 5.0)


def test_scaling_compute_on_some_ranks_is_a_straggler():
    """``Trace.with_compute_scaled`` (explore's stragglers, the accuracy bench's sustained fraction):
    compute nodes only, the named ranks only; the table the others share stays theirs, unchanged."""
    trace = _straggler_trace(10.0)  # every rank: 10 us, all-reduce, 5 us; ranks 0, 1 and 3 share one table
    slowed = trace.with_compute_scaled(5.0, [0])
    assert [p.table is q.table for p, q in zip(trace.ranks, slowed.ranks)] == [False, True, True, True]
    assert list(slowed.ranks[0].table.duration_us[[0, 2]]) == [50.0, 25.0]
    assert list(slowed.ranks[1].table.duration_us[[0, 2]]) == [10.0, 5.0]  # rank 0's table was theirs too
    ar_us = collective_time_us("all_reduce", 60_000, 4, Link(1.0, 0.0))
    assert simulate(slowed, None, NET).iteration_time_us == pytest.approx(50.0 + ar_us + 25.0)
    every = trace.with_compute_scaled(2.0)  # one table shared by ranks 0, 1, 3 stays shared once scaled
    assert every.ranks[0].table is every.ranks[1].table is every.ranks[3].table
    assert simulate(every, None, NET).iteration_time_us == pytest.approx(20.0 + ar_us + 10.0)
    b = NodeTableBuilder()
    b.add_comp("unpriced", flops=1e9)
    with pytest.raises(ValueError, match="needs a duration on every compute node"):
        spmd(b.build()).with_compute_scaled(2.0)


def _tp_dp_trace(mesh):
    """An SPMD step over a (dp, tp) mesh: TP all-reduces and a DP gradient all-reduce."""
    groups, lookup = assign_group_ids(mesh, [(1,), (0,)])
    b = NodeTableBuilder()
    prev = []
    for layer in range(3):
        c = b.add_comp(f"mm{layer}", flops=2 * 4096 ** 3, tensor_bytes=3 * 4096 * 4096 * 2, data_deps=prev)
        ar = b.add_coll(f"tp_ar{layer}", CollKind.ALL_REDUCE, 8 * 2 ** 20, 0, data_deps=[c])
        prev = [ar]
    b.add_coll("dp_ar", CollKind.ALL_REDUCE, 64 * 2 ** 20, 1, data_deps=prev)
    t = b.build()
    progs = [RankProgram(t, np.array([lookup[(1,)][r], lookup[(0,)][r]]), np.zeros(0, dtype=np.int64))
             for r in range(mesh.world_size)]
    return Trace(mesh.world_size, progs, groups)


def test_symmetric_reduction_equals_full_simulation():
    mesh = Mesh((4, 4), ("dp", "tp"))
    net = Network("two", (NetworkDim("nv", 4, Link(450.0, 1.0)), NetworkDim("ib", 0, Link(50.0, 3.0))))
    dev = load_device("h100-sxm")
    trace = _tp_dp_trace(mesh)
    fast = simulate(trace, dev, net, mesh)
    full = simulate(trace, dev, net, mesh, symmetric=False)
    assert fast.symmetric and fast.simulated_ranks == [0]
    assert not full.symmetric and len(full.simulated_ranks) == 16
    assert fast.iteration_time_us == pytest.approx(full.iteration_time_us)
    assert np.allclose(fast.exposed_comm_us, full.exposed_comm_us)
    # by hand: 3 x (roofline mm + TP all-reduce over NVLink) + DP all-reduce over IB
    mm = dev.compute_time_us(2 * 4096 ** 3, 3 * 4096 * 4096 * 2, "gemm")
    tp = collective_time_us("all_reduce", 8 * 2 ** 20, 4, Link(450.0, 1.0))
    dp = collective_time_us("all_reduce", 64 * 2 ** 20, 4, Link(50.0, 3.0))
    assert fast.iteration_time_us == pytest.approx(3 * (mm + tp) + dp)
    assert fast.mfu == pytest.approx(3 * 2 * 4096 ** 3 / (fast.iteration_time_us * 1e-6 * 989.4e12))


def test_symmetric_reduction_is_exact_with_sm_sharing():
    """A DP all-reduce overlapping TP-synchronized compute: one simulated rank per class gives the full
    simulation's timeline with collectives holding SMs, and sharing makes it longer."""
    mesh = Mesh((4, 4), ("dp", "tp"))
    net = Network("two", (NetworkDim("nv", 4, Link(450.0, 1.0)), NetworkDim("ib", 0, Link(50.0, 3.0))))
    groups, lookup = assign_group_ids(mesh, [(1,), (0,)])
    b = NodeTableBuilder()
    b.add_coll("dp_ar", CollKind.ALL_REDUCE, 64 * 2 ** 20, 1)  # issued at once, overlaps the layers
    prev = []
    for layer in range(3):
        c = b.add_comp(f"mm{layer}", flops=2 * 4096 ** 3, tensor_bytes=3 * 4096 * 4096 * 2, data_deps=prev)
        prev = [b.add_coll(f"tp_ar{layer}", CollKind.ALL_REDUCE, 8 * 2 ** 20, 0, data_deps=[c])]
    t = b.build()
    trace = Trace(16, [RankProgram(t, np.array([lookup[(1,)][r], lookup[(0,)][r]]), np.zeros(0, dtype=np.int64))
                       for r in range(16)], groups)
    fast = simulate(trace, _sharing(), net, mesh)
    full = simulate(trace, _sharing(), net, mesh, symmetric=False)
    assert fast.symmetric and not full.symmetric
    assert fast.iteration_time_us == pytest.approx(full.iteration_time_us)
    assert np.allclose(fast.compute_busy_us, full.compute_busy_us)
    assert fast.compute_busy_us[0] > simulate(trace, _sharing(0), net, mesh).compute_busy_us[0] * 1.01


def test_roofline_used_without_duration_and_duration_wins():
    dev = load_device("h100-sxm")
    b = NodeTableBuilder()
    b.add_comp("mm", flops=10 ** 12, tensor_bytes=10)
    b.add_comp("add", tensor_bytes=3_350_000_000)
    b.add_comp("timed", duration_us=7.0, flops=10 ** 15)
    r = simulate(spmd(b.build(), world=1, groups={1: (0,)}), dev, NET)
    # shape-less trace nodes: the roofline with the GEMM model's peak fraction (MAMF) and HBM efficiency
    want = 10 ** 12 / (989.4e12 * 0.801) * 1e6 + 3_350_000_000 / (3350e9 * 0.867) * 1e6 + 7.0
    assert r.iteration_time_us == pytest.approx(want)


def test_deadlock_names_rank_and_node():
    b = NodeTableBuilder()
    b.add_coll("grad_ar", CollKind.ALL_REDUCE, 100, 0)
    with_coll = b.build()
    b = NodeTableBuilder()
    b.add_comp("only_compute", duration_us=1.0)
    without = b.build()
    gid = np.array([1])
    progs = [RankProgram(with_coll, gid, np.zeros(0, dtype=np.int64)), RankProgram(without, gid, np.zeros(0, dtype=np.int64))]
    with pytest.raises(SimDeadlock, match=r"rank 0 waits forever at node 0 'grad_ar'.*never arrived: ranks \[1\]"):
        simulate(Trace(2, progs, {1: (0, 1)}), None, NET)


def test_recv_without_send_deadlocks():
    b = NodeTableBuilder()
    b.add_recv("recv_act", 100, peer=1, tag=7)
    r0 = b.build()
    b = NodeTableBuilder()
    b.add_send("send_act", 100, peer=0, tag=8)  # wrong tag
    r1 = b.build()
    trace = Trace(2, [RankProgram(r0), RankProgram(r1)])
    with pytest.raises(SimDeadlock, match="rank 0 waits forever at node 0 'recv_act'.*tag 7"):
        simulate(trace, None, NET)


def test_send_recv_pair_in_order():
    # rank 0 sends two messages with one tag; rank 1 receives them; compute after each recv
    b = NodeTableBuilder()
    b.add_send("s0", 10_000, peer=1, tag=0)
    b.add_send("s1", 20_000, peer=1, tag=0)
    t0 = b.build()
    b = NodeTableBuilder()
    r0 = b.add_recv("r0", 10_000, peer=0, tag=0)
    r1 = b.add_recv("r1", 20_000, peer=0, tag=0)
    b.add_comp("use", duration_us=1.0, data_deps=[r0, r1])
    t1 = b.build()
    r = simulate(Trace(2, [RankProgram(t0), RankProgram(t1)]), None, NET)
    assert r.iteration_time_us == pytest.approx(10.0 + 20.0 + 1.0)


def test_member_order_mismatch_is_reported():
    b = NodeTableBuilder()
    b.add_coll("ag", CollKind.ALL_GATHER, 100, 0)
    t0 = b.build()
    b = NodeTableBuilder()
    b.add_coll("ag", CollKind.ALL_GATHER, 200, 0)
    t1 = b.build()
    gid = np.array([1])
    trace = Trace(2, [RankProgram(t0, gid, np.zeros(0, dtype=np.int64)), RankProgram(t1, gid, np.zeros(0, dtype=np.int64))],
                  {1: (0, 1)})
    with pytest.raises(Exception, match="same order with the same kind and size"):
        simulate(trace, None, NET)


def _ring_all_reduce_as_p2p(n, nbytes):
    """Ring all-reduce decomposed: n-1 reduce-scatter + n-1 all-gather steps of nbytes/n."""
    b = NodeTableBuilder()
    chunk = nbytes // n
    prev_recv, prev_send = [], []
    for step in range(2 * (n - 1)):
        s = b.add_send(f"send{step}", chunk, peer=0, tag=step, data_deps=prev_recv, ctrl_deps=prev_send)
        rv = b.add_recv(f"recv{step}", chunk, peer=1, tag=step, ctrl_deps=prev_recv)
        if step < n - 1:  # reduce the received chunk before forwarding it
            rv = b.add_comp(f"reduce{step}", duration_us=0.0, data_deps=[rv])
        prev_recv, prev_send = [rv], [s]
    t = b.build()
    progs = [RankProgram(t, np.zeros(0, dtype=np.int64), np.array([(r + 1) % n, (r - 1) % n])) for r in range(n)]
    return Trace(n, progs)


@pytest.mark.parametrize("n", [4, 8])
def test_collective_equals_its_ring_decomposition(n):
    link = Link(50.0, 2.0)
    net = Network("sw", (NetworkDim("sw", 0, link),))
    nbytes = 64 * 2 ** 20
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, nbytes, 0)
    one = simulate(spmd(b.build(), world=n), None, net).iteration_time_us
    steps = simulate(_ring_all_reduce_as_p2p(n, nbytes), None, net).iteration_time_us
    assert one == pytest.approx(collective_time_us("all_reduce", nbytes, n, link))
    assert steps == pytest.approx(one, rel=0.05)


def test_chrome_trace_is_valid_json_and_atomic(tmp_path):
    r = simulate(_straggler_trace(30.0), None, NET)
    path = write_chrome_trace(r, tmp_path / "out" / "timeline.json")
    doc = json.loads(path.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1, 2, 3}
    waits = [e for e in slices if e["name"] == "wait:ar" and e["pid"] == 0]
    assert waits and waits[0]["dur"] == pytest.approx(20.0)
    assert [p.name for p in path.parent.iterdir()] == ["timeline.json"]


# ---- property: critical path <= iteration time <= sum of durations ----------------------------------

@st.composite
def random_tables(draw):
    n = draw(st.integers(1, 25))
    b = NodeTableBuilder()
    durs, preds = [], []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        if draw(st.integers(0, 3)) == 0:
            nbytes = draw(st.integers(0, 50_000))
            b.add_coll(f"n{i}", CollKind.ALL_REDUCE, nbytes, 0, data_deps=deps)
            durs.append(collective_time_us("all_reduce", nbytes, 2, Link(1.0, 0.0)))
        else:
            d = draw(st.floats(0.0, 100.0))
            b.add_comp(f"n{i}", duration_us=d, data_deps=deps)
            durs.append(d)
        preds.append(deps)
    return b.build(), durs, preds


@settings(max_examples=60)
@given(random_tables())
def test_iteration_time_between_critical_path_and_sum(case):
    table, durs, preds = case
    finish = []
    for d, p in zip(durs, preds):
        finish.append(max((finish[j] for j in p), default=0.0) + d)
    critical = max(finish)
    for symmetric in (True, False):
        r = simulate(spmd(table), None, NET, symmetric=symmetric)
        assert critical - 1e-6 <= r.iteration_time_us <= sum(durs) + 1e-6


def test_uneven_groups_are_not_reduced():
    # one table for all ranks, but slot 0 resolves to groups of different sizes: not symmetric
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, 60_000, 0)
    t = b.build()
    empty = np.zeros(0, dtype=np.int64)
    progs = [RankProgram(t, np.array([1 if r < 2 else 2]), empty) for r in range(5)]
    r = simulate(Trace(5, progs, {1: (0, 1), 2: (2, 3, 4)}), None, NET)
    assert not r.symmetric and len(r.simulated_ranks) == 5
    ar2 = collective_time_us("all_reduce", 60_000, 2, Link(1.0, 0.0))
    ar3 = collective_time_us("all_reduce", 60_000, 3, Link(1.0, 0.0), algorithm="ring")
    assert np.allclose(r.finish_us, [ar2, ar2, ar3, ar3, ar3]) and ar3 > ar2


def test_mesh_must_match_world_size():
    b = NodeTableBuilder()
    b.add_comp("c", duration_us=1.0)
    with pytest.raises(Exception, match="mesh \\[4\\] has 4 ranks but the trace has 2"):
        simulate(spmd(b.build()), None, NET, Mesh((4,)))


def _pipeline_trace(peer_of, world=8):
    """Two pipeline stages of 4 ranks: stage 0 computes, sends to its peer in stage 1, which computes
    and sends back; each stage all-reduces over its 4 ranks (a data-parallel group)."""
    b0 = NodeTableBuilder()
    c = b0.add_comp("f0", duration_us=50.0)
    s = b0.add_send("act", 40_000, 0, 7, data_deps=[c])
    r = b0.add_recv("grad", 40_000, 0, 8, data_deps=[s])
    b0.add_coll("dp_ar", CollKind.ALL_REDUCE, 80_000, 0, data_deps=[r])
    b1 = NodeTableBuilder()
    r1 = b1.add_recv("act", 40_000, 0, 7)
    c1 = b1.add_comp("f1", duration_us=30.0, data_deps=[r1])
    s1 = b1.add_send("grad", 40_000, 0, 8, data_deps=[c1])
    b1.add_coll("dp_ar", CollKind.ALL_REDUCE, 80_000, 0, data_deps=[s1])
    t0, t1 = b0.build(), b1.build()
    groups = {1: (0, 1, 2, 3), 2: (4, 5, 6, 7)}
    progs = [RankProgram(t0 if rank < 4 else t1, np.array([1 if rank < 4 else 2]), np.array([peer_of(rank)]))
             for rank in range(world)]
    return Trace(world, progs, groups)


def test_pipeline_stages_reduce_to_one_rank_per_stage():
    trace = _pipeline_trace(lambda r: r + 4 if r < 4 else r - 4)
    fast = simulate(trace, None, NET)
    full = simulate(trace, None, NET, symmetric=False)
    assert fast.symmetric and fast.simulated_ranks == [0, 4]
    assert len(full.simulated_ranks) == 8
    assert np.allclose(fast.finish_us, full.finish_us) and np.allclose(fast.exposed_comm_us, full.exposed_comm_us)
    ar4 = collective_time_us("all_reduce", 80_000, 4, Link(1.0, 0.0))
    assert fast.iteration_time_us == pytest.approx(50.0 + 40.0 + 30.0 + 40.0 + ar4)


def test_pipeline_peers_that_do_not_mirror_are_simulated_in_full():
    # stage 0's representative sends to rank 5, not to stage 1's representative (rank 4): still a uniform
    # pairing (every member of stage 0 pairs with the same rows of a member of stage 1), so reduced
    shifted = _pipeline_trace(lambda r: 4 + (r + 1) % 4 if r < 4 else (r - 4 - 1) % 4)
    r = simulate(shifted, None, NET)
    assert r.symmetric and r.simulated_ranks == [0, 4]
    assert np.allclose(r.finish_us, simulate(shifted, None, NET, symmetric=False).finish_us)
    # transfers of different cost: rank 1's NIC is degraded, so 1 -> 5 is slower than 0 -> 4: ranks 1 and 5
    # get classes of their own (the stages' all-reduces meet them there)
    slow_nic = NET.with_nics([1], "x", 0.5)
    mirrored = _pipeline_trace(lambda q: q + 4 if q < 4 else q - 4)
    r = simulate(mirrored, None, slow_nic)
    assert r.symmetric and r.simulated_ranks == [0, 1, 4, 5]
    assert np.allclose(r.finish_us, simulate(mirrored, None, slow_nic, symmetric=False).finish_us)
    assert r.iteration_time_us > simulate(mirrored, None, NET).iteration_time_us  # the slow pair paces all


# NIC sharing: a collective's bytes cross every member's egress and ingress port on the outermost network
# dimension its group spans; transfers crossing one port share it max-min fairly (collectives of other
# communicators, sends and recvs, channel sends alike).

def _two_comms(second: str = "coll", stream: str = "dp"):
    """An all-reduce on communicator 1 and, on its own stream, a second transfer of the same size at once."""
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)
    if second == "coll":
        b.add_coll("ar2", CollKind.ALL_REDUCE, AR_2, 1, stream=stream)
    return b


def test_collectives_of_two_communicators_share_the_nic():
    """Alone each takes 40 us; together on the same ports each moves at half speed: both end at 80 us
    (before, each ran at full bandwidth as if the other were not there)."""
    trace = spmd(_two_comms().build(), groups={1: (0, 1), 2: (0, 1)}, group_ids=(1, 2))
    r = simulate(trace, None, NET)
    assert r.iteration_time_us == pytest.approx(80.0)
    assert list(r.raw.duration_us[0]) == pytest.approx([80.0, 80.0])  # each slowed to half speed
    assert list(r.port_slowed_us) == pytest.approx([80.0, 80.0])  # each rank: two collectives 40 us late
    # one after the other on one communicator's stream: no sharing, 40 us each
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)
    b.add_coll("ar2", CollKind.ALL_REDUCE, AR_2, 1)
    serial = simulate(spmd(b.build(), groups={1: (0, 1), 2: (0, 1)}, group_ids=(1, 2)), None, NET)
    assert serial.iteration_time_us == pytest.approx(80.0)
    assert list(serial.raw.duration_us[0]) == pytest.approx([40.0, 40.0])
    assert not serial.port_slowed_us.any()


def _with_send(channel: str):
    """Rank 0: an all-reduce and, after 20 us of compute, a 40,000-byte send to rank 1 (40 us each alone);
    rank 1: the recv."""
    tables = []
    for rank in (0, 1):
        b = NodeTableBuilder()
        b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)
        if rank == 0:
            c = b.add_comp("c", duration_us=20.0)
            b.add_send("s", 40_000, peer=1, tag=7, stream=channel, data_deps=[c])
        else:
            b.add_recv("r", 40_000, peer=0, tag=7, stream=channel)
        tables.append(b.build())
    gid = np.array([1])
    return Trace(2, [RankProgram(t, gid, None) for t in tables], {1: (0, 1)})


@pytest.mark.parametrize("channel", ["", "ch0"])
def test_a_collective_and_a_send_share_the_ports_they_both_cross(channel):
    """The send crosses rank 0's egress and rank 1's ingress, the all-reduce both ranks' egress and ingress:
    max-min fair, each gets half of rank 0's egress while both run. The all-reduce alone for 20 us (half
    its work), then both at half speed: it ends at 60 us, the send's last 20 us of work alone, at 80. On a
    channel (an eager send of a decomposed collective) too: the flows a channel send re-times when it
    starts are not that send's (the all-reduce was once taken for one and never finished)."""
    r = simulate(_with_send(channel), None, NET)
    assert r.iteration_time_us == pytest.approx(80.0)
    assert list(r.raw.duration_us[0]) == pytest.approx([60.0, 20.0, 60.0])  # the all-reduce, compute, the send


def test_collectives_on_different_network_dimensions_do_not_share():
    """Groups along the inner and the outer dimension cross different ports: both at full speed."""
    net = Network("two", (NetworkDim("x", 2, Link(1.0, 0.0)), NetworkDim("y", 0, Link(1.0, 0.0))))
    b = NodeTableBuilder()
    b.add_coll("inner", CollKind.ALL_REDUCE, AR_2, 0)
    b.add_coll("outer", CollKind.ALL_REDUCE, AR_2, 1, stream="dp")
    tables = b.build()
    groups = {1: (0, 1), 2: (2, 3), 3: (0, 2), 4: (1, 3)}
    ids = {0: (1, 3), 1: (1, 4), 2: (2, 3), 3: (2, 4)}
    trace = Trace(4, [RankProgram(tables, np.asarray(ids[r]), np.zeros(0, dtype=np.int64)) for r in range(4)], groups)
    for symmetric in (True, False):
        r = simulate(trace, None, net, symmetric=symmetric)
        assert r.iteration_time_us == pytest.approx(40.0), symmetric


def test_nic_sharing_is_the_same_in_the_reduced_simulation():
    """Two communicators over 4 ranks on one switch: simulating one representative gives the full answer."""
    trace = spmd(_two_comms().build(), world=4, groups={1: (0, 1, 2, 3), 2: (0, 1, 2, 3)}, group_ids=(1, 2))
    fast, full = simulate(trace, None, NET), simulate(trace, None, NET, symmetric=False)
    assert fast.symmetric and not full.symmetric
    alone = collective_time_us("all_reduce", AR_2, 4, Link(1.0, 0.0))
    assert fast.iteration_time_us == pytest.approx(full.iteration_time_us) == pytest.approx(2 * alone)
    assert np.allclose(fast.port_slowed_us, full.port_slowed_us) and fast.port_slowed_us.min() > 0


def test_the_estimate_report_says_how_much_nic_sharing_cost():
    """`flint estimate`'s report: the delay transfers took from sharing ports, per rank (absent without any)."""
    from flint.sim.report import estimate_report, format_report

    def report(trace):
        return estimate_report(simulate(trace, None, NET), source="t", device=None, network="test",
                               algorithm="ring", dtype="bf16")

    shared = report(spmd(_two_comms().build(), groups={1: (0, 1), 2: (0, 1)}, group_ids=(1, 2)))
    assert shared["nic_sharing_us"] == {"mean": pytest.approx(80.0), "max": pytest.approx(80.0)}
    assert ("  NIC sharing: transfers sharing a port with other traffic finished 0.080 ms later, summed per rank "
            "(mean over ranks; max 0.080 ms)") in format_report(shared).splitlines()
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, AR_2, 0)
    alone = report(spmd(b.build()))
    assert "nic_sharing_us" not in alone and "NIC sharing" not in format_report(alone)


@pytest.mark.parametrize("channel", ["", "ch0"])
def test_a_send_waits_for_its_recv_unless_on_a_channel(channel):
    """Rank 0 sends 40,000 bytes at once (40 us); rank 1 posts the recv after 100 us of compute. A send
    and its recv run together (100-140 us), as an NCCL send larger than its buffers waits for the
    receiver; a channel's send is eager (0-40 us) and its recv finishes when posted, the data being there.
    (Every send was eager once: the per-peer queues fell under the channel rule.)"""
    b = NodeTableBuilder()
    b.add_send("s", 40_000, peer=1, tag=0, stream=channel)
    sender = b.build()
    b = NodeTableBuilder()
    c = b.add_comp("c", duration_us=100.0)
    b.add_recv("r", 40_000, peer=0, tag=0, data_deps=[c], stream=channel)
    r = simulate(Trace(2, [RankProgram(sender), RankProgram(b.build())]), None, NET)
    send_start, send_end = r.raw.start_us[0][0], r.raw.finish_us[0][0]
    if channel:
        assert (send_start, send_end, r.iteration_time_us) == pytest.approx((0.0, 40.0, 100.0))
    else:
        assert (send_start, send_end, r.iteration_time_us) == pytest.approx((100.0, 140.0, 140.0))
