"""flint explore: space files, constraints, the results store, strategies, resumption, executors, reports.

The end-to-end tests (marked slow) share one capture cache per session: the
tiny Llama under FSDP on 8 ranks is captured once and serves every system
variant of every strategy.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flint.cost import load_network
from flint.errors import FlintError
from flint.explore.cli import explore_main
from flint.explore.report import pareto_mask
from flint.explore.space import SpaceError, load_space, point_id
from flint.explore.store import Store, StoreError

FLINT = [sys.executable, "-m", "flint.explore.cli"]

BASE = """
name = "tiny"
[workload]
model = "llama-tiny"
world_size = 8
seq_len = 64
global_batch = 16
[workload.plan]
dp_shard = -1
[system]
network = "switch"
[system.bandwidth_gbits_per_s]
switch = [100, 400]
[system.nic]
ranks = [0]
dim = "switch"
bandwidth_gbits_per_s = [400, 50]
[system.straggler]
ranks = [[1], [99]]
slowdown = 1.5
[[report.line]]
x = "system.bandwidth_gbits_per_s.switch"
series = "system.nic.bandwidth_gbits_per_s"
"""


def _write(tmp_path: Path, text: str, name: str = "space.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------ space files


def test_space_axes_and_ranges(tmp_path):
    sp = load_space(_write(tmp_path, BASE.replace('switch = [100, 400]', 'switch = { start = 100, stop = 400, step = 100 }')
                           .replace("world_size = 8", "world_size = { log2 = [4, 16] }")))
    assert sp.axis("system.bandwidth_gbits_per_s.switch").values == (100.0, 200.0, 300.0, 400.0)
    assert sp.axis("workload.world_size").values == (4, 8, 16)
    assert sp.axis("system.straggler.ranks").values == ([1], [99])
    assert sp.axis("system.nic.ranks").values == ([0],)
    assert sp.size == 4 * 3 * 2 * 2
    pts = list(sp.grid())
    assert len({point_id(p) for p in pts}) == sp.size
    assert [sp.point_at(i) for i in (0, 7, sp.size - 1)] == [pts[0], pts[7], pts[-1]]


def test_plan_axes_take_each_fields_type(tmp_path):
    """A plan axis takes its field's type (flint.plan.Plan's annotation): floats, booleans and strings, not
    integers only (gradient-norm clipping and loss parallelism were refused as 'must be an integer')."""
    text = BASE.replace("[workload.plan]\ndp_shard = -1", "[workload.plan]\ndp_shard = -1\nmax_norm = [0, 1.0]\n"
                        'loss_parallel = [false, true]\npp_p2p = "overlap"')
    sp = load_space(_write(tmp_path, text))
    assert sp.axis("workload.plan.max_norm").values == (0.0, 1.0)
    assert sp.axis("workload.plan.loss_parallel").values == (False, True)
    assert sp.axis("workload.plan.pp_p2p").values == ("overlap",)
    with pytest.raises(SpaceError, match=r"workload\.plan\.max_norm: must be a float"):
        load_space(_write(tmp_path, text.replace("max_norm = [0, 1.0]", 'max_norm = "1"')))
    with pytest.raises(SpaceError, match=r"workload\.plan\.dp_shard: must be an integer"):
        load_space(_write(tmp_path, text.replace("dp_shard = -1", "dp_shard = 1.5")))


@pytest.mark.parametrize("edit, where", [
    (("model = ", "modle = "), "workload.modle"),
    (("[workload.plan]\ndp_shard = -1", "[workload.plan]\ndp_shards = -1"), "workload.plan.dp_shards"),
    (("switch = [100, 400]", "switch = []"), "system.bandwidth_gbits_per_s.switch: empty range"),
    (("switch = [100, 400]", "switch = { start = 400, stop = 100 }"), "system.bandwidth_gbits_per_s.switch: empty range"),
    (("switch = [100, 400]", "ib = [100, 400]"), "system.bandwidth_gbits_per_s.ib: network 'switch' has no dimension 'ib'"),
    (('network = "switch"', 'network = "nope"'), "system.network: unknown network 'nope'"),
    (('model = "llama-tiny"', 'model = "llama-huge"'), "workload.model: unknown model"),
    (("slowdown = 1.5", "slowdown = 0.5"), "system.straggler.slowdown"),
    (("[system]", "[system]\nfabric = 1"), "system.fabric: unknown axis"),
    (("seq_len = 64", 'seq_len = 64\npath = ["planned", "traced"]'), "workload.path: unknown path 'traced'"),
    (("seq_len = 64", 'seq_len = 64\npasses = ["default", "no-such-pass"]'), "workload.passes"),
])
def test_bad_space_names_the_axis(tmp_path, edit, where):
    with pytest.raises(SpaceError, match=where.replace(".", r"\.").replace("(", r"\(")):
        load_space(_write(tmp_path, BASE.replace(*edit)))


def test_calibration_axis_resolves_names_and_paths_and_names_what_is_wrong(tmp_path):
    """``system.calibration``: "" (the device's own), a shipped override by name, or a TOML path taken
    from the space file's directory; every value is loaded onto every device when the space is read."""
    (tmp_path / "cals").mkdir()
    (tmp_path / "cals" / "slow.toml").write_text("sustained_fraction = 0.5\n")
    sp = load_space(_write(tmp_path, BASE.replace('network = "switch"', 'network = "switch"\n'
                                                  'calibration = ["", "fitted", "fitted/h100-sxm", "cals/slow.toml"]')))
    assert sp.axis("system.calibration").values == ("", "fitted", "fitted/h100-sxm",
                                                    str((tmp_path / "cals" / "slow.toml")))
    assert "system.calibration" not in {a.name for a in load_space(_write(tmp_path, BASE)).axes}  # optional
    (tmp_path / "cals" / "bad.toml").write_text("sustained_fraction = 1.5\n")
    for value, message in (("cals/bad.toml", r"system\.calibration: .*bad\.toml: sustained_fraction = 1\.5 is out "
                                              r"of range \(valid: 0 < sustained_fraction <= 1"),
                           ("fitted/h200", r"system\.calibration: calibration file '.*fitted/h200' does not exist"),
                           ('fitted"\ndevice = ["h100-sxm", "b200"]#', r"system\.calibration: no fitted calibration "
                                                                       r"for device 'b200'")):
        text = BASE.replace('network = "switch"', f'network = "switch"\ncalibration = "{value}"')
        with pytest.raises(SpaceError, match=message):
            load_space(_write(tmp_path, text))


HF_MODELS = Path(__file__).parent / "data" / "byom" / "hf_models.py"  # defines example_inputs() (the CNN's)

LLAMA_FILE = """
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def mistral():  # a sliding window shorter than the tests' 32 tokens
    return MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=128, sliding_window=16))
"""


def test_model_files_resolve_from_the_space_file_and_are_checked(tmp_path):
    """A model file in a space is taken relative to the space file, checked to define its factory, and its
    content is part of the program's key (an edited file is a new program); zoo-only settings, and batch
    axes for a file whose example_inputs() fixes the batch, are refused."""
    from flint.explore.stages import Workload

    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "m.py"
    model.write_text(LLAMA_FILE)
    sp = load_space(_write(tmp_path, BASE.replace('model = "llama-tiny"', 'model = "models/m.py:llama"')))
    assert sp.axis("workload.model").values == (f"{model.resolve()}:llama",)
    point = next(iter(sp.grid()))
    w = Workload.of(point)
    assert w.single_inputs()["model_sha256"] == w.capture_inputs()["model_sha256"] != ""
    model.write_text(LLAMA_FILE + "\n# edited\n")
    assert Workload.of(point).single_key != w.single_key
    with pytest.raises(SpaceError, match=r"workload\.model: .*no such file .*nope\.py"):
        load_space(_write(tmp_path, BASE.replace('model = "llama-tiny"', 'model = "nope.py"')))
    with pytest.raises(SpaceError, match=r"workload\.model: .*defines no function 'model_factory'"):
        load_space(_write(tmp_path, BASE.replace('model = "llama-tiny"', 'model = "models/m.py"')))
    with pytest.raises(SpaceError, match=r"workload\.layers: applies to zoo models only"):
        load_space(_write(tmp_path, BASE.replace('model = "llama-tiny"', 'model = "models/m.py:llama"\nlayers = 2')))
    with pytest.raises(SpaceError, match=r"workload\.global_batch: .*hf_models\.py fixes its batch with "
                                         r"example_inputs\(\)"):
        load_space(_write(tmp_path, BASE.replace('model = "llama-tiny"', f'model = "{HF_MODELS}:cnn"')))


@pytest.mark.slow
def test_explore_model_files(tmp_path, cache):
    """A Hugging Face causal LM from a model file, swept over TP on the planned path: one single-device
    capture, every plan expanded from it (no point falls back to the captured path). A CNN whose file's
    example_inputs() gives its batch (float32, so the model dtype too) runs on the planned path too (batch norm
    and pooling split over the batch; it took the captured path when they had no sharding rule)."""
    (tmp_path / "m.py").write_text(LLAMA_FILE)
    space = """
name = "hf"
[workload]
model = "m.py:llama"
world_size = 4
seq_len = 32
[workload.plan]
dp_shard = -1
tp = [1, 2]
[system]
network = "switch"
"""
    p = _write(tmp_path, space)
    out = tmp_path / "out"
    assert explore_main([str(p), "--out", str(out), "--cache", str(cache), "--no-progress", "--no-report"]) == 0
    rows = _rows(out / "results.db")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows
    assert all(r["outputs"]["path"] == "planned" and r["outputs"]["path_note"] == "" for r in rows)
    t = {r["inputs"]["workload.plan.tp"]: r["outputs"] for r in rows}
    assert t[2]["peak_memory_bytes"] < t[1]["peak_memory_bytes"]  # TP splits the blocks' weights
    assert t[2]["exposed_comm_us"] > 0
    # cp: the capture calls SDPA as eager does (is_causal, no mask), so the planned path runs the ring
    p = _write(tmp_path, space.replace('"hf"', '"hf-cp"').replace("tp = [1, 2]", "tp = 2\ncp = 2"), "cp.toml")
    assert explore_main([str(p), "--out", str(tmp_path / "out-cp"), "--cache", str(cache), "--no-progress",
                         "--no-report"]) == 0
    (row,) = _rows(tmp_path / "out-cp" / "results.db")
    assert row["status"] == "ok" and row["outputs"]["path"] == "planned", row
    # Mistral's sliding window (16 of 32 tokens) masks its attention, as in eager: shard-expand refuses cp, and
    # the captured path has no cp; the failure names both reasons (it named the capture's only, hiding why the
    # planned path, which builds cp, did not)
    p = _write(tmp_path, space.replace('"hf"', '"window-cp"').replace('"m.py:llama"', '"m.py:mistral"')
               .replace("tp = [1, 2]", "cp = 2"), "window.toml")
    assert explore_main([str(p), "--out", str(tmp_path / "out-window"), "--cache", str(cache), "--no-progress",
                         "--no-report"]) == 0
    (row,) = _rows(tmp_path / "out-window" / "results.db")
    assert row["status"] == "error" and re.search(r"^shard-expand: plan field 'cp': .* explicit attention mask .*; "
                                                  r"then the captured path: capture: plan field 'cp': capture does not "
                                                  r"support it", row["error"]), row["error"]
    p = _write(tmp_path, f"""
name = "cnn"
[workload]
model = "{HF_MODELS}:cnn"
world_size = 2
dtype = "float32"
[workload.plan]
dp_replicate = 2
[system]
network = "switch"
""", "cnn.toml")
    out = tmp_path / "out-cnn"
    assert explore_main([str(p), "--out", str(out), "--cache", str(cache), "--no-progress", "--no-report"]) == 0
    (row,) = _rows(out / "results.db")
    assert row["status"] == "ok", row
    assert row["outputs"]["path"] == "planned" and row["outputs"]["path_note"] == "", row


def test_planned_path_refusals_name_the_plan_field():
    from flint.explore.stages import Workload

    base = {"workload.model": "llama-tiny", "workload.world_size": 8, "workload.seq_len": 64,
            "workload.global_batch": 16, "workload.plan.dp_shard": -1}
    w = Workload.of(base)
    assert w.path == "planned" and w.passes == "default" and w.planned_refusal() is None
    # planned points of one model and global shape share one single-device capture; plans differ in the program
    other = Workload.of({**base, "workload.plan.tp": 2})
    assert other.single_key == w.single_key and other.key != w.key and other.captured_key != w.captured_key
    ac = Workload.of({**base, "workload.plan.activation_checkpoint": "selective-op"})
    assert "activation_checkpoint" in ac.planned_refusal() and ac.key == ac.captured_key
    fp8 = Workload.of({**base, "workload.plan.fp8": True})
    assert "fp8" in fp8.planned_refusal() and fp8.key == fp8.captured_key
    cap = Workload.of({**base, "workload.path": "captured"})
    assert cap.key == cap.captured_key != w.key


def test_supported_counts_either_way_in():
    from flint.explore.constraints import check

    moe = {"workload.model": "moe-tiny", "workload.world_size": 8, "workload.seq_len": 64, "workload.global_batch": 16,
           "workload.plan.dp_shard": -1, "workload.plan.ep": 2, "system.device": "h100-sxm"}
    assert check(moe, {"memory_fits": True}) is None  # capture refuses ep; shard-expand builds it
    why = check({**moe, "workload.path": "captured"}, {"memory_fits": True})
    assert why is not None and why[0] == "supported" and "ep" in why[1]
    cp = {**moe, "workload.plan.ep": 1, "workload.plan.cp": 2, "workload.model": "llama-tiny"}
    assert check(cp, {}) is None  # context parallelism: shard-expand builds it, capture does not
    why = check({**cp, "workload.path": "captured"}, {})
    assert why is not None and why[0] == "supported" and "cp" in why[1]


def test_expert_count_of_any_hugging_face_config_prunes_ep():
    """A Hugging Face MoE's experts per layer, under whichever name its config gives them (Qwen2-MoE: num_experts,
    with no num_local_experts alias), bound ep before any capture; only Mixtral's num_local_experts was read, so
    ep = 8 over 4 experts went on to a capture and failed there."""
    from flint.explore.constraints import check

    point = {"workload.model": f"{HF_MODELS}:qwen2_moe", "workload.world_size": 8, "workload.seq_len": 32,
             "workload.global_batch": 8, "workload.plan.dp_shard": -1, "workload.plan.ep": 8}
    why = check(point, {})
    assert why == ("degrees_divide", "plan field 'ep': 8 does not divide the model's 4 experts"), why


def test_unknown_axis_on_the_command_line(tmp_path, capsys):
    p = _write(tmp_path, BASE.replace("seq_len", "seqlen"))
    assert explore_main([str(p), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "workload.seqlen" in err and "did you mean seq_len" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "results.db").exists()


@pytest.mark.parametrize("edit, constraint", [
    (("[system]", "[constraints]\nmax_gpus = 4\n[system]"), "max_gpus"),
    (("dp_shard = -1", "dp_shard = -1\ntp = 3"), "degrees_divide"),
    (("[workload.plan]\ndp_shard = -1", 'path = "captured"\n[workload.plan]\ndp_shard = -1\ncp = 2'), "supported"),
    (('model = "llama-tiny"', 'model = "llama3-405b"'), "memory_fits"),
])
def test_constraints_excluding_every_point(tmp_path, capsys, edit, constraint):
    p = _write(tmp_path, BASE.replace(*edit))
    assert explore_main([str(p), "--out", str(tmp_path / "o"), "--cache", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "exclude every point" in err and f"constraint '{constraint}' removed 8" in err
    assert not (tmp_path / "c").exists()  # nothing was captured


# ------------------------------------------------------------------ the store


def test_foreign_and_corrupt_databases_are_refused_untouched(tmp_path):
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE accounts (id INTEGER)")
    con.commit()
    con.close()
    text = tmp_path / "notes.db"
    text.write_text("my notes, not a database\n")
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"SQLite format 3\x00" + b"\xff" * 3000)
    for path, why in ((foreign, "something else"), (text, "not a SQLite database"), (corrupt, "damaged")):
        before = path.read_bytes()
        with pytest.raises(StoreError, match=why):
            Store(path)
        assert path.read_bytes() == before


def test_store_round_trip(tmp_path):
    s = Store(tmp_path / "r.db")
    run = s.start_run("x", "h", "grid", {})
    s.put_result("a", {"k": 1}, {"status": "ok", "outputs": {"iteration_time_us": 5.0, "gpus": 8,
                                                               "peak_memory_bytes": 10}, "capture_hit": True}, "h", run)
    s.put_pruned([("b", {"k": 2}, "max_gpus", "too many")], "h", run)
    s.close()
    s = Store(tmp_path / "r.db")  # reopened: recognized as ours
    assert s.known(["a", "b", "c"]) == {"a", "b"}
    assert s.get("a")["outputs"]["iteration_time_us"] == 5.0 and s.get("b")["constraint_name"] == "max_gpus"
    assert s.evaluation_counts() == {"a": 1}


# ------------------------------------------------------------------ pareto, network


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=30))
@settings(max_examples=60)
def test_pareto_front_is_non_dominated_and_covers(values):
    mask = pareto_mask(values)
    front = [v for v, m in zip(values, mask) if m]
    dom = lambda a, b: all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))  # noqa: E731
    assert front
    assert not any(dom(a, b) for a in values for b in front)
    assert all(any(dom(f, v) for f in front) for v, m in zip(values, mask) if not m)


def test_degraded_nic_slows_only_groups_through_it():
    net = load_network("dgx-h100").for_world(16)
    slow = net.with_nics([0], "ib", 12.5)
    pair_with_0 = slow.group_levels([0, 8])
    pair_without = slow.group_levels([1, 9])
    assert pair_with_0[0][0].bandwidth_gbytes_per_s == 12.5
    assert pair_without[0][0].bandwidth_gbytes_per_s == net.group_levels([1, 9])[0][0].bandwidth_gbytes_per_s == 50.0
    assert slow.group_levels([0, 1])[0][0].bandwidth_gbytes_per_s == 450.0  # NVLink is not the NIC
    assert slow.p2p_time_us(0, 8, 1e6) > net.p2p_time_us(0, 8, 1e6) == slow.p2p_time_us(1, 9, 1e6)
    with pytest.raises(FlintError, match="no dimension 'eth'"):
        net.with_nics([0], "eth", 1.0)


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("explore-cache")


def _rows(db: Path) -> list[dict]:
    s = Store(db)
    try:
        return list(s.rows())
    finally:
        s.close()


def _evaluations(db: Path) -> dict[str, int]:
    s = Store(db)
    try:
        return s.evaluation_counts()
    finally:
        s.close()


@pytest.mark.slow
def test_grid_end_to_end_with_failing_points_reports_and_rerun(tmp_path, cache, capsys):
    import pandas as pd

    p = _write(tmp_path, BASE)
    out = tmp_path / "out"
    assert explore_main([str(p), "--out", str(out), "--cache", str(cache), "--no-progress"]) == 0
    rows = _rows(out / "results.db")
    assert len(rows) == 8
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in rows if r["status"] == "error"]
    assert len(ok) == 4 and len(bad) == 4  # rank 99 is outside the 8-rank world: recorded, the sweep goes on
    assert all("system.straggler.ranks: rank 99" in r["error"] for r in bad)
    for r in ok:
        o = r["outputs"]
        assert o["gpus"] == 8 and o["iteration_time_us"] > 0 and o["peak_memory_bytes"] > 0 and o["fits"]
    # physics: a slower fabric, or a slower NIC on rank 0, never makes the step faster
    t = {(r["inputs"]["system.bandwidth_gbits_per_s.switch"], r["inputs"]["system.nic.bandwidth_gbits_per_s"]):
         r["outputs"]["iteration_time_us"] for r in ok}
    assert t[(100.0, 400.0)] > t[(400.0, 400.0)]
    assert t[(400.0, 50.0)] > t[(400.0, 400.0)] and t[(100.0, 50.0)] > t[(100.0, 400.0)]
    # reports
    for name in ("points.csv", "points.parquet", "summary.md", "summary.html", "pareto.png", "breakdown.png",
                 "memory.png", "line-bandwidth_gbits_per_s-switch.png"):
        assert (out / name).stat().st_size > 0, name
    df = pd.read_parquet(out / "points.parquet")
    assert len(df) == 8 and set(df["status"]) == {"ok", "error"}
    front = df[df["pareto"]]
    okdf = df[df["status"] == "ok"]
    for _, f in front.iterrows():
        for _, o in okdf.iterrows():
            better = [o[c] <= f[c] for c in ("iteration_time_us", "peak_memory_bytes", "gpus")]
            strictly = [o[c] < f[c] for c in ("iteration_time_us", "peak_memory_bytes", "gpus")]
            assert not (all(better) and any(strictly))
    assert "Pareto front" in (out / "summary.md").read_text()
    # a repeated run evaluates nothing
    capsys.readouterr()
    assert explore_main([str(p), "--out", str(out), "--cache", str(cache), "--no-progress"]) == 0
    assert "evaluated 0 now" in capsys.readouterr().out
    assert set(_evaluations(out / "results.db").values()) == {1}


@pytest.mark.slow
def test_random_and_optuna_share_the_store(tmp_path, cache, capsys):
    import optuna

    p = _write(tmp_path, BASE)
    db = tmp_path / "r.db"
    assert explore_main([str(p), "--db", str(db), "--out", str(tmp_path / "o1"), "--cache", str(cache),
                         "--strategy", "random", "--samples", "3", "--no-progress"]) == 0
    assert len(_rows(db)) == 3
    assert explore_main([str(p), "--db", str(db), "--out", str(tmp_path / "o2"), "--cache", str(cache),
                         "--strategy", "optuna", "--samples", "5", "--seed", "1", "--no-progress"]) == 0
    rows = _rows(db)
    assert 5 <= len(rows) <= 8
    assert set(_evaluations(db).values()) == {1}  # points random already ran were not evaluated again
    (study_summary,) = optuna.get_all_study_summaries(storage=f"sqlite:///{db.resolve()}")
    study = optuna.load_study(study_name=study_summary.study_name, storage=f"sqlite:///{db.resolve()}")
    pids = {t.user_attrs["point_id"] for t in study.trials}
    assert len(pids) == 5 and pids <= {r["point_id"] for r in rows}
    assert len(study.directions) == 3
    # every trial the study completed carries the stored objectives
    by = {r["point_id"]: r for r in rows}
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE:
            o = by[t.user_attrs["point_id"]]["outputs"]
            assert t.values == [o["iteration_time_us"], o["peak_memory_bytes"], o["gpus"]]
    df = __import__("pandas").read_csv(tmp_path / "o2" / "points.csv")
    assert len(df) == 5


@pytest.mark.slow
def test_kill_mid_run_then_resume_evaluates_no_point_twice(tmp_path, cache):
    # 400 system variants of the cached program: points are stored one by one for several seconds,
    # so the kill lands with some stored and most not
    text = BASE.replace("switch = [100, 400]", "switch = { start = 50, stop = 249, step = 1 }") \
        .replace("ranks = [[1], [99]]", "ranks = [1]")
    p = _write(tmp_path, text)
    out = tmp_path / "out"
    db = out / "results.db"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*FLINT, str(p), "--out", str(out), "--cache", str(cache), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if db.exists():
                try:
                    n = sqlite3.connect(db).execute("SELECT COUNT(*) FROM points WHERE status='ok'").fetchone()[0]
                except sqlite3.Error:
                    n = 0
                if n >= 1:
                    break
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run finished before it could be interrupted"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    before = _evaluations(db)
    assert 1 <= len(before) < 400
    res = subprocess.run([*FLINT, str(p), "--out", str(out), "--cache", str(cache), "--no-progress"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert f"reused {len(before)} stored" in res.stdout
    after = _evaluations(db)
    assert len(after) == 400 and set(after.values()) == {1}
    assert all(r["status"] == "ok" for r in _rows(db))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_ray_executor_on_a_local_loopback_cluster(tmp_path, cache):
    """A one-CPU Ray head on loopback, started by this test in its own process group and ended by it."""
    import shutil
    import tempfile

    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).with_name("ray")
    p = _write(tmp_path, BASE.replace("ranks = [[1], [99]]", "ranks = [1]").replace("bandwidth_gbits_per_s = [400, 50]",
                                                                                 "bandwidth_gbits_per_s = 400"))
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # a private loopback test cluster: no token
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                             f"--port={port}", "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}",
                             "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        res = subprocess.run([*FLINT, str(p), "--out", str(tmp_path / "o"), "--cache", str(cache), "--no-progress",
                              "--executor", "ray", "--address", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=600, env=env)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert res.returncode == 0, res.stderr
    assert "evaluated 2 now" in res.stdout
    rows = _rows(tmp_path / "o" / "results.db")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)


def test_ray_needs_an_address(tmp_path, capsys):
    p = _write(tmp_path, BASE)
    assert explore_main([str(p), "--out", str(tmp_path / "o"), "--executor", "ray", "--cache", str(tmp_path)]) == 1
    assert "--address" in capsys.readouterr().err


@pytest.mark.slow
def test_process_pool_and_limit_then_resume(tmp_path, cache, capsys):
    p = _write(tmp_path, BASE)
    out = tmp_path / "out"
    args = [str(p), "--out", str(out), "--cache", str(cache), "--no-progress", "--jobs", "2"]
    assert explore_main([*args, "--limit", "3"]) == 0
    assert "stopped at --limit" in capsys.readouterr().out
    assert len(_rows(out / "results.db")) == 3
    assert explore_main(args) == 0
    assert "reused 3 stored" in capsys.readouterr().out
    counts = _evaluations(out / "results.db")
    assert len(counts) == 8 and set(counts.values()) == {1}


@pytest.mark.slow
def test_explore_estimate_equals_flint_estimate(tmp_path, cache, capsys):
    """One point, both paths, default and no passes: explore's iteration time is `flint estimate`'s."""
    from flint.explore.cache import CaptureCache
    from flint.explore.stages import Workload
    from flint.tools.flint_cli import main

    text = BASE.split("[system]")[0].replace("[workload.plan]", 'passes = ["default", ""]\n'
                                              'path = ["planned", "captured"]\n[workload.plan]')
    text += '[system]\nnetwork = "switch"\n'
    p = _write(tmp_path, text)
    out = tmp_path / "out"
    assert explore_main([str(p), "--out", str(out), "--cache", str(cache), "--no-progress", "--no-report"]) == 0
    rows = {(r["inputs"]["workload.path"], r["inputs"]["workload.passes"]): r for r in _rows(out / "results.db")}
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows.values()), rows
    assert all(r["outputs"]["path"] == path and r["outputs"]["path_note"] == "" for (path, _), r in rows.items())
    assert rows[("planned", "default")]["outputs"]["passes_run"] == \
        "reorder-all-gather{prefetch=1},sink-waits,assign-streams"
    w = Workload.of(rows[("planned", "")]["inputs"])
    caches = CaptureCache(cache)
    single = tmp_path / "single.mlir"
    single.write_text(caches.get(w.single_key))
    captured = tmp_path / "captured.mlir"
    captured.write_text(caches.get(w.captured_key))
    (tmp_path / "plan.toml").write_text("dp_shard = 8\n")
    expanded = tmp_path / "expanded.mlir"
    assert main(["expand", str(single), str(tmp_path / "plan.toml"), "-o", str(expanded)]) == 0
    capsys.readouterr()
    for path, ir in (("planned", expanded), ("captured", captured)):
        for passes, flag in (("default", []), ("", ["--passes", ""])):
            assert main(["estimate", str(ir), "--device", "h100-sxm", "--network", "switch", "--json", *flag]) == 0
            rep = json.loads(capsys.readouterr().out)
            o = rows[(path, passes)]["outputs"]
            assert o["iteration_time_us"] == pytest.approx(rep["iteration_time_us"], rel=1e-12), (path, passes)
            assert o["passes_run"] == rep["passes"]
            assert o["peak_memory_bytes"] == rep["peak_memory"]["peak_bytes"]
    # the default pipeline overlaps the FSDP gathers the captured order exposes
    for path in ("planned", "captured"):
        assert rows[(path, "default")]["outputs"]["exposed_comm_us"] < rows[(path, "")]["outputs"]["exposed_comm_us"]
    # a calibration axis: each point lowered on its calibrated device, as `flint estimate --calibration`
    text = BASE.split("[system]")[0] + '[system]\nnetwork = "switch"\ncalibration = ["", "fitted/h100-sxm"]\n'
    out = tmp_path / "out-cal"
    assert explore_main([_write(tmp_path, text, "cal.toml").as_posix(), "--out", str(out), "--cache", str(cache),
                         "--no-progress", "--no-report"]) == 0
    capsys.readouterr()
    cal = {r["inputs"]["system.calibration"]: r["outputs"] for r in _rows(out / "results.db")}
    assert cal[""]["iteration_time_us"] == rows[("planned", "default")]["outputs"]["iteration_time_us"]
    assert main(["estimate", str(expanded), "--network", "switch", "--json", "--calibration", "fitted/h100-sxm"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert cal["fitted/h100-sxm"]["iteration_time_us"] == pytest.approx(rep["iteration_time_us"], rel=1e-12)
    assert cal["fitted/h100-sxm"]["iteration_time_us"] > cal[""]["iteration_time_us"]
    # a plan expansion refuses: the point takes the captured path and says why (the capture is cached by now)
    from flint.explore import stages

    def refuse(single, plan):
        raise FlintError("no sharding rule for 'aten.my_op.default' at model.py:1:0")

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(stages, "expand_stage", refuse)
    try:
        res = stages.Evaluator(str(cache)).evaluate(rows[("planned", "")]["inputs"])
    finally:
        monkeypatch.undo()
    assert res["status"] == "ok" and res["outputs"]["path"] == "captured"
    assert res["outputs"]["path_note"] == "shard-expand: no sharding rule for 'aten.my_op.default' at model.py:1:0"
    assert res["outputs"]["iteration_time_us"] == rows[("captured", "")]["outputs"]["iteration_time_us"]


def test_summary_names_why_points_were_pruned_and_what_mfu_counts(tmp_path):
    """A sweep over activation checkpointing modes: the points pairing ac_every with another mode are pruned
    (counted under degrees_divide, the plan's own validation), and the summary says why; its mfu legend says
    that recompute counts as work."""
    from collections import Counter

    from flint.explore.report import dataframe, summary_markdown
    from flint.explore.runner import RunSummary

    space = load_space(_write(tmp_path, BASE))
    rows = [{"point_id": "a", "inputs": {"workload.plan.activation_checkpoint": "full"}, "status": "pruned",
             "constraint_name": "degrees_divide",
             "error": "plan field 'ac_every': applies only to activation_checkpoint = \"selective-layer\""},
            {"point_id": "b", "inputs": {"workload.plan.activation_checkpoint": "none"}, "status": "ok",
             "outputs": {"iteration_time_us": 10.0, "exposed_comm_us": 1.0, "mfu": 0.3, "peak_memory_bytes": 2**30,
                         "fits": True, "gpus": 8}}]
    md = summary_markdown(dataframe(rows, space), space,
                          RunSummary("grid", ["a", "b"], evaluated=1, pruned=Counter({"degrees_divide": 1})))
    assert ("| `degrees_divide` | 1 | plan field 'ac_every': applies only to activation_checkpoint = "
            "\"selective-layer\" |") in md
    assert "`mfu` counts the FLOPs the step runs, activation checkpointing's recompute included" in md


def test_a_line_without_series_plots_without_a_legend_warning(tmp_path):
    """A report line whose x is the only varied axis is one unlabelled line: matplotlib warned "No artists with
    labels found to put in legend" on every such run (flint explore over ep alone)."""
    import warnings

    from flint.explore.report import _plots, dataframe

    space = load_space(_write(tmp_path, BASE.replace('series = "system.nic.bandwidth_gbits_per_s"\n', "")))
    rows = [{"point_id": str(bw), "inputs": {"system.bandwidth_gbits_per_s.switch": bw}, "status": "ok",
             "outputs": {"iteration_time_us": 1e5 / bw, "exposed_comm_us": 1.0, "mfu": 0.3,
                         "peak_memory_bytes": 2**30, "mem_params_bytes": 2**29, "fits": True, "gpus": 8}}
            for bw in (100, 400)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = _plots(dataframe(rows, space), space, tmp_path)
    assert (tmp_path / "line-bandwidth_gbits_per_s-switch.png") in paths
