"""flint inspect: summary dict, table, stable JSON and the command's exit codes."""

from __future__ import annotations

import json

import numpy as np

from flint.chakra import read_trace, write_trace
from flint.chakra.inspect import format_table, main, summarize, to_json
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

from chakra_helpers import DATA, fsdp_tp_trace


def test_summary_counts_flops_and_bytes():
    s = summarize(fsdp_tp_trace(dp=2, tp=2, layers=2))
    assert s["world_size"] == 4 and s["problem_count"] == 0
    assert len(s["rank_classes"]) == 1
    c = s["rank_classes"][0]
    assert c["ranks"] == "0-3" and c["count"] == 4
    assert c["nodes"] == {"COMP": 5, "COLL": 6}
    assert c["flops"] == 2 * 2_000_000 + 2 * 4_000_000 + 1000
    assert c["collectives"] == {"ALL_GATHER": 2, "ALL_REDUCE": 2, "REDUCE_SCATTER": 2}
    assert c["collective_bytes"] == {"ALL_GATHER": 2048, "ALL_REDUCE": 8192, "REDUCE_SCATTER": 4096}
    assert s["totals"]["collective_bytes"]["ALL_REDUCE"] == 4 * 8192
    assert s["totals"]["nodes"] == 44


def test_summary_is_the_same_after_a_round_trip(tmp_path):
    trace = fsdp_tp_trace(dp=4, tp=2)
    write_trace(trace, tmp_path / "a", "s")
    a, b = summarize(trace), summarize(read_trace(tmp_path / "a"))
    # durations are whole microseconds on disk
    for s in (a, b):
        for c in s["rank_classes"]:
            c.pop("compute_us")
        s["totals"].pop("compute_us")
    assert to_json(a) == to_json(b)


def test_rank_classes_and_problems_listed():
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, 8, -1)
    t0 = b.build()
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1, flops=5)
    t1 = b.build()
    tr = Trace(4, [RankProgram(t0), RankProgram(t1), RankProgram(t0), RankProgram(t1)], {})
    s = summarize(tr)
    assert [c["ranks"] for c in s["rank_classes"]] == ["0,2", "1,3"]
    assert s["problem_count"] == 2 and {p["rank"] for p in s["problems"]} == {1, 3}
    text = format_table(s)
    assert "checks: 2 problem(s)" in text and "rank 1" in text


def test_json_is_stable_golden():
    got = to_json(summarize(read_trace(DATA / "stg")))
    assert got == (DATA / "stg.inspect.json").read_text()
    assert json.loads(got)["rank_classes"][0]["send_bytes"] == 16384


def test_table_mentions_converter_collectives():
    text = format_table(summarize(read_trace(DATA / "converter")))
    assert "named after c10d/gloo/nccl collectives" in text
    assert "checks: OK" in text


def test_main_json_and_exit_codes(tmp_path, capsys):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    assert main([str(tmp_path / "a"), "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["world_size"] == 4
    assert main([str(tmp_path / "a")]) == 0
    assert "world size 4" in capsys.readouterr().out


def test_main_reports_problems_with_status_1(tmp_path, capsys):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    # Rank 3's file from another trace whose collectives are in a different order.
    b = NodeTableBuilder()
    b.add_comp("x", duration_us=1)
    write_trace(Trace(4, [RankProgram(b.build())] * 4, {}), tmp_path / "b", "s")
    (tmp_path / "a" / "s.3.et").write_bytes((tmp_path / "b" / "s.3.et").read_bytes())
    assert main([str(tmp_path / "a")]) == 1
    assert "problem(s)" in capsys.readouterr().out


def test_main_error_without_traceback(tmp_path, capsys):
    write_trace(fsdp_tp_trace(), tmp_path / "a", "s")
    (tmp_path / "a" / "s.1.et").unlink()
    assert main([str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flint inspect: error: ") and "s.1.et: missing rank file" in err
    assert "Traceback" not in err
