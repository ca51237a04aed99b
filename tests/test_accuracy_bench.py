"""bench/accuracy.py: capturing two blocks and repeating the block to the row's depth gives the
estimate of a capture at full depth (the IR has one body per repeated block)."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "accuracy.py"


def _bench():
    spec = importlib.util.spec_from_file_location("flint_bench_accuracy", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


ROW = {"id": "tiny", "source": "test", "device": "h100-sxm", "network": "dgx-h100", "hidden": 64, "heads": 4,
       "layers": 4, "seq": 32, "vocab": 256, "tp": 1, "pp": 2, "gpus": 4, "global_batch": 8, "microbatch": 1,
       "tflops_per_gpu": 1.0}


@pytest.mark.slow
def test_two_captured_blocks_repeated_equal_a_full_depth_capture(monkeypatch):
    acc = _bench()
    short = acc.estimate(dict(ROW))
    monkeypatch.setattr(acc, "CAPTURE_LAYERS", ROW["layers"])
    full = acc.estimate(dict(ROW))
    assert short.status == full.status == "estimated"
    assert short.iteration_s == pytest.approx(full.iteration_s, rel=1e-9)
    assert short.exposed_s == pytest.approx(full.exposed_s, rel=1e-9)
    # the throughput error is on throughput for both kinds of rows
    assert short.error == pytest.approx(short.tflops_per_gpu - 1.0)
    it = dict(ROW, iteration_s=2 * short.iteration_s)
    del it["tflops_per_gpu"]
    assert acc.Result(it, "estimated", iteration_s=short.iteration_s).error == pytest.approx(1.0)


def _rows():
    import tomllib

    with open(BENCH.with_name("accuracy_rows.toml"), "rb") as f:
        return {r["id"]: r for r in tomllib.load(f)["rows"]}


def test_megatron_rows_run_micro_batch_one_with_gradient_accumulation():
    """M rows: micro-batch 1 (Megatron-LM's example), so without pipelining the local batch is
    accumulated over micro-batches; the S rows keep their stated micro-batch."""
    acc, rows = _bench(), _rows()
    m1 = acc.plan_of(rows["M1"])  # 192 sequences over dp 48: 4 micro-batches of 1
    assert (m1.pp, m1.dp, m1.microbatches) == (1, 48, 4)
    # Megatron-Core's distributed optimizer: ZeRO-2-like sharding over dp, gradients reduced in fp32
    assert (m1.dp_shard, m1.zero, m1.reduce_dtype, m1.param_dtype) == (48, 2, "float32", "bfloat16")
    assert m1.master_dtype == "param"  # the fp32 sharded parameters are the masters
    s1 = acc.plan_of(rows["S1-full"])
    # no data parallelism; Megatron's mixed-precision optimizer: fp32 masters of the bf16 model
    assert (s1.dp_shard, s1.reduce_dtype, s1.master_dtype) == (1, "param", "float32")
    assert acc.plan_of(rows["S1-full"]).microbatches == 1  # global batch 4 = one micro-batch of 4


def test_megatron_pipelined_rows_run_interleaved_one_layer_per_virtual_stage():
    """Megatron overlaps pipeline send/recv only under its interleaved schedule; the layers per
    pipeline rank of M6 (23) and M9 (7) admit only one layer per virtual stage."""
    acc, rows = _bench(), _rows()
    for rid in ("M5", "M6", "M7", "M8", "M9"):
        row = rows[rid]
        plan = acc.plan_of(row)
        assert plan.pp_schedule == "interleaved-1f1b", rid
        assert plan.pp_virtual_stages * row["pp"] == row["layers"], rid
        assert plan.microbatches == row["global_batch"] // (row["gpus"] // (row["tp"] * row["pp"])), rid
        assert plan.pp_p2p == "overlap", rid  # stated by the rows' source (Megatron's overlap_p2p_comm)
    assert acc.plan_of(rows["S2-full"]).pp_p2p == "schedule"


def test_tp_comm_overlap_only_where_the_source_states_it():
    """--tp-comm-overlap is stated by the Megatron-LM README (M rows), not by Korthikanti et al. (S rows);
    the bench runs micro-pipeline-tp exactly there."""
    rows = _rows()
    assert {rid for rid, r in rows.items() if r.get("tp_comm_overlap")} == {rid for rid in rows if rid.startswith("M")}
    text = BENCH.with_name("accuracy_rows.toml").read_text()
    assert text.count("tp_comm_overlap = true  # stated: Megatron-LM README") == 9
    assert "MicroPipelineTPPass(sms=TE_UB_SMS).apply(ctx, module)" in BENCH.read_text()
    assert _bench().TE_UB_SMS == 16  # Transformer Engine's userbuffers reduce-scatter kernels (initialize_ub)


def test_ideal_bubble_is_the_schedules_textbook_fraction():
    acc, rows = _bench(), _rows()
    assert acc.ideal_bubble(rows["M1"]) == 0.0
    # M5: pp 2, 8 micro-batches, 42 virtual stages: 1 / (42 * 8 + 1)
    assert acc.ideal_bubble(rows["M5"]) == 1 / 337
    assert acc.ideal_bubble(rows["S2-full"]) == 7 / (3 * 64 + 7)


def test_report_header_names_only_flags_that_differ_from_the_defaults():
    """The header's command regenerates the report: the default stage-pass budget is not spelled out (it
    once was, because the check compared against an old default), a non-default one and --rows are."""
    acc = _bench()
    assert acc.command_line(acc._parser().parse_args([])) == ".venv/bin/python bench/accuracy.py"
    assert acc.command_line(acc._parser().parse_args(["--out", "/tmp/x"])) == ".venv/bin/python bench/accuracy.py"
    assert acc.command_line(acc._parser().parse_args(["--rows", "M1,S1-full", "--max-stage-passes", "8000"])) \
        == ".venv/bin/python bench/accuracy.py --rows M1,S1-full --max-stage-passes 8000"


def test_megatron_gpt_has_one_fused_qkv_projection_and_tp_pipelines_its_gradient(capfd):
    """Megatron's GPT projects q, k and v with one ``linear_qkv`` (heads interleaved, so a colwise shard
    holds whole heads); its data gradient is one matmul, so under TP the backward reduce-scatter is
    micro-pipelined like the others. With three separate projections it was a sum of three matmuls,
    which micro-pipeline-tp leaves exposed (one reduce-scatter per block left unchanged)."""
    acc = _bench()
    row = dict(ROW, id="tiny-tp", tp=2, pp=1, gpus=2, layers=2, global_batch=2, tp_comm_overlap=True)
    attention = acc.megatron_gpt(row)().layers[0].attention
    assert attention.wqkv.weight.shape == (3 * row["hidden"], row["hidden"])
    assert not any(hasattr(attention, name) for name in ("wq", "wk", "wv"))
    assert acc.estimate(row).status == "estimated"
    report = [line for line in capfd.readouterr().err.splitlines() if line.startswith("micro-pipeline-tp:")]
    assert len(report) == 1 and "and 0 reduce-scatters unchanged" in report[0], report


def test_megatron_cross_entropy_matches_torchs_loss_and_gradient():
    """The TP-1 rows' loss is Megatron's own cross-entropy algorithm (max, exp, sum, softmax saved for
    backward): its value and its gradient are those of F.cross_entropy (real tensors, CPU)."""
    import torch
    import torch.nn.functional as F

    ce = _bench()._megatron_cross_entropy()
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 11, (2, 5))
    ce.apply(logits, target).mean().backward()
    got = logits.grad.clone()
    logits.grad = None
    want = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    want.backward()
    assert torch.allclose(ce.apply(logits, target).mean(), want, atol=1e-6)
    assert torch.equal(got, logits.grad)


def test_megatron_rows_fuse_only_the_blocks_and_run_the_loss_eagerly():
    """Megatron fuses its layers' pointwise ops by hand and runs the embedding and the cross-entropy
    eagerly: only the block's functions carry fused kernels, and the TP-1 loss is Megatron's chain of
    kernels (fp32 copy, max, subtract, exp, sum, divide), each over the whole logits."""
    from xdsl.context import Context
    from xdsl.dialects import func

    from flint.importer import import_step
    from flint.ir.aten import AtenOp
    from flint.passes.fuse_pointwise import FusePointwisePass

    acc = _bench()
    row = dict(ROW, pp=1, gpus=1, layers=2, global_batch=1)
    step = acc.capture_row(row, acc.plan_of(row))
    module = import_step(step)
    FusePointwisePass(device=row["device"], parts=acc.BLOCK_PARTS).apply(Context(), module)
    fused = {fn.sym_name.data for fn in module.walk() if isinstance(fn, func.FuncOp)
             for o in fn.walk() if isinstance(o, AtenOp) and "fusion_group" in o.attributes}
    assert fused and all(name.startswith("block_") for name in fused), fused
    head = next(fn for fn in module.walk() if isinstance(fn, func.FuncOp) and fn.sym_name.data == "head_fwd")
    logits = row["seq"] * row["vocab"]
    full = [o.overload.split(".")[1] for o in head.walk() if isinstance(o, AtenOp) and o.outputs
            and o.outputs[0].type.get_shape() and math.prod(o.outputs[0].type.get_shape()) == logits and "view" not in o.overload]
    assert full[-5:] == ["mm", "_to_copy", "sub", "exp", "div"], full



def test_unstated_micro_batch_is_estimated_at_its_other_reading_too():
    """The M rows leave the micro-batch unstated; their local batch per pipeline is 4 x PP sequences, so
    the bench also runs PP micro-batches of 4 and reports that error beside the headline (micro-batch 1)."""
    acc, rows = _bench(), _rows()
    for rid in ("M1", "M4", "M5", "M9"):
        row = rows[rid]
        dp = row["gpus"] // (row["tp"] * row["pp"])
        assert row["global_batch"] // dp == 4 * row["pp"], rid
        assert (row["microbatch"], row["microbatch_alternative"]) == (1, 4), rid
        other = acc.plan_of(dict(row, microbatch=row["microbatch_alternative"]))
        assert other.microbatches == row["pp"], rid  # M1: one pass of 4 sequences; M9: 16 of 4
    assert not any("microbatch_alternative" in r for rid, r in rows.items() if rid.startswith("S"))


def test_other_micro_batch_error_is_that_of_the_row_run_at_it():
    acc = _bench()
    row = dict(ROW, pp=1, gpus=2, global_batch=4, microbatch=1)
    other = acc.estimate(dict(row, microbatch=2))
    both = acc.estimate(dict(row, microbatch_alternative=2))
    assert both.error == pytest.approx(acc.estimate(row).error, rel=1e-12)
    assert both.alt_error == pytest.approx(other.error, rel=1e-12)
    assert other.error != pytest.approx(both.error, rel=1e-6)  # the micro-batch moves the estimate
    assert acc._alt(both) == f"{100 * other.error:+.1f}% (micro-batch 2)" and acc._alt(other) == ""


def test_report_states_both_readings_of_an_unstated_micro_batch(tmp_path):
    acc = _bench()
    stated = acc.Result(dict(ROW, id="S"), "estimated", iteration_s=1.0, tflops_per_gpu=1.1, exposed_s=0.0)
    unstated = acc.Result(dict(ROW, id="M", microbatch_alternative=4), "estimated", iteration_s=1.0,
                          tflops_per_gpu=0.8, exposed_s=0.0, alt_error=0.05)
    acc.write_report([stated, unstated], tmp_path)
    text = (tmp_path / "accuracy.md").read_text()
    assert "| +5.0% (micro-batch 4) | estimated |" in text
    assert "| +10.0% |  | estimated |" in text  # a stated micro-batch (if comm hidden +10%): no other reading
    # the unstated row: 20% as estimated, 5% at the other reading; all rows with it: mean(10, 5)
    assert "mean absolute error 20.0% (max 20.0%) as estimated, 5.0% (max 5.0%) at the other micro-batch" in text
    assert "all rows with that reading: 7.5% (max 10.0%)" in text


def _compute_bound(acc, rid: str, device: str, true_fraction: float, compute_s: float = 1.0):
    """A row whose iteration is all compute (``compute_s / f`` at sustained fraction f) and whose published
    time is what Flint gives at ``true_fraction``."""
    row = dict(ROW, id=rid, device=device, iteration_s=compute_s / true_fraction)
    del row["tflops_per_gpu"]
    r = acc.Result(row, "estimated", iteration_s=compute_s, resimulate=lambda f: compute_s / f)
    r.iteration_at = {f: compute_s / f for f in acc.SUSTAINED_GRID}
    return r


def test_the_sustained_fraction_fit_recovers_a_uniform_slowdown():
    acc = _bench()
    rows = [_compute_bound(acc, f"R{i}", "h100-sxm", 0.85, compute_s=c) for i, c in enumerate((0.5, 2.0, 7.0))]
    assert acc.fit_sustained(rows) == pytest.approx(0.85)
    assert all(acc.interpolated_iteration(r, 0.85) == pytest.approx(r.row["iteration_s"]) for r in rows)
    assert acc.fit_sustained([_compute_bound(acc, "F", "h100-sxm", 1.25)]) == 1.0  # never above the calibration
    # two rows disagreeing: any factor between them minimises the summed error; ties keep the larger
    f = acc.fit_sustained([_compute_bound(acc, "A", "h100-sxm", 0.8), _compute_bound(acc, "B", "h100-sxm", 0.9)])
    assert 0.8 <= f <= 0.9
    with pytest.raises(ValueError, match="outside the simulated"):
        acc.interpolated_iteration(rows[0], 0.5)


def test_leave_one_out_never_fits_a_row_or_its_configuration_to_itself():
    """Each row's factor is fitted on the OTHER configurations of its device: both rows of one
    Korthikanti model (S1-full, S1-sel+SP) are held out together; other devices' rows never count."""
    acc = _bench()
    pair = [_compute_bound(acc, "S1-full", "a100-80gb", 0.8), _compute_bound(acc, "S1-sel+SP", "a100-80gb", 0.8)]
    others = [_compute_bound(acc, "S2-full", "a100-80gb", 0.95), _compute_bound(acc, "S3-full", "a100-80gb", 0.95)]
    alone = _compute_bound(acc, "M1", "h100-sxm", 0.7)
    results = pair + others + [alone, acc.Result(dict(ROW, id="X"), "failed", "boom")]
    acc.leave_one_out(results)
    for r in pair:  # fitted on S2 and S3 only: their 0.95, so the pair is still estimated too fast
        assert r.loo_fraction == pytest.approx(0.95)
        assert r.loo_error == pytest.approx(r.error_at(1 / 0.95)) and r.loo_error > 0.15
    assert others[0].loo_fraction < 0.95  # fitted on S1 (x2, at 0.8) and S3 (0.95)
    assert math.isnan(alone.loo_fraction) and math.isnan(alone.loo_error)  # no other H100 configuration
    fits = acc.device_fits(results)
    assert [(f.device, len(f.rows)) for f in fits] == [("a100-80gb", 4), ("h100-sxm", 1)]
    assert fits[1].fraction == pytest.approx(0.7) and fits[1].errors["M1"] == pytest.approx(0.0, abs=1e-9)


def test_the_fitted_calibration_file_loads_as_a_calibration_override(tmp_path):
    from flint.cost import load_device

    acc = _bench()
    rows = [_compute_bound(acc, f"S{i}-full", "a100-80gb", 0.9) for i in range(3)]
    acc.leave_one_out(rows)
    (fit,) = acc.device_fits(rows)
    path = tmp_path / "a100-80gb.toml"
    path.write_text(acc.fitted_toml(fit, "bench"))
    text = path.read_text()
    assert "FITTED, not sourced" in text and "S0-full, S1-full, S2-full" in text
    assert "leave-one-configuration-out" in text
    dev = load_device("a100-80gb", calibration=path)
    assert dev.calibration.sustained_fraction == pytest.approx(0.9)
    acc.write_report(rows, tmp_path, fits=[fit])
    report = (tmp_path / "accuracy.md").read_text()
    assert "## A fitted factor per device, tested leave-one-out" in report
    assert "leave-one-configuration-out: **mean absolute error 0.0%, max 0.0%** over 3 rows" in report
