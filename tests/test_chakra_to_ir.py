"""Chakra trace -> chakra dialect (concrete form) -> back: flint.chakra.to_ir."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from xdsl.parser import Parser

from flint.chakra import read_trace, write_trace
from flint.chakra.to_ir import main, trace_from_concrete_ir, trace_to_ir
from flint.errors import FlintError
from flint.ir import chakra, flint_context
from flint.trace import NodeKind

from chakra_helpers import fsdp_tp_trace, pipeline_trace

DATA = Path(__file__).parent / "data" / "chakra"


def reparse(module):
    text = str(module)
    parsed = Parser(flint_context(), text).parse_module()
    parsed.verify()
    return parsed, text


def assert_same(a, b, ranks=None):
    assert a.world_size == b.world_size
    assert {int(k): tuple(v) for k, v in a.comm_groups.items()} == {int(k): tuple(v) for k, v in b.comm_groups.items()}
    for r in ranks if ranks is not None else range(a.world_size):
        ta, tb = a.ranks[r].table, b.ranks[r].table
        assert ta.names == tb.names
        for col in ("kind", "flops", "tensor_bytes", "comm_type", "comm_bytes", "comm_tag", "node_ids",
                    "data_dep_ptr", "data_dep_idx", "ctrl_dep_ptr", "ctrl_dep_idx"):
            assert np.array_equal(getattr(ta, col), getattr(tb, col)), (r, col)
        # The IR prints durations with 7 significant digits.
        assert np.allclose(ta.duration_us, tb.duration_us, rtol=1e-6, atol=0, equal_nan=True)
        assert np.array_equal(a.ranks[r].groups(), b.ranks[r].groups())
        assert np.array_equal(a.ranks[r].peers(), b.ranks[r].peers())


@pytest.mark.parametrize("fixture", ["stg", "converter"])
def test_checked_in_traces_round_trip_through_the_dialect(fixture):
    trace = read_trace(DATA / fixture)
    module = trace_to_ir(trace)
    module.verify()
    parsed, text = reparse(module)
    assert text.count("chakra.graph @rank") == trace.world_size
    assert_same(trace, trace_from_concrete_ir(parsed))


def test_stg_is_concrete_and_keeps_node_ids():
    module = trace_to_ir(read_trace(DATA / "stg"))
    text = str(module)
    assert 'chakra.coll all_reduce "tp.allreduce" group = 0 bytes = 65536' in text
    assert 'chakra.send "pp.send" peer = 1 tag = 5 bytes = 16384' in text
    assert 'chakra.recv "pp.recv" peer = 0 tag = 5' in text
    assert "flint.node_id = 10 : i64" in text
    assert "grid_axes" not in text


def test_converter_metadata_nodes_keep_their_type():
    trace = read_trace(DATA / "converter")
    text = str(trace_to_ir(trace, [0]))
    assert 'flint.node_kind = "metadata"' in text
    assert (trace.ranks[0].table.kind == NodeKind.METADATA).any()


@pytest.mark.parametrize("make", [fsdp_tp_trace, pipeline_trace])
def test_flint_written_traces_become_concrete_groups_and_peers(tmp_path, make):
    # Symbolic tables (slots) in memory resolve to concrete groups and peers; so does the same trace
    # written and read back (the files hold integer microseconds, hence two separate comparisons).
    trace = make()
    assert_same(trace, trace_from_concrete_ir(reparse(trace_to_ir(trace))[0]))
    write_trace(trace, tmp_path / "t", "s")
    read = read_trace(tmp_path / "t")
    assert_same(read, trace_from_concrete_ir(reparse(trace_to_ir(read))[0]))


def test_rank_selection_and_refusal_of_big_modules():
    trace = fsdp_tp_trace(layers=3)
    module = trace_to_ir(trace, [2, 1, 2])
    assert [g.sym_name.data for g in module.ops] == ["rank2", "rank1"]
    with pytest.raises(FlintError, match="holds graphs for 2 of 4 ranks"):
        trace_from_concrete_ir(module)
    n = len(trace.ranks[0].table)
    with pytest.raises(FlintError, match="choose ranks with --rank"):
        trace_to_ir(trace, max_ops=2 * n - 1)
    trace_to_ir(trace, [0, 3], max_ops=2 * n)
    with pytest.raises(FlintError, match="rank 7 out of range"):
        trace_to_ir(trace, [7])


def test_import_trace_command(tmp_path, capsys):
    out = tmp_path / "sub" / "stg.mlir"
    assert main([str(DATA / "stg"), "--rank", "1", "-o", str(out)]) == 0
    parsed = Parser(flint_context(), out.read_text()).parse_module()
    parsed.verify()
    graphs = [op for op in parsed.ops if isinstance(op, chakra.GraphOp)]
    assert [g.sym_name.data for g in graphs] == ["rank1"]
    assert not list(out.parent.glob("*.tmp"))
    assert main([str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.mlir")]) == 1
    err = capsys.readouterr().err
    assert "flint import-trace: error:" in err and "Traceback" not in err
    assert not (tmp_path / "x.mlir").exists()
