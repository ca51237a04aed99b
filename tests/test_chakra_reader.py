"""Reading Chakra traces back: Flint's own, chakra_converter's, symbolic_tensor_graph-style, broken ones."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage

from flint.chakra import ReadNodeTable, TraceError, check_trace, read_trace, write_trace
from flint.trace import CollKind, NodeKind, NodeTableBuilder, RankProgram, Trace

from chakra_helpers import DATA, attrs, decode_file, dir_bytes, fsdp_tp_trace, pipeline_trace


def _write_nodes(path, nodes, metadata=True):
    with open(path, "wb") as f:
        if metadata:
            encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
        for n in nodes:
            encodeMessage(f, n)


def _attr(name, **kw):
    a = pb.AttributeProto(name=name)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize("make", [fsdp_tp_trace, pipeline_trace])
def test_round_trip_is_byte_identical(tmp_path, make):
    write_trace(make(), tmp_path / "a", "s")
    back = read_trace(tmp_path / "a")
    assert all(isinstance(p.table, ReadNodeTable) and p.group_ids is None for p in back.ranks)
    write_trace(back, tmp_path / "b", "s")
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


def test_round_trip_keeps_columns(tmp_path):
    trace = fsdp_tp_trace()
    write_trace(trace, tmp_path / "a", "s")
    back = read_trace(tmp_path / "a")
    assert back.world_size == 4 and back.comm_groups == trace.comm_groups
    for r in range(4):
        src, got = trace.ranks[r], back.ranks[r].table
        assert got.names == src.table.names
        assert np.array_equal(got.kind, src.table.kind)
        assert np.array_equal(got.comm_group, src.groups())
        assert np.array_equal(got.comm_bytes, src.table.comm_bytes)
        assert np.array_equal(got.data_dep_idx, src.table.data_dep_idx)
        assert np.array_equal(got.ctrl_dep_ptr, src.table.ctrl_dep_ptr)
        comp = got.kind == NodeKind.COMP
        assert np.array_equal(got.flops[comp], src.table.flops[comp])
        assert np.array_equal(got.duration_us[comp], np.round(src.table.duration_us[comp]))


def test_sparse_ids_and_missing_durations_round_trip(tmp_path):
    b = NodeTableBuilder()
    a = b.add_comp("a", flops=10, tensor_bytes=2, node_id=900)  # no duration
    b.add_comp("b", duration_us=0.2, flops=10, tensor_bytes=2, data_deps=[a], node_id=3)  # rounds to 0 = absent
    write_trace(Trace(1, [RankProgram(b.build())], {}), tmp_path / "a", "s")
    back = read_trace(tmp_path / "a")
    t = back.ranks[0].table
    assert t.node_ids.tolist() == [900, 3] and math.isnan(t.duration_us[0]) and math.isnan(t.duration_us[1])
    write_trace(back, tmp_path / "b", "s")
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


def test_identical_rank_files_share_a_table(tmp_path):
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1, flops=1, tensor_bytes=1)
    t = b.build()
    write_trace(Trace(3, [RankProgram(t)] * 3, {}), tmp_path / "a", "s")
    back = read_trace(tmp_path / "a")
    assert back.ranks[0].table is back.ranks[2].table


# -- chakra_converter output of a real 2-rank gloo run ---------------------------


def test_reads_chakra_converter_trace():
    tr = read_trace(DATA / "converter")
    assert tr.world_size == 2 and tr.comm_groups == {}
    t = tr.ranks[0].table
    assert t.metadata_version == ""  # the converter writes metadata attributes but no version
    kinds = set(t.kind.tolist())
    assert kinds == {NodeKind.COMP, NodeKind.METADATA}
    names = set(t.names)
    assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_", "c10d::send"} <= names
    assert len(t.cpu_op_rows) == len(t)  # is_cpu_op=true on every host op
    assert check_trace(tr) == []


def test_converter_trace_rewrites_and_then_round_trips(tmp_path):
    tr = read_trace(DATA / "converter")
    write_trace(tr, tmp_path / "a", "c")
    meta, nodes = decode_file(tmp_path / "a" / "c.0.et")
    assert meta.version == "0.0.4"
    mm = next(n for n in nodes if n.name == "aten::mm")
    a = attrs(mm)
    assert a["is_cpu_op"] == ("bool_val", True)  # kept verbatim, not overwritten by false
    assert "rf_id" in a and "op_schema" in a  # unknown attributes survive
    assert mm.inputs.values  # unknown node fields survive
    write_trace(read_trace(tmp_path / "a"), tmp_path / "b", "c")
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


# -- symbolic_tensor_graph style ---------------------------------------------


def test_reads_stg_style_trace():
    tr = read_trace(DATA / "stg")
    t0, t1 = tr.ranks[0].table, tr.ranks[1].table
    assert t0.metadata_version == ""
    assert np.isnan(t0.duration_us).all()  # roofline-only compute nodes
    assert t0.flops.tolist()[0] == 2 * 64 * 128 * 256
    assert t0.comm_type.tolist()[1] == CollKind.ALL_REDUCE and t0.comm_group[1] == 0  # empty pg_name = all ranks
    assert t0.comm_type.tolist()[3] == CollKind.ALL_GATHER and t0.comm_bytes[3] == 32768  # int32 / uint64 attributes
    assert t0.kind[4] == NodeKind.SEND and t0.comm_peer[4] == 1 and t0.comm_tag[4] == 5
    assert t1.kind[4] == NodeKind.RECV and t1.comm_peer[4] == 0
    assert check_trace(tr) == []


@pytest.mark.parametrize("field,value", [("int32_val", 300), ("uint32_val", 300), ("sint64_val", 300), ("fixed64_val", 300),
                                         ("sfixed32_val", 300), ("uint64_val", 300), ("sint32_val", 300), ("fixed32_val", 300)])
def test_any_integer_attribute_type(tmp_path, field, value):
    n = pb.Node(id=1, name="ag", type=pb.COMM_COLL_NODE, attr=[_attr("comm_type", **{field: 2}), _attr("comm_size", **{field: value})])
    _write_nodes(tmp_path / "t.0.et", [n])
    t = read_trace(tmp_path).ranks[0].table
    assert t.comm_type[0] == CollKind.ALL_GATHER and t.comm_bytes[0] == value


def test_missing_metadata_record_is_accepted(tmp_path):
    n = pb.Node(id=5, name="x", type=pb.COMP_NODE, duration_micros=4)
    _write_nodes(tmp_path / "t.0.et", [n], metadata=False)
    t = read_trace(tmp_path).ranks[0].table
    assert t.metadata_version is None and t.node_ids.tolist() == [5] and t.duration_us[0] == 4


def test_out_of_order_file_is_topologically_ordered_and_dangling_deps_reported(tmp_path):
    nodes = [
        pb.Node(id=2, name="child", type=pb.COMP_NODE, data_deps=[1, 77]),
        pb.Node(id=1, name="parent", type=pb.COMP_NODE),
    ]
    _write_nodes(tmp_path / "t.0.et", nodes)
    tr = read_trace(tmp_path)
    t = tr.ranks[0].table
    assert t.names == ["parent", "child"] and t.data_deps(1).tolist() == [0]
    assert t.dangling == [(2, 77)]
    probs = check_trace(tr)
    assert [(p.rank, p.node_id) for p in probs] == [(0, 2)] and "node 77" in probs[0].message


# -- errors ------------------------------------------------------------------


def test_missing_rank_file_is_named(tmp_path):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    (tmp_path / "a" / "s.2.et").unlink()
    with pytest.raises(TraceError, match=r"s\.2\.et: missing rank file"):
        read_trace(tmp_path / "a")


def test_truncated_file(tmp_path):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    p = tmp_path / "a" / "s.1.et"
    p.write_bytes(p.read_bytes()[:-5])
    with pytest.raises(TraceError, match=r"s\.1\.et: truncated file: record \d+ at byte \d+ declares"):
        read_trace(tmp_path / "a")


def test_corrupt_node_names_file_and_node(tmp_path):
    n = pb.Node(id=33, name="x", type=pb.COMP_NODE)
    raw = n.SerializeToString() + b"\x57"  # field 10 with invalid wire type 7
    with open(tmp_path / "t.0.et", "wb") as f:
        encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
        f.write(bytes([len(raw)]) + raw)
    with pytest.raises(TraceError, match=r"t\.0\.et: node 33 \(byte \d+\): corrupt node"):
        read_trace(tmp_path)


def test_non_numeric_pg_name(tmp_path):
    n = pb.Node(id=4, name="ar", type=pb.COMM_COLL_NODE, attr=[_attr("comm_type", int64_val=0), _attr("comm_size", int64_val=8), _attr("pg_name", string_val="default_pg")])
    _write_nodes(tmp_path / "t.0.et", [n])
    with pytest.raises(TraceError, match=r"node 4 .*pg_name 'default_pg' is not a comm-group id"):
        read_trace(tmp_path)


def test_comm_groups_must_cover_used_groups(tmp_path):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    (tmp_path / "a" / "s.comm_groups.json").write_text('{"1": [0, 2], "2": [1, 3]}')
    with pytest.raises(TraceError, match=r"s\.0\.et: node \d+ \('L0\.all_reduce'\) uses comm group 3, but .*comm_groups\.json does not define it"):
        read_trace(tmp_path / "a")
    (tmp_path / "a" / "s.comm_groups.json").unlink()
    with pytest.raises(TraceError, match=r"no comm-group file was found beside the rank files \(s.comm_groups.json, workload.json, comm_group.json\); pass one with --comm-groups"):
        read_trace(tmp_path / "a")
    full = fsdp_tp_trace().comm_groups
    assert read_trace(tmp_path / "a", comm_groups=full).comm_groups == full


@pytest.mark.parametrize("name", ["workload.json", "comm_group.json"])
def test_comm_group_file_found_by_conventional_names(tmp_path, name):
    """symbolic_tensor_graph writes workload.<rank>.et with workload.json (its README: comm_group.json)."""
    write_trace(fsdp_tp_trace(), tmp_path / "a", "workload")
    (tmp_path / "a" / "workload.comm_groups.json").rename(tmp_path / "a" / name)
    assert read_trace(tmp_path / "a").comm_groups == fsdp_tp_trace().comm_groups


def test_gzip_is_rejected(tmp_path):
    import gzip

    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    p = tmp_path / "a" / "s.0.et"
    p.write_bytes(gzip.compress(p.read_bytes()))
    with pytest.raises(TraceError, match="gzip"):
        read_trace(tmp_path / "a")


def test_prefix_detection(tmp_path):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    assert read_trace(tmp_path / "a" / "s").world_size == 4
    assert read_trace(tmp_path / "a" / "s.3.et").world_size == 4
    for f in (tmp_path / "a").glob("s.*.et"):
        shutil.copy(f, tmp_path / "a" / f.name.replace("s.", "other.", 1))
    with pytest.raises(TraceError, match="several traces in this directory \\(other, s\\)"):
        read_trace(tmp_path / "a")
    with pytest.raises(TraceError, match="no such trace"):
        read_trace(tmp_path / "a" / "nothing")
    with pytest.raises(TraceError, match="no Chakra rank files"):
        read_trace(tmp_path)
