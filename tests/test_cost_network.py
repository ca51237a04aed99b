"""Network presets and the collective-cost formula against hand-computed values."""

import pytest

from flint.cost import Link, collective_time_us, list_networks, load_network, p2p_time_us
from flint.cost.network import network_from_dict
from flint.errors import FlintError
from flint.trace import CollKind

MIB = 2 ** 20
A = 0.5          # us per hop
B = 50.0         # GB/s -> 50,000 bytes/us
BPU = B * 1e3
SW = Link(B, A, "switch")


def test_ring_formulas_by_hand():
    n, S = 4, MIB
    assert collective_time_us("all_reduce", S, n, SW, "ring") == pytest.approx(2 * (n - 1) * A + 2 * (n - 1) / n * S / BPU)
    # all-gather input is the local shard: the full buffer is n x input
    assert collective_time_us(CollKind.ALL_GATHER, S, n, SW, "ring") == pytest.approx((n - 1) * A + (n - 1) * S / BPU)
    # reduce-scatter input is the full buffer
    assert collective_time_us("reduce_scatter", S, n, SW, "ring") == pytest.approx((n - 1) * A + (n - 1) / n * S / BPU)
    assert collective_time_us("all_to_all", S, n, SW, "ring") == pytest.approx((n - 1) * A + (n - 1) / n * S / BPU)
    assert collective_time_us("broadcast", S, n, SW, "ring") == pytest.approx((n - 1) * A + S / BPU)


def test_direct_tree_and_halving_doubling_by_hand():
    n, S = 8, 8 * MIB
    assert collective_time_us("all_to_all", S, n, SW, "direct") == pytest.approx(A + (n - 1) / n * S / BPU)
    assert collective_time_us("all_reduce", S, n, SW, "direct") == pytest.approx(2 * A + 2 * (n - 1) / n * S / BPU)
    assert collective_time_us("all_reduce", S, n, SW, "tree") == pytest.approx(2 * 3 * A + 2 * S / BPU)
    assert collective_time_us("all_reduce", S, n, SW, "halving-doubling") == pytest.approx(2 * 3 * A + 2 * (n - 1) / n * S / BPU)
    assert collective_time_us("reduce_scatter", S, n, SW, "halving-doubling") == pytest.approx(3 * A + (n - 1) / n * S / BPU)


def test_fully_connected_direct_uses_every_link():
    fc = Link(B, A, "fully-connected")
    n, S = 8, 8 * MIB
    assert collective_time_us("all_to_all", S, n, fc, "direct") == pytest.approx(A + S / n / BPU)


def test_ring_topology_costs_hops_for_far_peers():
    ring = Link(B, A, "ring")
    n, S = 8, 8 * MIB
    # a ring algorithm on a ring topology is neighbour-to-neighbour: same as on a switch
    assert collective_time_us("all_reduce", S, n, ring) == pytest.approx(collective_time_us("all_reduce", S, n, SW))
    # pairwise all-to-all: the step to distance d costs min(d, n-d) hops and shares links as much
    want = sum(A * min(d, n - d) + S / n * min(d, n - d) / BPU for d in range(1, n))
    assert collective_time_us("all_to_all", S, n, ring) == pytest.approx(want)
    mesh = Link(B, A, "mesh")
    assert collective_time_us("all_gather", S, n, mesh) == pytest.approx((n - 1) * 2 * A + (n - 1) * S / BPU)


def test_hierarchical_all_reduce_by_hand():
    nv, ib = Link(450.0, 1.0), Link(50.0, 3.0)
    S = 64 * MIB
    got = collective_time_us("all_reduce", S, 16, [(nv, 8), (ib, 2)], "ring")
    rs_nv = 7 * 1.0 + 7 / 8 * S / 450e3
    ar_ib = 2 * 1 * 3.0 + 2 * 1 / 2 * (S / 8) / 50e3
    assert got == pytest.approx(rs_nv + ar_ib + rs_nv)
    # all-gather of a shard over both levels (the mirror of reduce-scatter): the outer
    # level exchanges single shards (1 shard in over IB), then the node gathers 2 x 8 shards
    shard = MIB
    got = collective_time_us("all_gather", shard, 16, [(nv, 8), (ib, 2)], "ring")
    assert got == pytest.approx((3.0 + 1 * shard / 50e3) + (7 * 1.0 + 14 * shard / 450e3))


def test_trivial_and_invalid_collectives():
    assert collective_time_us("all_reduce", MIB, 1, SW) == 0.0
    with pytest.raises(FlintError, match="power-of-two"):
        collective_time_us("all_reduce", MIB, 6, SW, "halving-doubling")
    with pytest.raises(FlintError, match="unknown collective algorithm 'butterfly'.*ring"):
        collective_time_us("all_reduce", MIB, 4, SW, "butterfly")
    with pytest.raises(FlintError, match="tree algorithm"):
        collective_time_us("all_gather", MIB, 4, SW, "tree")
    with pytest.raises(FlintError, match="unknown collective 'allreduce'"):
        collective_time_us("allreduce", MIB, 4, SW)
    with pytest.raises(FlintError, match="does not cover"):
        collective_time_us("all_reduce", MIB, 16, [(SW, 8), (SW, 4)])


def test_p2p_time():
    assert p2p_time_us(MIB, SW) == pytest.approx(A + MIB / BPU)
    assert p2p_time_us(MIB, SW, hops=3) == pytest.approx(3 * A + MIB / BPU)


def test_presets_and_two_level_placement():
    assert set(list_networks()) >= {"dgx-h100", "ring", "switch", "wafer-2d-mesh"}
    net = load_network("dgx-h100").for_world(1024)
    assert net.sizes == (8, 128)
    nv, ib = net.dims[0].link, net.dims[1].link
    assert ib.bandwidth_gbytes_per_s == 50.0  # 400 Gb/s
    assert net.group_levels(range(8)) == [(nv, 8)]                  # a tensor-parallel group inside a node
    assert net.group_levels(range(3, 1024, 8)) == [(ib, 128)]       # a data-parallel group, one rank per node
    assert net.group_levels(range(32)) == [(nv, 8), (ib, 4)]        # spans both levels
    assert net.group_levels([0, 1, 8]) == [(ib, 3)]                 # irregular: slowest link, whole group
    assert net.p2p_time_us(0, 1, MIB) == pytest.approx(1.0 + MIB / 450e3)
    assert net.p2p_time_us(0, 9, MIB) == pytest.approx(1.0 + 3.0 + MIB / 50e3)
    wafer = load_network("wafer-2d-mesh").for_world(64)
    assert wafer.sizes == (16, 4)
    assert wafer.p2p_time_us(0, 5, 0) == pytest.approx(5 * 0.1)


def test_network_errors():
    with pytest.raises(FlintError, match="unknown topology 'torus'.*switch.*fully-connected.*ring.*mesh"):
        network_from_dict({"name": "x", "dims": [{"topology": "torus", "bandwidth_gbytes_per_s": 1}]})
    with pytest.raises(FlintError, match="unknown network 'dgx'.*dgx-h100"):
        load_network("dgx")
    with pytest.raises(FlintError, match="not a multiple"):
        load_network("dgx-h100").for_world(12)
    with pytest.raises(FlintError, match="needs bandwidth"):
        network_from_dict({"name": "x", "dims": [{"topology": "ring"}]})
    assert load_network("dgx-h100", sizes=[4, 2]).for_world(8).sizes == (4, 2)
