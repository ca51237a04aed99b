"""Small traces and decoding helpers shared by the tests/test_chakra_*.py files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import decodeMessage

from flint.mesh import Mesh, assign_group_ids
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

DATA = Path(__file__).resolve().parent / "data" / "chakra"


def fsdp_tp_trace(dp: int = 2, tp: int = 2, layers: int = 2) -> Trace:
    """A symbolic FSDP x TP step: one table shared by all ranks, slots 0 = dp group, 1 = tp group."""
    mesh = Mesh((dp, tp), ("dp", "tp"))
    groups, lookup = assign_group_ids(mesh, [("dp",), ("tp",)])
    b = NodeTableBuilder()
    prev: list[int] = []
    for layer in range(layers):
        ag = b.add_coll(f"L{layer}.all_gather", CollKind.ALL_GATHER, 1024, 0, data_deps=prev)
        mm = b.add_comp(f"L{layer}.mm", duration_us=12.6, flops=2_000_000, tensor_bytes=4096, data_deps=[ag])
        ar = b.add_coll(f"L{layer}.all_reduce", CollKind.ALL_REDUCE, 4096, 1, data_deps=[mm])
        prev = [ar]
    for layer in reversed(range(layers)):
        g = b.add_comp(f"L{layer}.grad", duration_us=25.0, flops=4_000_000, tensor_bytes=8192, data_deps=prev)
        rs = b.add_coll(f"L{layer}.reduce_scatter", CollKind.REDUCE_SCATTER, 2048, 0, data_deps=[g], ctrl_deps=prev)
        prev = [rs]
    b.add_comp("optim", duration_us=3.0, flops=1000, tensor_bytes=100, data_deps=prev)
    table = b.build()
    bind = np.stack([lookup[(0,)], lookup[(1,)]], axis=1)
    ranks = [RankProgram(table, group_ids=bind[r], peer_ranks=np.zeros(0, dtype=np.int64)) for r in range(dp * tp)]
    return Trace(dp * tp, ranks, groups)


def pipeline_trace() -> Trace:
    """Two ranks, a symbolic send/recv pair (peer slot 0 = the other rank) plus an all-ranks all-reduce."""
    b0 = NodeTableBuilder()
    f = b0.add_comp("fwd", duration_us=5.0, flops=100, tensor_bytes=10)
    s = b0.add_send("send_act", 512, 0, 7, data_deps=[f])
    b0.add_coll("ar", CollKind.ALL_REDUCE, 64, -1, data_deps=[s])
    b1 = NodeTableBuilder()
    r = b1.add_recv("recv_act", 512, 0, 7)
    f1 = b1.add_comp("fwd", duration_us=5.0, flops=100, tensor_bytes=10, data_deps=[r])
    b1.add_coll("ar", CollKind.ALL_REDUCE, 64, -1, data_deps=[f1])
    t0, t1 = b0.build(), b1.build()
    e = np.zeros(0, dtype=np.int64)
    return Trace(2, [RankProgram(t0, group_ids=e, peer_ranks=np.array([1])), RankProgram(t1, group_ids=e, peer_ranks=np.array([0]))], {})


def decode_file(path) -> tuple[pb.GlobalMetadata, list[pb.Node]]:
    """Decode one ET file with Chakra's own protolib."""
    with open(path, "rb") as f:
        meta = pb.GlobalMetadata()
        assert decodeMessage(f, meta)
        nodes = []
        while True:
            n = pb.Node()
            if not decodeMessage(f, n):
                break
            nodes.append(n)
    return meta, nodes


def attrs(node: pb.Node) -> dict[str, tuple[str, object]]:
    """name -> (oneof field name, value)."""
    out = {}
    for a in node.attr:
        which = a.WhichOneof("value")
        out[a.name] = (which, getattr(a, which))
    return out


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir())}


def real_astra_sim() -> str | None:
    """The real ASTRA-sim binary: $FLINT_ASTRA_SIM, else ../shared/tools/astra-sim/ beside the checkout, else PATH."""
    import os
    import shutil

    from flint.chakra.astra_sim import BINARY_ENV, DEFAULT_BINARY

    env = os.environ.get(BINARY_ENV)
    if env:
        return env
    for up in Path(__file__).resolve().parents[1:4]:  # ../shared beside the checkout (or a worktree's parent)
        shared = up / "shared" / "tools" / "astra-sim" / DEFAULT_BINARY
        if shared.is_file() and os.access(shared, os.X_OK):
            return str(shared)
    return shutil.which(DEFAULT_BINARY)


REAL_ASTRA_SIM = real_astra_sim()
ASTRA_SKIP_REASON = ("the real ASTRA-sim binary is not available (set FLINT_ASTRA_SIM, or keep "
                     "../shared/tools/astra-sim/AstraSim_Analytical_Congestion_Unaware beside the checkout)")
