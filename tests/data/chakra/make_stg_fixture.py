"""Regenerate the symbolic_tensor_graph-style fixture in ``stg/``.

It mimics what symbolic_tensor_graph writes (see ../../../../shared/CHAKRA.md):
a GlobalMetadata record without a version (an empty message, so a
zero-length first record), compute nodes with ``num_ops``/``tensor_size`` but
no ``duration_micros`` (roofline only), ``is_cpu_op`` as int32, collectives
with an empty ``pg_name`` (all ranks), a send/recv pair with
``comm_src``/``comm_dst``/``comm_tag``, and a few attributes in other integer
types (uint64 ``comm_size``, int32 ``comm_type``). Two ranks, no comm-group
file. Run from the repository root:

    .venv/bin/python tests/data/chakra/make_stg_fixture.py
"""

from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage

HERE = Path(__file__).resolve().parent / "stg"


def attr(name, **kw):
    a = pb.AttributeProto(name=name)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def comp(nid, name, flops, nbytes, deps):
    n = pb.Node(id=nid, name=name, type=pb.COMP_NODE, data_deps=deps)
    n.attr.extend([attr("is_cpu_op", int32_val=0), attr("num_ops", int64_val=flops), attr("tensor_size", uint64_val=nbytes)])
    return n


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for rank in range(2):
        peer = 1 - rank
        nodes = [
            comp(10, "mlp.fc1", 2 * 64 * 128 * 256, 64 * 256 * 2, []),
            pb.Node(id=11, name="tp.allreduce", type=pb.COMM_COLL_NODE, data_deps=[10],
                    attr=[attr("is_cpu_op", int32_val=0), attr("comm_type", int64_val=pb.ALL_REDUCE),
                          attr("comm_size", int64_val=65536), attr("pg_name", string_val="")]),
            comp(12, "mlp.fc2", 2 * 64 * 256 * 128, 64 * 128 * 2, [11]),
            pb.Node(id=13, name="dp.allgather", type=pb.COMM_COLL_NODE, data_deps=[12],
                    attr=[attr("is_cpu_op", int32_val=0), attr("comm_type", int32_val=pb.ALL_GATHER),
                          attr("comm_size", uint64_val=32768)]),
        ]
        if rank == 0:
            nodes.append(pb.Node(id=14, name="pp.send", type=pb.COMM_SEND_NODE, data_deps=[13],
                                 attr=[attr("is_cpu_op", int32_val=0), attr("comm_src", int32_val=0), attr("comm_dst", int32_val=peer),
                                       attr("comm_tag", int32_val=5), attr("comm_size", int64_val=16384)]))
        else:
            nodes.append(pb.Node(id=14, name="pp.recv", type=pb.COMM_RECV_NODE, data_deps=[13],
                                 attr=[attr("is_cpu_op", int32_val=0), attr("comm_src", int32_val=peer), attr("comm_dst", int32_val=1),
                                       attr("comm_tag", int32_val=5), attr("comm_size", int64_val=16384)]))
        with open(HERE / f"stg.{rank}.et", "wb") as f:
            encodeMessage(f, pb.GlobalMetadata())
            for n in nodes:
                encodeMessage(f, n)


if __name__ == "__main__":
    main()
