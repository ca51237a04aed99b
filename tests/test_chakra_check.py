"""check_trace finds what makes a consumer abort or deadlock, also among 1,024 ranks sharing one table (its speed:
bench/analyses.py)."""

from __future__ import annotations

import numpy as np
import pytest

from flint.chakra import check_trace, read_trace, write_trace
from flint.chakra.check import cycle_rows
from flint.mesh import Mesh, assign_group_ids
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

from chakra_helpers import fsdp_tp_trace, pipeline_trace

E = np.zeros(0, dtype=np.int64)


def test_sound_traces_have_no_problems(tmp_path):
    assert check_trace(fsdp_tp_trace()) == []
    assert check_trace(pipeline_trace()) == []
    write_trace(fsdp_tp_trace(dp=4, tp=2), tmp_path / "a", "s")
    assert check_trace(read_trace(tmp_path / "a")) == []


def _p2p(send_peer=1, send_tag=7, send_size=512, recv_peer=0, recv_tag=7, recv_size=512, n_recv=1):
    b0 = NodeTableBuilder()
    b0.add_send("s", send_size, 0, send_tag, node_id=10)
    b1 = NodeTableBuilder()
    prev = []
    for i in range(n_recv):
        prev = [b1.add_recv(f"r{i}", recv_size, 0, recv_tag, data_deps=prev, node_id=20 + i)]
    return Trace(2, [RankProgram(b0.build(), group_ids=E, peer_ranks=np.array([send_peer])),
                     RankProgram(b1.build(), group_ids=E, peer_ranks=np.array([recv_peer]))], {})


def test_matched_send_recv():
    assert check_trace(_p2p()) == []


@pytest.mark.parametrize("kw", [dict(recv_tag=8), dict(recv_size=256), dict(send_peer=0), dict(n_recv=2)])
def test_unmatched_send_recv(kw):
    probs = check_trace(_p2p(**kw))
    assert probs, kw
    assert any("unmatched" in p.message for p in probs)
    assert {p.rank for p in probs if "unmatched" in p.message} <= {0, 1}


def test_unmatched_message_names_the_node():
    probs = check_trace(_p2p(recv_tag=8))
    send = next(p for p in probs if "unmatched send" in p.message)
    assert (send.rank, send.node_id) == (0, 10)
    assert "0 -> 1 tag 7 size 512: 1 send(s) but 0 matching recv(s)" in send.message
    recv = next(p for p in probs if "unmatched recv" in p.message)
    assert (recv.rank, recv.node_id) == (1, 20)


def test_send_without_peer_in_read_trace():
    b = NodeTableBuilder()
    b.add_send("s", 8, -1, -1, node_id=3)
    probs = check_trace(Trace(1, [RankProgram(b.build())], {}))
    assert [(p.rank, p.node_id) for p in probs] == [(0, 3)] and "no destination" in probs[0].message


def test_collective_order_mismatch_across_group():
    mesh = Mesh((2,), ("dp",))
    groups, lookup = assign_group_ids(mesh, [("dp",)])
    b0 = NodeTableBuilder()
    a = b0.add_coll("ag", CollKind.ALL_GATHER, 100, 0, node_id=1)
    b0.add_coll("rs", CollKind.REDUCE_SCATTER, 200, 0, data_deps=[a], node_id=2)
    b1 = NodeTableBuilder()
    a = b1.add_coll("rs", CollKind.REDUCE_SCATTER, 200, 0, node_id=1)
    b1.add_coll("ag", CollKind.ALL_GATHER, 100, 0, data_deps=[a], node_id=2)
    gid = np.array([lookup[(0,)][0]])
    tr = Trace(2, [RankProgram(b0.build(), group_ids=gid, peer_ranks=E), RankProgram(b1.build(), group_ids=gid, peer_ranks=E)], groups)
    probs = check_trace(tr)
    assert len(probs) == 1
    assert "collective #0 of comm group 1 is" in probs[0].message and "same order" in probs[0].message


def test_collective_size_mismatch_and_missing_collective():
    mesh = Mesh((3,), ("dp",))
    groups, lookup = assign_group_ids(mesh, [("dp",)])
    gid = np.array([1])

    def table(sizes):
        b = NodeTableBuilder()
        prev = []
        for i, s in enumerate(sizes):
            prev = [b.add_coll(f"ar{i}", CollKind.ALL_REDUCE, s, 0, data_deps=prev, node_id=i)]
        if not sizes:
            b.add_comp("idle", duration_us=1)
        return b.build()

    tr = Trace(3, [RankProgram(table([8, 8]), group_ids=gid, peer_ranks=E),
                   RankProgram(table([8, 16]), group_ids=gid, peer_ranks=E),
                   RankProgram(table([8]), group_ids=gid, peer_ranks=E)], groups)
    probs = check_trace(tr)
    by_rank = {p.rank: p for p in probs}
    assert set(by_rank) == {1, 2}  # rank 0 is the reference (each signature occurs once; the first wins)
    assert by_rank[1].node_id == 1 and "ALL_REDUCE of 16 bytes here but ALL_REDUCE of 8 bytes on rank 0" in by_rank[1].message
    assert "issues 1 collective(s) of comm group 1 but rank 0 issues 2" in by_rank[2].message


def test_all_ranks_collectives_checked_too():
    b0 = NodeTableBuilder()
    b0.add_coll("ar", CollKind.ALL_REDUCE, 8, -1)
    b1 = NodeTableBuilder()
    b1.add_comp("x", duration_us=1)
    tr = Trace(2, [RankProgram(b0.build()), RankProgram(b1.build())], {})
    probs = check_trace(tr)
    assert len(probs) == 1 and probs[0].rank == 1 and "of all ranks" in probs[0].message


def test_group_membership_and_unknown_group():
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, 8, 0, node_id=5)
    t = b.build()
    tr = Trace(2, [RankProgram(t, group_ids=np.array([1]), peer_ranks=E), RankProgram(t, group_ids=np.array([2]), peer_ranks=E)],
               {1: (0,)})
    msgs = {(p.rank, p.node_id): p.message for p in check_trace(tr)}
    assert "comm group 2, which is not in comm_groups" in msgs[(1, 5)]
    tr = Trace(2, [RankProgram(t, group_ids=np.array([1]), peer_ranks=E)] * 2, {1: (0,)})
    msgs = {(p.rank, p.node_id): p.message for p in check_trace(tr)}
    assert list(msgs) == [(1, 5)] and "rank 1 is not a member" in msgs[(1, 5)]


def test_cycle_and_dangling_and_empty_and_unsupported():
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1, node_id=10)
    b.add_comp("y", duration_us=1, data_deps=[0], node_id=11)
    b.add_coll("red", CollKind.REDUCE, 8, -1, node_id=12)
    t = b.build()
    t.ctrl_dep_ptr = np.array([0, 1, 1, 2])
    t.ctrl_dep_idx = np.array([1, 9])
    assert cycle_rows(t).tolist() == [0, 1]
    tr = Trace(2, [RankProgram(t), RankProgram(NodeTableBuilder().build())], {})
    probs = check_trace(tr)
    text = "\n".join(str(p) for p in probs)
    assert "rank 0, node 12: ctrl dependency on row 9" in text
    assert "rank 0, node 10: dependency cycle: 2 node(s)" in text
    assert "rank 0, node 12: REDUCE collective: ASTRA-sim aborts" in text
    assert "rank 1: rank has no nodes" in text


def test_acyclic_out_of_order_table_is_not_a_cycle():
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    b.add_comp("y", duration_us=1)
    t = b.build()
    t.data_dep_ptr = np.array([0, 1, 1])
    t.data_dep_idx = np.array([1])  # row 0 waits for row 1: out of order but acyclic
    assert cycle_rows(t).tolist() == []


def test_1024_ranks_of_a_5000_node_role_and_one_broken_binding():
    dp, tp = 128, 8
    mesh = Mesh((dp, tp), ("dp", "tp"))
    groups, lookup = assign_group_ids(mesh, [("dp",), ("tp",)])
    b = NodeTableBuilder()
    prev = []
    kinds = [CollKind.ALL_GATHER, CollKind.ALL_REDUCE, CollKind.REDUCE_SCATTER]
    for i in range(5000):
        if i % 5 == 4:
            prev = [b.add_coll(f"c{i}", kinds[i % 3], 1000 + i, i % 2, data_deps=prev)]
        else:
            prev = [b.add_comp(f"n{i}", duration_us=1.0, flops=10, tensor_bytes=10, data_deps=prev)]
    t = b.build()
    bind = np.stack([lookup[(0,)], lookup[(1,)]], axis=1)
    tr = Trace(dp * tp, [RankProgram(t, group_ids=bind[r], peer_ranks=E) for r in range(dp * tp)], groups)
    assert check_trace(tr) == []  # its speed at scale: bench/analyses.py
    # Break one rank's binding: it claims another tp group; its own tp group then misses its collectives.
    bad = bind.copy()
    bad[5, 1] = bind[100, 1]
    tr.ranks[5] = RankProgram(t, group_ids=bad[5], peer_ranks=E)
    probs = check_trace(tr)
    assert any(p.rank == 5 and "not a member" in p.message for p in probs)
    own = int(bind[5, 1])
    assert any(p.rank == 5 and f"issues 0 collective(s) of comm group {own} but rank 0 issues 500" in p.message for p in probs)
    assert all(p.rank == 5 for p in probs)
