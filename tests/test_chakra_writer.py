"""The Chakra writer follows every rule in ../shared/CHAKRA.md."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chakra.schema.protobuf import et_def_pb2 as pb

from flint.chakra import write_trace
from flint.chakra import writer as writer_mod
from flint.errors import FlintError
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

from chakra_helpers import attrs, decode_file, dir_bytes, fsdp_tp_trace, pipeline_trace


@pytest.fixture
def written(tmp_path):
    trace = fsdp_tp_trace()
    stats = write_trace(trace, tmp_path / "out", "step")
    return trace, tmp_path / "out", stats


def test_one_file_per_rank_plus_groups(written):
    trace, out, stats = written
    assert sorted(os.listdir(out)) == [f"step.{r}.et" for r in range(4)] + ["step.comm_groups.json"]
    assert stats.files == 5 and stats.ranks == 4 and stats.distinct_tables == 1
    assert stats.bytes_written == sum(len(b) for b in dir_bytes(out).values())


def test_metadata_record_first_with_version(written):
    _, out, _ = written
    for r in range(4):
        meta, nodes = decode_file(out / f"step.{r}.et")
        assert meta.version == "0.0.4"
        assert nodes and nodes[0].name == "L0.all_gather"
    # The very first record is the metadata, not a node: its first byte after the length is field 1 (version).
    raw = (out / "step.0.et").read_bytes()
    assert raw[0] == len(b"\x0a\x050.0.4") and raw[1:8] == b"\x0a\x050.0.4"


def test_no_gzip(written):
    _, out, _ = written
    for p in out.glob("*.et"):
        assert p.read_bytes()[:2] != b"\x1f\x8b"
        with pytest.raises(OSError):
            gzip.open(p).read(1)


def test_comm_groups_ids_from_one_as_string_keys(written):
    trace, out, _ = written
    text = (out / "step.comm_groups.json").read_text()
    raw = json.loads(text)
    assert all(isinstance(k, str) for k in raw)
    ids = sorted(int(k) for k in raw)
    assert ids[0] == 1 and ids == list(range(1, len(ids) + 1))
    assert {int(k): tuple(v) for k, v in raw.items()} == trace.comm_groups
    # pg_name on every collective is one of those ids, as a string, and the rank is a member.
    for r in range(4):
        _, nodes = decode_file(out / f"step.{r}.et")
        for n in nodes:
            if n.type == pb.COMM_COLL_NODE:
                kind, pg = attrs(n)["pg_name"]
                assert kind == "string_val" and pg in raw and r in raw[pg]


def test_attribute_value_types(tmp_path):
    write_trace(pipeline_trace(), tmp_path / "p", "p")
    _, out, _ = None, tmp_path / "p", None
    want = {
        pb.COMP_NODE: {"num_ops": "int64_val", "tensor_size": "uint64_val", "is_cpu_op": "bool_val"},
        pb.COMM_COLL_NODE: {"comm_type": "int64_val", "comm_size": "int64_val"},
        pb.COMM_SEND_NODE: {"comm_dst": "int32_val", "comm_tag": "int32_val", "comm_size": "int64_val"},
        pb.COMM_RECV_NODE: {"comm_src": "int32_val", "comm_tag": "int32_val", "comm_size": "int64_val"},
    }
    seen = set()
    for r in range(2):
        _, nodes = decode_file(out / f"p.{r}.et")
        for n in nodes:
            got = {k: v[0] for k, v in attrs(n).items()}
            assert got == want[n.type], (n.name, got)
            seen.add(n.type)
            if n.type == pb.COMP_NODE:
                assert n.duration_micros == 5 and attrs(n)["is_cpu_op"][1] is False
            if n.type == pb.COMM_SEND_NODE:
                assert attrs(n)["comm_dst"][1] == 1 and attrs(n)["comm_tag"][1] == 7
            if n.type == pb.COMM_RECV_NODE:
                assert attrs(n)["comm_src"][1] == 0
            if n.type == pb.COMM_COLL_NODE:
                assert "pg_name" not in attrs(n)  # group -1 = all ranks: no pg_name
    assert seen == set(want)


def test_compute_nodes_carry_duration_and_roofline_inputs(written):
    _, out, _ = written
    _, nodes = decode_file(out / "step.0.et")
    mm = next(n for n in nodes if n.name == "L0.mm")
    assert mm.duration_micros == 13  # 12.6 us rounded to whole microseconds
    assert attrs(mm)["num_ops"] == ("int64_val", 2_000_000)
    assert attrs(mm)["tensor_size"] == ("uint64_val", 4096)


def test_comm_size_is_input_buffer_bytes(written):
    """comm_size is each rank's input buffer: the all-gather shard, the full reduce-scatter input, the full all-reduce buffer."""
    _, out, _ = written
    _, nodes = decode_file(out / "step.0.et")
    by_name = {n.name: attrs(n) for n in nodes}
    assert by_name["L0.all_gather"]["comm_type"][1] == pb.ALL_GATHER
    assert by_name["L0.all_gather"]["comm_size"][1] == 1024
    assert by_name["L0.reduce_scatter"]["comm_type"][1] == pb.REDUCE_SCATTER
    assert by_name["L0.reduce_scatter"]["comm_size"][1] == 2048
    assert by_name["L0.all_reduce"]["comm_size"][1] == 4096


def test_deps_are_node_ids_in_the_same_file(tmp_path):
    b = NodeTableBuilder()
    a = b.add_comp("a", duration_us=1, flops=1, tensor_bytes=1, node_id=100)
    c = b.add_comp("c", duration_us=1, flops=1, tensor_bytes=1, data_deps=[a], node_id=7)
    b.add_comp("d", duration_us=1, flops=1, tensor_bytes=1, data_deps=[c], ctrl_deps=[a], node_id=55)
    write_trace(Trace(1, [RankProgram(b.build())], {}), tmp_path / "o", "t")
    _, nodes = decode_file(tmp_path / "o" / "t.0.et")
    assert [n.id for n in nodes] == [100, 7, 55]
    assert list(nodes[1].data_deps) == [100]
    assert list(nodes[2].data_deps) == [7] and list(nodes[2].ctrl_deps) == [100]
    ids = {n.id for n in nodes}
    assert all(d in ids for n in nodes for d in [*n.data_deps, *n.ctrl_deps])


def test_encoding_equals_protobuf_serialization(written):
    """Hand-spliced bytes are exactly what et_def_pb2 serializes for the same node."""
    _, out, _ = written
    raw = (out / "step.3.et").read_bytes()
    _, nodes = decode_file(out / "step.3.et")
    from flint.chakra.wire import metadata_record, record
    expect = metadata_record() + b"".join(record(n.SerializeToString()) for n in nodes)
    assert raw == expect


def test_deterministic(tmp_path):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    write_trace(fsdp_tp_trace(), tmp_path / "b", "s")
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


def test_rank_files_differ_only_in_pg_name(written):
    _, out, _ = written
    files = dir_bytes(out)
    assert len({files[f"step.{r}.et"] for r in range(4)}) == 4  # every rank has its own (dp, tp) groups
    _, n0 = decode_file(out / "step.0.et")
    _, n3 = decode_file(out / "step.3.et")
    for a, b in zip(n0, n3, strict=True):
        pa = [x for x in a.attr if x.name == "pg_name"]
        pb_ = [x for x in b.attr if x.name == "pg_name"]
        del a.attr[len(a.attr) - len(pa):], b.attr[len(b.attr) - len(pb_):]
        assert a == b


def test_chakra_jsonizer_accepts_output(written, tmp_path):
    _, out, _ = written
    jsonizer = Path(sys.executable).parent / "chakra_jsonizer"
    res = subprocess.run([str(jsonizer), "--input_filename", str(out / "step.1.et"), "--output_filename", str(tmp_path / "j.json")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "j.json").read_text()
    assert '"version": "0.0.4"' in text and '"L1.reduce_scatter"' in text and '"COMM_COLL_NODE"' in text


# -- rejection ---------------------------------------------------------------


def _single(b: NodeTableBuilder, groups=None, world=1, **kw) -> Trace:
    t = b.build()
    return Trace(world, [RankProgram(t, **kw) for _ in range(world)], groups or {})


def test_rejects_empty_rank(tmp_path):
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    t1 = b.build()
    t0 = NodeTableBuilder().build()
    with pytest.raises(FlintError, match="rank 1 has no nodes"):
        write_trace(Trace(2, [RankProgram(t1), RankProgram(t0)], {}), tmp_path / "o", "t")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", [CollKind.REDUCE, CollKind.GATHER, CollKind.SCATTER, CollKind.BARRIER, CollKind.REDUCE_SCATTER_BLOCK])
def test_rejects_collectives_astra_sim_aborts_on(tmp_path, kind):
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    b.add_coll("bad", kind, 16, 1, data_deps=[0], node_id=42)
    with pytest.raises(FlintError, match=rf"rank 0: node 42 \('bad'\) is a {kind.name} collective"):
        write_trace(_single(b, {1: (0,)}), tmp_path / "o", "t")


def test_rejects_unknown_group_and_non_member(tmp_path):
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, 16, 0, node_id=3)
    e = np.zeros(0, dtype=np.int64)
    tr = Trace(2, [RankProgram(b.build(), group_ids=np.array([5]), peer_ranks=e)] * 2, {1: (0, 1)})
    with pytest.raises(FlintError, match="rank 0: node 3 .* comm group 5.*not in the trace's comm_groups"):
        write_trace(tr, tmp_path / "o", "t")
    t = b.build()
    tr = Trace(2, [RankProgram(t, group_ids=np.array([1]), peer_ranks=e), RankProgram(t, group_ids=np.array([1]), peer_ranks=e)], {1: (0,)})
    with pytest.raises(FlintError, match="rank 1: node 3 .*comm group 1.*rank 1 is not a member"):
        write_trace(tr, tmp_path / "o", "t")


def test_rejects_group_id_zero(tmp_path):
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    with pytest.raises(FlintError, match="integers from 1"):
        write_trace(_single(b, {0: (0,)}), tmp_path / "o", "t")


def test_rejects_dangling_dependency(tmp_path):
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    t = b.build()
    t.data_dep_ptr = np.array([0, 1])
    t.data_dep_idx = np.array([3])
    with pytest.raises(FlintError, match="depends on row 3, which is not a node of this rank's file"):
        write_trace(Trace(1, [RankProgram(t)], {}), tmp_path / "o", "t")


def test_rejects_cycle(tmp_path):
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    b.add_comp("y", duration_us=1, data_deps=[0])
    t = b.build()
    t.ctrl_dep_ptr = np.array([0, 1, 1])
    t.ctrl_dep_idx = np.array([1])
    with pytest.raises(FlintError, match="cycle"):
        write_trace(Trace(1, [RankProgram(t)], {}), tmp_path / "o", "t")


def test_rejects_send_without_peer_and_peer_out_of_world(tmp_path):
    b = NodeTableBuilder()
    b.add_send("s", 8, -1, 0, node_id=9)
    with pytest.raises(FlintError, match="node 9 .* send without a destination"):
        write_trace(_single(b), tmp_path / "o", "t")
    b = NodeTableBuilder()
    b.add_send("s", 8, 0, 0)
    e = np.zeros(0, dtype=np.int64)
    with pytest.raises(FlintError, match="bound to rank 5, outside world size 1"):
        write_trace(Trace(1, [RankProgram(b.build(), group_ids=e, peer_ranks=np.array([5]))], {}), tmp_path / "o", "t")


# -- atomicity ---------------------------------------------------------------


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = writer_mod._write_file

    def flaky(path, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(writer_mod, "_write_file", flaky)
    with pytest.raises(FlintError, match="No space left"):
        write_trace(fsdp_tp_trace(), tmp_path / "out", "step")
    assert calls["n"] >= 3
    assert list(tmp_path.iterdir()) == []  # no target, no temp directory, no partial files


def test_failure_from_validation_mid_write_leaves_nothing(tmp_path):
    trace = fsdp_tp_trace()
    trace.comm_groups = {k: v for k, v in trace.comm_groups.items() if k != max(trace.comm_groups)}
    with pytest.raises(FlintError):
        write_trace(trace, tmp_path / "out", "step")
    assert list(tmp_path.iterdir()) == []


def test_rewrite_into_existing_dir_replaces_and_drops_stale_ranks(tmp_path):
    write_trace(fsdp_tp_trace(dp=4, tp=2), tmp_path / "o", "s")
    assert len(list((tmp_path / "o").glob("s.*.et"))) == 8
    write_trace(fsdp_tp_trace(dp=2, tp=2), tmp_path / "o", "s")  # the directory is replaced as a whole
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["s.0.et", "s.1.et", "s.2.et", "s.3.et", "s.comm_groups.json"]
    write_trace(fsdp_tp_trace(dp=2, tp=2), tmp_path / "fresh", "s")
    assert dir_bytes(tmp_path / "o") == dir_bytes(tmp_path / "fresh")
    # A directory holding anything else is refused (it would be deleted), unless forced.
    (tmp_path / "o" / "keep.txt").write_text("mine")
    with pytest.raises(FlintError, match="holds other files"):
        write_trace(fsdp_tp_trace(dp=4, tp=2), tmp_path / "o", "s")
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"
    write_trace(fsdp_tp_trace(dp=4, tp=2), tmp_path / "o", "s", force=True)
    assert len(list((tmp_path / "o").glob("s.*.et"))) == 8 and not (tmp_path / "o" / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_many_ranks_share_one_body_fast(tmp_path):
    """1,024 ranks of a shared table: every file decodes and only pg_name differs between ranks."""
    trace = fsdp_tp_trace(dp=128, tp=8, layers=4)
    stats = write_trace(trace, tmp_path / "o", "s")
    assert stats.distinct_tables == 1 and stats.files == 1025
    _, n0 = decode_file(tmp_path / "o" / "s.0.et")
    _, n9 = decode_file(tmp_path / "o" / "s.1000.et")
    assert [n.name for n in n0] == [n.name for n in n9]
    g = trace.comm_groups
    for n in n9:
        if n.type == pb.COMM_COLL_NODE:
            assert 1000 in g[int(attrs(n)["pg_name"][1])]
