"""SPMD expansion of a chakra.graph: repeats, groups and peers per rank."""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.parser import Parser

from flint.chakra.from_ir import trace_from_ir
from flint.errors import FlintError
from flint.ir import flint_context
from flint.mesh import Mesh

GRAPH = """
shard.grid @mesh(shape = 2x4) {flint.axis_names = ["dp", "tp"]}
chakra.graph @step {
  %0 = chakra.comp "pre" flops = 10 bytes = 4 duration_us = 1.0
  %1 = chakra.coll all_gather "ag0" on @mesh grid_axes = [0] bytes = 64 data(%0)
  %2, %3 = chakra.repeat 5 (%0, %1) {
  ^bb0(%c: !chakra.node, %m: !chakra.node):
    %a = chakra.coll all_gather "ag" on @mesh grid_axes = [0] bytes = 64 ctrl(%m)
    %b = chakra.comp "mm" flops = 100 bytes = 8 duration_us = 2.0 data(%a) ctrl(%c)
    %x = chakra.comp "uses_outer" data(%b, %0)
    %r = chakra.coll all_reduce "ar" on @mesh grid_axes = [1] bytes = 32 data(%x) ctrl(%a)
    chakra.yield %x, %r
  }
  %4 = chakra.comp "mid" data(%2, %3)
  %5, %6 = chakra.repeat 3 (%4, %3) {
  ^bb0(%c: !chakra.node, %m: !chakra.node):
    %s = chakra.send "s" on @mesh grid_axes = [1] offset = 1 tag = 3 bytes = 16 data(%c) ctrl(%m)
    %v = chakra.recv "r" on @mesh grid_axes = [1] offset = -1 tag = 3 bytes = 16 ctrl(%s)
    %y = chakra.comp "bwd" data(%v, %c, %2)
    chakra.yield %y, %v
  }
  %7 = chakra.comp "post" data(%5, %2) ctrl(%6)
}
"""


def _module():
    return Parser(flint_context(), GRAPH).parse_module()


def _deps(table):
    return [(tuple(table.data_deps(i)), tuple(table.ctrl_deps(i))) for i in range(len(table))]


def test_numpy_replication_equals_python_unrolling():
    fast, slow = trace_from_ir(_module()), trace_from_ir(_module(), fast_repeat=False)
    a, b = fast.ranks[0].table, slow.ranks[0].table
    assert len(a) == len(b) == 2 + 5 * 4 + 1 + 3 * 3 + 1
    assert a.names == b.names
    for col in ("kind", "duration_us", "flops", "tensor_bytes", "comm_type", "comm_bytes", "comm_group",
                "comm_peer", "comm_tag", "node_ids"):
        np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=col)
    assert _deps(a) == _deps(b)


def test_groups_and_peers_follow_the_mesh():
    trace = trace_from_ir(_module())
    mesh = Mesh((2, 4), ("dp", "tp"))
    assert trace.world_size == 8
    for rank, prog in enumerate(trace.ranks):
        t = prog.table
        groups, peers = prog.groups(), prog.peers()
        for i in range(len(t)):
            if t.names[i] in ("ag", "ag0"):
                assert trace.comm_groups[int(groups[i])] == mesh.group(rank, ["dp"])
            if t.names[i] == "ar":
                assert trace.comm_groups[int(groups[i])] == mesh.group(rank, ["tp"])
            if t.names[i] == "s":
                assert peers[i] == mesh.peer(rank, "tp", 1)
            if t.names[i] == "r":
                assert peers[i] == mesh.peer(rank, "tp", -1)
    assert sorted(trace.comm_groups) == list(range(1, 7))  # 4 dp groups + 2 tp groups, ids from 1


def test_missing_graph_is_an_error():
    module = Parser(flint_context(), 'shard.grid @mesh(shape = 2)\n').parse_module()
    with pytest.raises(FlintError, match="no chakra.graph @step; run -p lower-to-chakra first"):
        trace_from_ir(module)
