"""flint.validate: executed-op classification rules, counting, failure handling, real runs vs Flint."""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from pathlib import Path

import pytest
import torch

from flint.capture import classify_aten
from flint.validate.classify import (C10D_TO_FUNCTIONAL, collective_input_bytes, executed_class, executed_target,
                                     innermost_of_class)
from flint.validate.cli import HF_CASES, cases, main
from flint.validate.compare import Case
from flint.validate.executed import count_host_trace
from flint.validate.expected import base_op, explain
from flint.validate.realrun import RealRunError, RunSpec, free_port, run_real

AG_SCHEMA = ("c10d::_allgather_base_(Tensor output_tensor, Tensor input_tensor, "
             "__torch__.torch.classes.c10d.ProcessGroup process_group, bool async_op=True, int timeout=-1) "
             "-> (Tensor, __torch__.torch.classes.c10d.Work)")
AR_SCHEMA = ("c10d::allreduce_(Tensor[] tensors, __torch__.torch.classes.c10d.ProcessGroup process_group, "
             "__torch__.torch.classes.c10d.ReduceOp reduce_op, Tensor? sparse_indices, bool async_op=True, "
             "int timeout=-1) -> (Tensor[], __torch__.torch.classes.c10d.Work)")


# ------------------------------------------------------------ classification


def test_executed_names_map_to_aten_targets_then_classify_aten():
    aten = torch.ops.aten
    assert executed_target("aten::add", "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor") \
        is aten.add.Tensor
    assert executed_target("aten::mm", "aten::mm(Tensor self, Tensor mat2) -> Tensor") is aten.mm.default
    table = {
        ("aten::mm", ""): "gemm", ("aten::addmm", ""): "gemm", ("aten::linear", ""): "gemm",
        ("aten::_scaled_dot_product_flash_attention_for_cpu", ""): "attention",
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", ""): "attention",
        ("aten::mul", "aten::mul.Tensor(Tensor self, Tensor other) -> Tensor"): "elementwise",
        ("aten::lerp_", "aten::lerp_.Scalar(Tensor(a!) self, Tensor end, Scalar weight) -> Tensor(a!)"): "elementwise",
        ("aten::sum", "aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim=False, *, "
                      "ScalarType? dtype=None) -> Tensor"): "reduction",
        ("aten::_log_softmax", ""): "reduction",
        ("aten::view", ""): "view", ("aten::copy_", ""): "memory",
        ("c10d::allreduce_", AR_SCHEMA): "all_reduce", ("c10d::_allgather_base_", AG_SCHEMA): "all_gather",
        ("c10d::_reduce_scatter_base_", ""): "reduce_scatter", ("c10d::alltoall_base_", ""): "all_to_all",
        ("_c10d_functional::all_reduce", ""): "all_reduce", ("_c10d_functional::wait_tensor", ""): "wait",
        # no class: backend records inside a c10d op, autograd nodes, labels, synchronization
        ("gloo:all_reduce", ""): "other", ("gloo:all_gather", ""): "other", ("MmBackward0", ""): "other",
        ("autograd::engine::evaluate_function: MmBackward0", ""): "other", ("FSDP::all_gather (embed)", ""): "other",
        ("Optimizer.step#AdamW.step", ""): "other", ("c10d::barrier", ""): "other",
        ("aten::no_such_op", ""): "other", ("[pytorch|profiler|execution_trace|thread]", ""): "other",
    }
    for (name, schema), cls in table.items():
        assert executed_class(name, schema) == cls, name


def test_every_c10d_mapping_is_a_functional_collective():
    for c10d, fn in C10D_TO_FUNCTIONAL.items():
        assert hasattr(torch.ops.c10d, c10d), c10d
        target = executed_target(f"c10d::{c10d}")
        assert classify_aten(target) in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                         "send", "recv"), c10d


def test_innermost_of_class_counts_each_chain_once():
    # linear -> [t, matmul -> mm]; DTensor add -> add (local); mean -> [sum, div_]
    classes = ["gemm", "view", "gemm", "gemm", "elementwise", "elementwise", "reduction", "reduction", "elementwise"]
    parents = [-1, 0, 0, 2, -1, 4, -1, 6, 6]
    assert innermost_of_class(classes, parents) == [False, True, False, True, False, True, False, True, True]
    assert innermost_of_class(["other", "gemm"], [-1, 0]) == [False, True]


def test_collective_input_bytes_from_schema_and_et_inputs():
    # _allgather_base_(output, input): the input is the second argument
    assert collective_input_bytes(AG_SCHEMA, [[262144], [131072], [], [], []],
                                  ["Tensor(float)", "Tensor(float)", "Object", "Bool", "Int"]) == 131072 * 4
    # allreduce_(Tensor[] tensors): a list, bf16; chakra_converter stores the lists as str()
    assert collective_input_bytes(AR_SCHEMA, str([[[4, 8], [2]], [], [], [], [], []]),
                                  str(["GenericList[Tensor(c10::BFloat16),Tensor(c10::BFloat16)]", "Object",
                                       "Object", "None", "Bool", "Int"])) == (32 + 2) * 2
    fn = "_c10d_functional::all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor"
    assert collective_input_bytes(fn, [[3, 5], [], []], ["Tensor(double)", "String", "String"]) == 15 * 8
    with pytest.raises(ValueError, match="unknown tensor element type"):
        collective_input_bytes(fn, [[3]], ["Tensor(mystery)"])


def _node(i, name, parent, schema="", shapes=(), types=()):
    return {"id": i, "name": name, "ctrl_deps": parent, "inputs": {"shapes": list(shapes), "types": list(types)},
            "attrs": [{"name": "op_schema", "type": "string", "value": schema}]}


def test_count_host_trace_phases_nesting_bytes(tmp_path):
    nodes = [
        _node(1, "[pytorch|profiler|execution_trace|thread]", 0),
        _node(2, "FSDP::all_gather (layers.0)", 1),
        _node(3, "c10d::_allgather_base_", 2, AG_SCHEMA, [[8], [4], [], [], []],
              ["Tensor(float)", "Tensor(float)", "Object", "Bool", "Int"]),
        _node(4, "gloo:all_gather", 3),
        _node(5, "aten::linear", 1), _node(6, "aten::t", 5), _node(7, "aten::matmul", 5), _node(8, "aten::mm", 7),
        _node(9, "aten::view", 10),  # a "caller" recorded later (gloo worker thread): no nesting
        _node(10, "c10d::allreduce_", 1, AR_SCHEMA, [[[2, 2]], [], [], [], [], []],
              ["GenericList[Tensor(float)]", "Object", "Object", "None", "Bool", "Int"]),
        _node(11, "autograd::engine::evaluate_function: MmBackward0", 1),
        _node(12, "MmBackward0", 11), _node(13, "aten::mm", 12), _node(14, "aten::mm", 12),
        _node(15, "Optimizer.step#AdamW.step", 1), _node(16, "aten::lerp_", 15),
    ]
    path = tmp_path / "host.0.json"
    path.write_text(json.dumps({"schema": "1.1.1-chakra.0.0.4", "nodes": nodes}))
    rc = count_host_trace(path, 0)
    assert rc.classes == Counter({"gemm": 3, "all_gather": 1, "all_reduce": 1, "view": 2, "elementwise": 1})
    assert rc.collectives == Counter({("all_gather", "fwd"): 1, ("all_reduce", "fwd"): 1})
    assert rc.collective_bytes == Counter({("all_gather", "fwd"): 16, ("all_reduce", "fwd"): 16})
    assert rc.ops[("gemm", "bwd", "aten::mm")] == 2 and rc.ops[("elementwise", "optim", "aten::lerp_")] == 1
    ag, ar = rc.collective_ops
    assert ag.data_parallel and not ar.data_parallel
    assert rc.inside_collectives == {4}


def test_callers_come_from_the_profilers_intervals(tmp_path):
    """The execution trace's ctrl_deps can name the wrong caller: a real FSDP+TP gloo run under load recorded
    a DTensor aten::add and the PythonSubclass inside it both as callees of the Redistribute before them,
    so the add and the local add below it both counted (14 forward adds where every other run has 13).
    With the profiler's trace each node's caller is the innermost event of its thread holding it in time;
    a node with no enclosing event of its thread (gloo's worker) keeps the execution trace's caller."""
    ADD = "aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"
    nodes = [
        _node(1, "[pytorch|profiler|execution_trace|thread]", 0),
        _node(2, "Redistribute", 1), _node(3, "aten::clone", 2),
        _node(4, "aten::add", 2, ADD), _node(5, "PythonSubclass", 2), _node(6, "aten::add", 5, ADD),
        _node(7, "c10d::allreduce_", 1, AR_SCHEMA, [[[2, 2]], [], [], [], [], []],
              ["GenericList[Tensor(float)]", "Object", "Object", "None", "Bool", "Int"]),
        _node(8, "aten::copy_", 7),  # on gloo's worker thread
    ]
    span = {2: (0, 100, 1), 3: (10, 20, 1), 4: (150, 50, 1), 5: (160, 30, 1), 6: (170, 10, 1), 7: (300, 50, 1),
            8: (400, 5, 2)}
    for n in nodes:
        n["attrs"].append({"name": "rf_id", "type": "uint64", "value": 1000 + n["id"]})
    host, kineto = tmp_path / "host.0.json", tmp_path / "kineto.0.json"
    host.write_text(json.dumps({"schema": "1.1.1-chakra.0.0.4", "nodes": nodes}))
    kineto.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "n", "ts": ts, "dur": dur, "tid": tid, "args": {"Record function id": 1000 + i}}
        for i, (ts, dur, tid) in span.items()]}))
    assert count_host_trace(host, 0).ops[("elementwise", "fwd", "aten::add")] == 2  # ctrl_deps alone
    rc = count_host_trace(host, 0, kineto)
    assert rc.ops[("elementwise", "fwd", "aten::add")] == 1
    assert rc.durations_us[4] == 50 - 30 and rc.durations_us[2] == 100 - 20
    assert rc.inside_collectives == {8}  # the worker's copy keeps its ET caller


def test_ops_a_dispatch_mode_served_are_not_counted(tmp_path):
    """Selective AC's recompute, as PyTorch's execution trace records it: a saved mm goes into the SAC
    dispatch mode, which hands back the forward's output (callees: two detach and the mode, no mm); a
    recomputed mm runs its kernel call inside the mode. Only the latter executed."""
    nodes = [
        _node(1, "[pytorch|profiler|execution_trace|thread]", 0),
        _node(2, "autograd::engine::evaluate_function: MmBackward0", 1), _node(3, "MmBackward0", 2),
        _node(4, "aten::linear", 3), _node(5, "aten::matmul", 4),
        _node(6, "aten::mm", 5), _node(7, "aten::detach", 6), _node(8, "aten::detach", 6),
        _node(9, "PythonDispatchMode", 6),  # cached: the mode ran no mm
        _node(10, "aten::linear", 3), _node(11, "aten::matmul", 10),
        _node(12, "aten::mm", 11), _node(13, "PythonDispatchMode", 12), _node(14, "aten::mm", 13),  # recomputed
        _node(15, "aten::mm", 3),  # a gradient mm, outside any mode
    ]
    path = tmp_path / "host.0.json"
    path.write_text(json.dumps({"schema": "1.1.1-chakra.0.0.4", "nodes": nodes}))
    rc = count_host_trace(path, 0)
    assert rc.ops[("gemm", "bwd", "aten::mm")] == 2
    assert set(rc.counted) >= {14, 15} and 6 not in rc.counted and 12 not in rc.counted


def test_expected_differences_rules():
    assert base_op("aten::add_") == "aten::add" and base_op("aten::add") == "aten::add"
    assert explain("gemm", "fwd", "aten::bmm") is None  # capture keeps attention fused, as the real run
    assert explain("attention", "bwd", "aten::_scaled_dot_product_flash_attention_for_cpu_backward") is None
    assert explain("elementwise", "optim", "aten::reciprocal").key == "optimizer"
    assert explain("gemm", "fwd", "aten::mm") is None  # an mm difference is never "expected"
    assert explain("all_gather", "fwd", "_c10d_functional::all_gather_into_tensor") is None
    # eager Hugging Face's packed-sequence check is explained for Hugging Face models only; the traced mask
    # (le, bitwise_and) is no longer built, so nothing explains it
    assert explain("reduction", "fwd", "aten::cumsum", "fsdp", "hf-llama-tiny").key == "hf-packed-check"
    assert explain("reduction", "fwd", "aten::all", "fsdp", "hf-llama-tiny").key == "hf-packed-check"
    assert explain("reduction", "fwd", "aten::cumsum", "fsdp", "llama-tiny") is None
    # ... and only as many as the check runs once per forward (two sub, one each of the rest): a difference per
    # layer, or on Flint's side, is not it
    assert explain("elementwise", "fwd", "aten::sub", "fsdp", "hf-llama-tiny", more=2).key == "hf-packed-check"
    assert explain("elementwise", "fwd", "aten::sub", "fsdp", "hf-llama-tiny", more=4) is None
    assert explain("elementwise", "fwd", "aten::ne", "fsdp", "hf-llama-tiny", more=2) is None
    assert explain("reduction", "fwd", "aten::cumsum", "fsdp", "hf-llama-tiny", more=-1) is None
    assert explain("elementwise", "fwd", "aten::bitwise_and", "fsdp", "hf-llama-tiny") is None
    assert explain("reduction", "bwd", "aten::sum", "fsdp", "llama-tiny") is None
    # a recomputed forward's mean (eager: sum + div) only where activation checkpointing recomputes
    assert explain("reduction", "bwd", "aten::sum", "fsdp", "llama-tiny", ac=True).key == "recomputed-mean"


def test_cases_skip_2d_recipes_below_world_size_4():
    got = [(c.plan, c.world_size) for c in cases(["llama-tiny"], ["tp", "fsdp+tp"], [2, 4])]
    assert got == [("tp", 2), ("tp", 4), ("fsdp+tp", 4)]
    assert Case("llama-tiny", "fsdp+tp", 4).mesh() == ((2, 2), ("dp_shard", "tp"))
    assert Case("llama-tiny", "tp", 4).mesh() == ((4,), ("tp",))


def test_flint_side_capture_keeps_pytorch_warnings_quiet():
    """flint validate's own capture hides PyTorch's capture-time warnings, as flint capture does (before, the
    checkpoint note every FSDP capture triggers was printed to the validate run's output). A fresh process:
    PyTorch prints that note once per process."""
    import subprocess
    import sys

    code = ("from flint.validate.compare import Case, flint_counts\n"
            "assert flint_counts(Case('llama-tiny', 'fsdp', 2)).collectives\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "context_fn" not in run.stderr and "W1" not in run.stderr, run.stderr


def test_a_named_hugging_face_model_runs_every_selected_plan():
    """Before, a Hugging Face model named with --models ran only its HF_CASES entries: hf-qwen3-tiny under fsdp
    and tp+sp at 2 ranks was "no case to run (2-D recipes need world size 4)", for two 1-D recipes."""
    from flint.validate.cli import DEFAULT_MODELS, hf_cases

    got = [(c.model, c.plan, c.world_size) for c in hf_cases(["hf-qwen3-tiny", "llama-tiny"], ["fsdp", "tp+sp"], [2])]
    assert got == [("hf-qwen3-tiny", "fsdp", 2), ("hf-qwen3-tiny", "tp+sp", 2)]
    assert [(c.model, c.plan, c.world_size) for c in hf_cases(list(DEFAULT_MODELS), ["fsdp+tp"], [4])] == \
        [c for c in HF_CASES if c[1:] == ("fsdp+tp", 4)]


@pytest.mark.parametrize("argv,message", [
    (["--plans", "zero3"], "unknown recipe 'zero3'"),
    (["--models", "llama-huge"], "unknown model 'llama-huge'"),
    (["--world-sizes", "1"], "at least 2"),
    (["--world-sizes", "two"], "must be integers"),
    (["--plans", "fsdp+tp", "--world-sizes", "2"], "no case to run for --plans fsdp+tp at --world-sizes 2"),
    # --memory ended with status 1 and no word in these two cases
    (["--memory", "--plans", "fsdp+tp", "--world-sizes", "2"], "no case to run for --plans fsdp+tp"),
    (["--memory", "--models", "hf-qwen3-tiny"], "--models hf-qwen3-tiny: --memory compares zoo models only"),
    (["--models", "hf-nosuch"], "Hugging Face: hf-llama-tiny, hf-gpt2-tiny"),
    (["--memory", "--ac", "sometimes"], "--ac: unknown mode 'sometimes'"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "v.md")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "v.md").exists()


def test_collective_notes_are_specific():
    from flint.validate.expected import explain_collective

    assert explain_collective("all_reduce", "optim", "tp+sp").key == "dtensor-partial-grad"
    assert explain_collective("all_reduce", "optim", "fsdp+tp+sp").key == "dtensor-partial-grad"
    assert explain_collective("all_reduce", "optim", "tp") is None
    assert explain_collective("all_gather", "fwd", "tp+sp") is None


def _fake_result(case, executed_ar=4, bytes_per_ar=100):
    from flint.validate.compare import FlintCounts, compare
    from flint.validate.executed import RankCounts
    from flint.validate.run import CaseResult

    # a multi-tensor difference (Flint's per-part optimizer) is not a collective one
    lerp = ("multi-tensor", "optim", "aten::_foreach_lerp_")
    flint = FlintCounts(Counter({"gemm": 6, "elementwise": 10, "multi-tensor": 4, "all_reduce": 4}),
                        Counter({("all_reduce", "bwd"): 4}), Counter({("all_reduce", "bwd"): 400}),
                        Counter({("gemm", "fwd", "aten::mm"): 6, ("elementwise", "optim", "aten::mul"): 10, lerp: 4}))
    ranks = [RankCounts(r, Counter({"gemm": 6, "elementwise": 8, "multi-tensor": 1, "all_reduce": executed_ar}),
                        Counter({("all_reduce", "bwd"): executed_ar}),
                        Counter({("all_reduce", "bwd"): bytes_per_ar * executed_ar}),
                        Counter({("gemm", "fwd", "aten::mm"): 6, ("elementwise", "optim", "aten::mul"): 8, lerp: 1}))
             for r in range(case.world_size)]
    return CaseResult(case, flint, ranks, compare(flint, ranks), simulated_us=10.0, measured_step_us=20.0)


def test_cli_writes_report_and_chart_and_lists_failed_cases(tmp_path, monkeypatch, capsys):
    import flint.validate.run as run_mod

    def fake_validate(case, **kw):
        if case.plan == "fsdp":
            raise RealRunError("real run fsdp at world size 2: rank 1 failed: RuntimeError: boom", {1: "boom"})
        return _fake_result(case, executed_ar=3 if case.plan == "tp" else 4,
                            bytes_per_ar=125 if case.plan == "tp+sp" else 100)

    monkeypatch.setattr(run_mod, "validate_case", fake_validate)
    out, chart = tmp_path / "docs" / "v.md", tmp_path / "docs" / "v.png"
    code = main(["--models", "gpt2-tiny", "--plans", "dp,fsdp,tp,tp+sp", "--world-sizes", "2", "--out", str(out),
                 "--chart", str(chart)])
    printed = capsys.readouterr()
    assert code == 1 and "rank 1 failed: RuntimeError: boom" in printed.err
    assert "gpt2-tiny dp w2: collectives match (" in printed.out
    assert "gpt2-tiny tp w2: collectives DIFFER (" in printed.out
    assert "gpt2-tiny tp+sp w2: collectives counts match, bytes DIFFER (" in printed.out
    text = out.read_text()
    assert "Regenerate this page and its chart with one command: `flint validate`" in text
    assert "| gpt2-tiny dp w2 | 6/6 (1.00) |" in text and "![" in text and chart.stat().st_size > 0
    assert "## Failed cases" in text and "gpt2-tiny fsdp w2: real run fsdp" in text
    assert "gpt2-tiny tp w2, all-reduce: Flint 4 vs executed 3" in text and "**unexplained**" in text
    assert "| elementwise | optim | `aten::mul` | 10 | 8 | optimizer |" in text
    assert "| multi-tensor | optim | `aten::_foreach_lerp` | 4 | 1 | per-part-optimizer |" in text


# ------------------------------------------------------------ failure path


def _workers_alive(marker: str) -> list[int]:
    alive = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "flint.validate.worker" in cmd and marker in cmd:
                alive.append(int(pid))
    return alive


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_rank_crash_is_reported_with_rank_and_cleaned_up(tmp_path):
    with pytest.raises(RealRunError, match=r"rank 1 failed: RuntimeError: injected failure on rank 1") as info:
        run_real(RunSpec("gpt2-tiny", "dp", 2, (4, 64), fail_ranks=(1,), timeout_s=60), tmp_path)
    assert set(info.value.failures) == {1}
    assert list(tmp_path.iterdir()) == []  # run directory removed
    assert _workers_alive(str(tmp_path)) == []  # rank 0 (waiting for rank 1) was killed


def test_a_rank_s_flint_error_is_reported_whole(tmp_path):
    """A Flint error raised in a rank (OLMo 2 has no sequence-parallel plan) is reported with its message and where
    it points; the report took the traceback's last line, "at .../modeling_olmo2.py:411", which said nothing."""
    with pytest.raises(RealRunError, match=r"rank 0 failed: \S*CaptureError: sp: sequence parallelism of "
                                           r"Olmo2ForCausalLM: .* at \S*modeling_olmo2\.py:\d+;"):
        run_real(RunSpec("hf-olmo2-tiny", "tp+sp", 2, (4, 64), timeout_s=60), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_port_in_use_is_reported_and_cleaned_up(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RealRunError, match=r"rank 0 failed: .*address already in use"):
            run_real(RunSpec("gpt2-tiny", "dp", 2, (4, 64), port=port, timeout_s=60), tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert _workers_alive(str(tmp_path)) == []


def test_timeout_is_reported_and_cleaned_up(tmp_path):
    # a whole run takes over 10 s; stopped after 2 s, every rank is reported and killed
    with pytest.raises(RealRunError, match=r"rank 0 failed: timed out after 2 s; rank 1 failed: timed out"):
        run_real(RunSpec("gpt2-tiny", "dp", 2, (4, 64), timeout_s=2), tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert _workers_alive(str(tmp_path)) == []


# ------------------------------------------------- real runs vs Flint (slow)

#: one case per supported parallelism; world size 4 for the 2-D recipe; OLMo 2 under Hugging Face's own
#: tensor-parallel plan (flint.capture.byom.apply_hf_tp), in the real run and in the capture; Hugging Face GPT-2
#: under DP: its tied embedding grouped with [ln_f, lm_head] (FSDP-based replicate, as FSDP2, refuses one parameter
#: in two groups) and replicate taking that list (the real runs of both failed before); Hugging Face Llama with its
#: embedding and attention frozen (no weight-gradient GEMM of them: the GEMM count must match exactly; the captured
#: recipe used to make them trainable again), and under FSDP (the frozen embedding gathered again in backward by
#: FSDP2's backward prefetch: the captured recipe used to skip that gather)
SLOW_CASES = [Case("gpt2-tiny", "dp", 2), Case("llama-tiny", "fsdp", 2), Case("llama-tiny", "tp", 2),
              Case("llama-tiny", "fsdp+tp", 4), Case(*HF_CASES[0]), Case("hf-olmo2-tiny", "fsdp+tp", 4),
              Case("hf-gpt2-tiny", "dp", 2), Case("hf-llama-tiny-frozen", "dp", 2),
              Case("hf-llama-tiny-frozen", "fsdp", 2)]

#: the stated tolerance for classes that need not match: Flint / executed count ratio, rank by rank
TOLERANCE = {"elementwise": (0.5, 2.0), "reduction": (0.5, 1.5)}


@pytest.fixture(scope="module", params=SLOW_CASES, ids=lambda c: c.label().replace(" ", "-"))
def validated(request):
    from flint.validate.run import validate_case

    return validate_case(request.param, timeout_s=240)


@pytest.mark.slow
def test_collective_counts_and_bytes_match_exactly(validated):
    flint = validated.flint
    assert flint.collectives, "the case has no collectives"
    for rc in validated.ranks:
        assert rc.collectives == flint.collectives, f"rank {rc.rank}"  # by (kind, phase)
        assert rc.collective_bytes == flint.collective_bytes, f"rank {rc.rank}"
    for row in validated.rows:
        if row.cls in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert row.ratio == 1.0 and row.bytes_ratio == 1.0, row


@pytest.mark.slow
def test_gemm_and_attention_counts_match_exactly(validated):
    for row in validated.rows:
        if row.cls in ("gemm", "attention"):
            assert row.flint == row.executed, row


@pytest.mark.slow
def test_other_classes_within_stated_tolerance(validated):
    for row in validated.rows:
        if row.cls in TOLERANCE:
            low, high = TOLERANCE[row.cls]
            assert low <= row.ratio <= high, row


@pytest.mark.slow
def test_every_operator_level_difference_is_explained(validated):
    from flint.validate.compare import op_deltas
    from flint.validate.expected import explain

    for rc in validated.ranks:
        for cls in ("gemm", "attention", "elementwise", "reduction", "multi-tensor"):
            for phase, op, a, b in op_deltas(validated.flint, rc, cls):
                assert explain(cls, phase, op, validated.case.plan, validated.case.model), \
                    (rc.rank, cls, phase, op, a, b)


@pytest.mark.slow
def test_real_trace_goes_through_reader_checker_and_simulator(validated):
    assert validated.converter_problems == []  # every counted op is in chakra_converter's output
    assert validated.trace_problems == []  # inferred groups: same collectives in the same order per group
    assert validated.imported_collectives == sum(sum(rc.collectives.values()) for rc in validated.ranks)
    assert validated.simulated_us > 0


# ------------------------------------------- activation checkpointing: real gloo run vs Flint


def test_ac_cases_are_selected_and_labelled():
    from flint.validate.cli import ac_cases

    got = ac_cases(["llama-tiny"], ["fsdp"], [2])
    assert [c.ac for c in got] == ["full", "selective-op"]
    assert got[0].label() == "llama-tiny fsdp w2 ac=full"
    assert ac_cases(["gpt2-tiny"], ["fsdp"], [2]) == []


def test_orphaned_host_trace_nodes_are_reparented_to_their_thread_root(tmp_path):
    import json

    from flint.validate.realrun import repair_orphans

    def node(i, name, parent, tid=1):
        return {"id": i, "name": name, "ctrl_deps": parent, "inputs": {}, "outputs": {},
                "attrs": [{"name": "tid", "type": "uint64", "value": tid}]}

    nodes = [node(1, "[pytorch|profiler|execution_trace|process]", None),
             node(2, "[pytorch|profiler|execution_trace|thread]", 1),
             node(5, "[pytorch|profiler|execution_trace|thread]", 1, tid=2),
             node(10, "aten::mm", 2), node(12, "c10d::_reduce_scatter_base_", 11), node(13, "aten::add", 99, tid=2)]
    path = tmp_path / "host.0.json"
    path.write_text(json.dumps({"nodes": nodes}))
    assert repair_orphans(path) == 2
    parents = {n["id"]: n["ctrl_deps"] for n in json.loads(path.read_text())["nodes"]}
    assert parents[12] == 2 and parents[13] == 5 and parents[10] == 2
    assert repair_orphans(path) == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode, gemms, attention", [("full", 2 * 6, 2), ("selective-op", 2 * 3, 0)])
def test_activation_checkpointing_real_run_gemm_count_matches_exactly(mode, gemms, attention):
    """llama-tiny FSDP on 2 gloo ranks with checkpoint_wrapper: the backward's recompute GEMMs, attention and
    every collective match Flint's capture exactly. Full AC recomputes 6 of a block's 7 GEMMs (w2's output is
    never read) and its attention; torchtitan's selective-op policy every second GEMM (3 of 7) and no
    attention, the saved ops served from SAC's cache (not counted as executed: test above)."""
    from flint.validate.compare import op_deltas
    from flint.validate.report import markdown
    from flint.validate.run import validate_case

    res = validate_case(Case("llama-tiny", "fsdp", 2, ac=mode), timeout_s=400)
    flint = {r.cls: r.flint for r in res.rows if r.rank == 0}
    for rc in res.ranks:  # every other difference has its rule (the recomputed means among them)
        for cls in ("gemm", "attention", "elementwise", "reduction", "multi-tensor"):
            for phase, op, a, b in op_deltas(res.flint, rc, cls):
                assert explain(cls, phase, op, "fsdp", "llama-tiny", ac=True), (rc.rank, cls, phase, op, a, b)
    assert "unexplained" not in markdown([res], command="flint validate", chart=None)
    for row in res.rows:
        if row.cls in ("gemm", "attention", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert row.flint == row.executed, row
            assert row.bytes_ratio in (None, 1.0), row
    assert res.converter_problems == [] and res.trace_problems == []
    # the recompute is there: without AC, 2 blocks x 7 linears + the head, forward and twice in backward
    assert flint["gemm"] == (2 * 7 + 1) * 3 + gemms
    assert flint["attention"] == 2 * 2 + attention  # forward + backward per block, + recomputed forwards


# ------------------------------------------- the plan's loss_parallel: real gloo run vs Flint


def test_loss_parallel_cases_are_selected_and_labelled():
    from flint.validate.cli import loss_parallel_cases

    got = loss_parallel_cases(["llama-tiny"], ["tp"], [2])
    assert [(c.plan, c.world_size, c.loss_parallel) for c in got] == [("tp", 2, True)]
    assert got[0].label() == "llama-tiny tp w2 loss_parallel"
    assert loss_parallel_cases(["llama-tiny"], ["fsdp"], [2]) == []
    # its rules explain only cases that run loss_parallel
    assert explain("reduction", "bwd", "aten::nll_loss_backward", "tp", "llama-tiny") is None
    assert explain("reduction", "bwd", "aten::nll_loss_backward", "tp", "llama-tiny", True).key == \
        "loss-parallel-handlers"


@pytest.mark.slow
def test_loss_parallel_real_run_matches_exactly():
    """llama-tiny TP 2 on 2 gloo ranks, forward and backward inside torch's loss_parallel: every collective
    (the loss's per-token max, sum-of-exponentials and target-logit all-reduces among them), GEMM and attention
    op matches Flint's capture, and every operator-level difference has a rule."""
    from flint.validate.compare import op_deltas
    from flint.validate.run import validate_case

    res = validate_case(Case("llama-tiny", "tp", 2, loss_parallel=True), timeout_s=400)
    for row in res.rows:
        if row.cls in ("gemm", "attention", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert row.flint == row.executed and row.bytes_ratio in (None, 1.0), row
    tokens = 4 * 64  # the case's global batch; TP ranks see every token
    for rc in res.ranks:
        assert rc.collectives == res.flint.collectives and rc.collective_bytes == res.flint.collective_bytes
        # no logits all-gather; the loss's three all-reduces of one fp32 value per token
        assert rc.collectives[("all_gather", "fwd")] == 0
        loss = [c for c in rc.collective_ops
                if c.kind == "all_reduce" and c.phase == "fwd" and c.input_bytes == tokens * 4]
        assert len(loss) == 3
        for cls in ("gemm", "attention", "elementwise", "reduction"):
            for phase, op, a, b in op_deltas(res.flint, rc, cls):
                assert explain(cls, phase, op, "tp", "llama-tiny", True), (rc.rank, cls, phase, op, a, b)
    assert res.converter_problems == [] and res.trace_problems == []


# ------------------------------------------- gradient-norm clipping: real gloo run vs Flint

def test_clip_cases_are_selected_and_labelled():
    from flint.validate.cli import clip_cases
    from flint.validate.expected import explain_collective_bytes

    got = clip_cases(["llama-tiny"], ["fsdp", "tp+sp"], [2])
    assert [(c.plan, c.world_size, c.max_norm) for c in got] == [("fsdp", 2, 1.0), ("tp+sp", 2, 1.0)]
    assert got[0].label() == "llama-tiny fsdp w2 clip=1"
    assert clip_cases(["llama-tiny"], ["dp"], [2]) == []
    # its rules explain only cases that clip
    assert explain("reduction", "optim", "aten::linalg_vector_norm", "fsdp", "llama-tiny") is None
    assert explain("reduction", "optim", "aten::linalg_vector_norm", "fsdp", "llama-tiny", clip=True).key == \
        "grad-clip-norms"
    assert explain_collective_bytes("all_reduce", "optim", False) is None
    assert explain_collective_bytes("all_reduce", "optim", True).key == "grad-clip-norm-vector"
    assert explain_collective_bytes("all_gather", "optim", True) is None


@pytest.mark.slow
def test_gradient_clipping_real_run_matches():
    """llama-tiny FSDP 2 on 2 gloo ranks clipping as torchtitan does (get_total_norm, full_tensor,
    clip_grads_with_norm_) between backward and AdamW: every collective count, GEMM and attention op matches
    Flint's capture, the norm's all-reduce over dp_shard included; it moves one fp32 norm per gradient tensor
    in the real run and one in Flint (explained in the report); every operator-level difference has a rule."""
    from flint.models import factory
    from flint.validate.compare import op_deltas
    from flint.validate.report import markdown
    from flint.validate.run import validate_case

    with torch.device("meta"):
        grads = len(list(factory("llama-tiny")().parameters()))
    res = validate_case(Case("llama-tiny", "fsdp", 2, max_norm=1.0), timeout_s=400)
    clip = ("all_reduce", "optim")
    for row in res.rows:
        if row.cls in ("gemm", "attention", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert row.flint == row.executed, row
    for rc in res.ranks:
        assert rc.collectives == res.flint.collectives and rc.collectives[clip] == 1
        assert res.flint.collective_bytes[clip] == 4 and rc.collective_bytes[clip] == 4 * grads
        assert {k: v for k, v in rc.collective_bytes.items() if k != clip} == \
               {k: v for k, v in res.flint.collective_bytes.items() if k != clip}
        for cls in ("gemm", "attention", "elementwise", "reduction"):
            for phase, op, a, b in op_deltas(res.flint, rc, cls):
                assert explain(cls, phase, op, "fsdp", "llama-tiny", clip=True), (rc.rank, cls, phase, op, a, b)
    report = markdown([res], command="flint validate", chart=None)
    assert f"the same count, bytes Flint 4 vs executed {4 * grads}: **grad-clip-norm-vector**" in report
    assert "unexplained" not in report
    assert res.converter_problems == [] and res.trace_problems == []


# ------------------------------------------- AdamW's multi-tensor forms: real gloo run vs Flint

def test_optimizer_cases_are_selected_and_labelled():
    from flint.validate.classify import executed_class
    from flint.validate.cli import optimizer_cases

    got = optimizer_cases(["llama-tiny"], ["fsdp"], [2])
    assert [(c.plan, c.world_size, c.optimizer_impl) for c in got] == [("fsdp", 2, "foreach"), ("fsdp", 2, "fused")]
    assert got[1].label() == "llama-tiny fsdp w2 fused"
    assert optimizer_cases(["llama-tiny"], ["tp"], [2]) == []
    # torch's multi-tensor ops are a compared class of their own (classify_aten has them as "other")
    assert executed_class("aten::_foreach_lerp_", "aten::_foreach_lerp_.Scalar(Tensor(a!)[] self, ...)") == \
        "multi-tensor"
    assert executed_class("aten::_fused_adamw_") == "multi-tensor"
    assert executed_class("aten::lerp_") == "elementwise"
    assert explain("multi-tensor", "optim", "aten::_fused_adamw", "fsdp", "llama-tiny").key == "per-part-optimizer"
    assert explain("multi-tensor", "fwd", "aten::_foreach_copy", "fsdp", "llama-tiny").key == "fsdp-foreach-copy-out"
    assert explain("multi-tensor", "fwd", "aten::_foreach_copy", "tp", "llama-tiny") is None


@pytest.mark.slow
@pytest.mark.parametrize("impl,kinds", [
    ("foreach", {"_foreach_lerp_", "_foreach_mul_", "_foreach_addcmul_", "_foreach_sqrt", "_foreach_div_",
                 "_foreach_add_", "_foreach_addcdiv_"}),
    ("fused", {"_fused_adamw_", "_foreach_add_"})])
def test_multi_tensor_optimizer_real_run(impl, kinds):
    """llama-tiny FSDP 2 on 2 gloo ranks with AdamW(foreach=True) / AdamW(fused=True): every collective, GEMM
    and attention op matches Flint's capture; the real step runs the multi-tensor ops Flint captured, of the same
    kinds, once over all parameters where Flint runs them once per part (embedding, 2 blocks, head: 4x), over
    the same elements (the rank's shard of every parameter); every other difference has a rule (FSDP2's
    _foreach_copy_ copy-out, CPU's per-tensor foreach loop, eager foreach's step-count increment)."""
    from flint.models import factory
    from flint.validate.compare import op_deltas
    from flint.validate.report import markdown
    from flint.validate.run import validate_case

    with torch.device("meta"):
        params = list(factory("llama-tiny")().parameters())
    res = validate_case(Case("llama-tiny", "fsdp", 2, optimizer_impl=impl), timeout_s=400)
    for row in res.rows:
        if row.cls in ("gemm", "attention", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert row.flint == row.executed and row.bytes_ratio in (None, 1.0), row
    parts = 4
    for rc in res.ranks:
        assert rc.collectives == res.flint.collectives and rc.collective_bytes == res.flint.collective_bytes
        flint_mt = {op.split("::")[1]: n for (cls, phase, op), n in res.flint.ops.items()
                    if cls == "multi-tensor" and phase == "optim"}
        real_mt = {op.split("::")[1]: n for (cls, phase, op), n in rc.ops.items()
                   if cls == "multi-tensor" and phase == "optim"}
        assert set(flint_mt) == set(real_mt) == kinds
        # the update's own ops; _foreach_add_ differs beyond that: eager foreach increments its host step counts
        # with one more, which Flint's capture leaves out (no device kernel on a GPU)
        assert {k: n for k, n in flint_mt.items() if k != "_foreach_add_"} == \
            {k: parts * n for k, n in real_mt.items() if k != "_foreach_add_"}
        # over the same elements: the rank's shard of every parameter (the steps' increment: one per parameter)
        flint_el = {op: n for (phase, op), n in res.flint.multi_tensor_elements.items() if phase == "optim"}
        real_el = {op: n for (phase, op), n in rc.multi_tensor_elements.items() if phase == "optim"}
        shard, add = sum(p.numel() for p in params) // 2, "aten::_foreach_add_"
        assert all(n == shard * (2 if op == "aten::_foreach_mul_" else 1) for op, n in flint_el.items() if op != add)
        assert {op: n for op, n in real_el.items() if op != add} == {op: n for op, n in flint_el.items() if op != add}
        assert real_el[add] == flint_el[add] + (len(params) if impl == "foreach" else 0)
        for cls in ("gemm", "attention", "elementwise", "reduction", "multi-tensor"):
            for phase, op, a, b in op_deltas(res.flint, rc, cls):
                assert explain(cls, phase, op, "fsdp", "llama-tiny"), (rc.rank, cls, phase, op, a, b)
    report = markdown([res], command="flint validate", chart=None)
    assert "unexplained" not in report
    assert f"`aten::_foreach_add` {flint_el[add]} / {real_el[add]}" in report
    assert res.converter_problems == [] and res.trace_problems == []
