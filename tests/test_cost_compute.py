"""The shape-aware compute model (flint.cost.compute) and device calibrations (flint.cost.calibration)."""

import math
from dataclasses import replace

import pytest

from flint.cost import load_device, op_cost
from flint.cost.calibration import (list_calibrations, list_overrides, load_calibration, parse_calibration,
                                    shipped_override)
from flint.cost.compute import AttentionModel, GemmModel
from flint.cost.device import device_from_dict, list_devices
from flint.cost.flops import gemm_dims
from flint.errors import FlintError

H100 = load_device("h100-sxm")
ONE_TILE = GemmModel(peak_fraction=0.8, tiles=((128, 128, 1.0),), k_overhead=0.0, max_split_k=1)


def mm(m, n, k, device=H100):
    c = op_cost("aten.mm.default", [(m, k), (k, n)], "bf16", [(m, n)], "bf16")
    return device.op_time_us(c)


def test_wave_quantization_by_hand():
    # 132 SMs: 132 tiles of 128x128 fill one wave; 133 need a second wave of one tile.
    peak = 989.4e12
    one_wave = ONE_TILE.time_us((1, 128 * 132, 128, 4096), 0, peak, 132, 1e12)
    assert one_wave == pytest.approx(2 * 128 * 128 * 4096 / (peak / 132 * 0.8) * 1e6)
    two_waves = ONE_TILE.time_us((1, 128 * 133, 128, 4096), 0, peak, 132, 1e12)
    assert two_waves == pytest.approx(2 * one_wave)


def test_tile_quantization_by_hand():
    # m = 129 rows pads to two 128-row tiles: the same time as 256 rows.
    peak = 989.4e12
    assert ONE_TILE.time_us((1, 129, 128, 512), 0, peak, 132, 1e12) == \
        pytest.approx(ONE_TILE.time_us((1, 256, 128, 512), 0, peak, 132, 1e12))


def test_small_k_costs_more_per_flop():
    big = 2 * 16384 * 8192 * 8192 / mm(16384, 8192, 8192)
    small = 2 * 16384 * 8192 * 64 / mm(16384, 8192, 64)
    assert small < 0.5 * big  # the per-tile fixed cost dominates a 64-deep GEMM


def test_large_aligned_gemm_reaches_the_mamf_fraction():
    t = mm(8192, 8192, 8192)
    achieved = 2 * 8192 ** 3 / (t * 1e-6) / 989.4e12
    assert 0.7 < achieved <= 0.801  # never above the measured maximum


def test_split_k_helps_shapes_with_few_tiles():
    split = H100.calibration.gemm
    nosplit = replace(split, max_split_k=1)
    dims, peak, bw = (1, 512, 512, 65536), 989.4e12, 3350e3 * 0.867
    nbytes = 2 * (512 * 65536 * 2 + 512 * 512)
    assert split.time_us(dims, nbytes, peak, 132, bw) < 0.5 * nosplit.time_us(dims, nbytes, peak, 132, bw)


def test_memory_bound_gemm_and_kernel_floor():
    # a GEMV-like product is bounded by its bytes (plus the fixed GEMM latency), a tiny one by the
    # GEMM latency (H100, fitted) or the kernel floor (A100: no fitted latency)
    c = op_cost("aten.mm.default", [(8, 8192), (8192, 8192)], "bf16", [(8, 8192)], "bf16")
    latency = H100.calibration.gemm.latency_us
    assert latency > H100.kernel_floor_us
    assert H100.op_time_us(c) == pytest.approx(c.bytes / (3350e3 * 0.867) + latency, rel=0.05)
    assert latency < mm(4, 4, 4) < latency + 1.0  # plus one tile's fill and epilogue
    a100 = load_device("a100-80gb")
    assert a100.calibration.gemm.latency_us == 0.0 and mm(4, 4, 4, a100) == a100.kernel_floor_us


def test_attention_efficiency_grows_with_sequence():
    def tflops(s, backward=False):
        name = "backward" if backward else ""
        target = f"aten._scaled_dot_product_flash_attention{'_backward' if backward else ''}.default"
        shapes = [(1, 16, s, 128)] * (5 if backward else 3)
        c = op_cost(target, shapes, "bf16", [(1, 16, s, 128)], "bf16", {"is_causal": True})
        assert c.attention_seq == (s, backward), name
        return c.flops * c.work_fraction / H100.op_time_us(c) / 1e6

    assert tflops(512) < tflops(2048) < tflops(16384) < 0.62 * 989.4
    assert tflops(16384, backward=True) < tflops(16384)
    model = AttentionModel(0.5, 0.4, 1000.0)
    assert model.time_us(1e12, 1000, False, 1e15) == pytest.approx(1e12 / (1e15 * 0.25) * 1e6)


def test_attention_kernel_picks_the_calibrations_rates():
    """Unmarked fused attention is PyTorch's default flash backend (FlashAttention-2); marked cudnn it
    uses [cudnn_attention]: on the H100 the FA2 rates are the cuDNN ones / 1.59 (Transformer
    Engine's measured ratio), so the cuDNN kernel is 1.59x faster at any length and direction."""
    for s, backward in ((512, False), (8192, True)):
        target = f"aten._scaled_dot_product_flash_attention{'_backward' if backward else ''}.default"
        c = op_cost(target, [(2, 16, s, 128)] * (5 if backward else 3), "bf16", [(2, 16, s, 128)], "bf16",
                    {"is_causal": True})
        assert c.attention_kernel == "flash"
        flash, cudnn = H100.op_time_us(c), H100.op_time_us(replace(c, attention_kernel="cudnn"))
        assert flash / cudnn == pytest.approx(0.62 / 0.39 if not backward else 0.45 / 0.283, rel=1e-9)
    with pytest.raises(FlintError, match=r"device 'a100-80gb' has no \[cudnn_attention\] in its calibration"):
        load_device("a100-80gb").op_time_us(replace(c, attention_kernel="cudnn"))
    # H100 class: both tables; the others: PyTorch's default kernel only
    assert {n for n in list_calibrations() if load_device(n).calibration.cudnn_attention} == \
        {"h100-sxm", "h100-96gb-hbm2e", "h200"}


def test_cudnn_attention_table_is_optional_but_complete_and_merges():
    cal = parse_calibration(dict(COMPLETE, cudnn_attention={"fwd_fraction": 0.7, "bwd_fraction": 0.5,
                                                           "seq_half": 600}), "cal.toml")
    assert cal.cudnn_attention == AttentionModel(0.7, 0.5, 600.0)
    assert parse_calibration(COMPLETE, "cal.toml").cudnn_attention is None
    with pytest.raises(FlintError, match=r"cal.toml: missing \[cudnn_attention\] seq_half"):
        parse_calibration(dict(COMPLETE, cudnn_attention={"fwd_fraction": 0.7, "bwd_fraction": 0.5}), "cal.toml")
    with pytest.raises(FlintError, match=r"\[cudnn_attention\] fwd_fraction = 1.5 is out of range"):
        parse_calibration(dict(COMPLETE, cudnn_attention={"fwd_fraction": 1.5, "bwd_fraction": 0.5,
                                                           "seq_half": 600}), "cal.toml")
    merged = H100.calibrated({"cudnn_attention": {"fwd_fraction": 0.7}}).calibration.cudnn_attention
    assert merged == AttentionModel(0.7, 0.45, 640.0, 0.034)
    with pytest.raises(FlintError, match=r"missing \[cudnn_attention\] bwd_fraction"):  # new table: complete
        load_device("a100-80gb").calibrated({"cudnn_attention": {"fwd_fraction": 0.7}})


def test_attention_dropout_reads_dropout_p_and_prices_the_measured_overhead():
    """A fused attention kernel with dropout (dropout_p > 0, read from the op's arguments, forward and
    backward, CUDA and CPU-captured names) takes its table's dropout_overhead longer: cuDNN's on Hopper
    3.4% (TransformerEngine issue 3312, H200); FlashAttention-2 has no Hopper measurement, so as without."""
    cases = [("aten._scaled_dot_product_flash_attention.default", False),
             ("aten._scaled_dot_product_flash_attention_backward.default", True),
             ("aten._scaled_dot_product_flash_attention_for_cpu.default", False),
             ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", True)]
    for target, backward in cases:
        def cost(p):
            return op_cost(target, [(2, 16, 4096, 128)] * (5 if backward else 3), "bf16", [(2, 16, 4096, 128)],
                           "bf16", {"is_causal": True, "dropout_p": p})
        plain, dropped = cost(0.0), cost(0.1)
        assert (plain.attention_dropout, dropped.attention_dropout) == (False, True), target
        cudnn = H100.op_time_us(replace(dropped, attention_kernel="cudnn"))
        assert cudnn / H100.op_time_us(replace(plain, attention_kernel="cudnn")) == pytest.approx(1.034, rel=1e-9)
        assert H100.op_time_us(dropped) == H100.op_time_us(plain), target  # FA2: no measurement
        assert dropped.flops == plain.flops and dropped.bytes == plain.bytes
    assert {n for n in list_calibrations() if (c := load_device(n).calibration.cudnn_attention) and c.dropout_overhead} \
        == {"h100-sxm", "h100-96gb-hbm2e", "h200"}
    assert not any(load_device(n).calibration.attention.dropout_overhead for n in list_calibrations())


def test_dropout_overhead_is_optional_range_checked_and_round_trips(tmp_path):
    assert parse_calibration(COMPLETE, "cal.toml").attention.dropout_overhead == 0.0
    cal = parse_calibration(dict(COMPLETE, attention=dict(COMPLETE["attention"], dropout_overhead=0.05)), "cal.toml")
    assert cal.attention == AttentionModel(0.6, 0.4, 512.0, 0.05)
    with pytest.raises(FlintError, match=r"cal.toml: \[attention\] dropout_overhead = -0.1 is out of range "
                                         r"\(valid: 0 <= dropout_overhead <= 10 \(fraction of the kernel's time\)\)"):
        parse_calibration(dict(COMPLETE, attention=dict(COMPLETE["attention"], dropout_overhead=-0.1)), "cal.toml")
    merged = H100.calibrated({"attention": {"dropout_overhead": 0.05}}).calibration
    assert merged.attention.dropout_overhead == 0.05 and merged.cudnn_attention.dropout_overhead == 0.034
    p = tmp_path / "dev.toml"
    p.write_text(replace(H100, calibration=merged).to_toml())
    assert load_device(p).calibration == merged


@pytest.mark.parametrize("target, ins, outs, want", [
    ("aten.mm.default", [(6, 10), (10, 12)], [(6, 12)], (1, 6, 12, 10)),
    ("aten.addmm.default", [(12,), (6, 10), (10, 12)], [(6, 12)], (1, 6, 12, 10)),
    ("aten.bmm.default", [(3, 6, 10), (3, 10, 12)], [(3, 6, 12)], (3, 6, 12, 10)),
    ("aten.linear.default", [(2, 5, 10), (12, 10)], [(2, 5, 12)], (1, 10, 12, 10)),
    ("aten._scaled_mm.default", [(6, 10), (10, 12), (), ()], [(6, 12)], (1, 6, 12, 10)),
    ("aten.add.Tensor", [(6, 10), (6, 10)], [(6, 10)], None),
])
def test_gemm_dims(target, ins, outs, want):
    assert gemm_dims(target, ins, outs) == want


def test_every_preset_has_a_complete_sourced_calibration():
    assert set(list_calibrations()) == set(list_devices())
    for name in list_calibrations():
        cal = load_calibration(name, needs_fp8=load_device(name).has_peak("fp8"))
        assert cal.gemm is not None and cal.attention is not None
        assert 0 < cal.gemm.peak_fraction < 0.9  # MAMF is below the datasheet peak on every device
        text = (load_calibration.__globals__["CALIBRATION_DIR"] / f"{name}.toml").read_text()
        assert "Source" in text or "MAMF" in text


def test_calibration_round_trips_through_toml(tmp_path):
    p = tmp_path / "dev.toml"
    p.write_text(H100.to_toml())
    again = load_device(p)
    assert again.calibration == H100.calibration and again.sm_count == 132
    assert again.op_time_us(op_cost("aten.mm.default", [(4096, 4096)] * 2, "bf16", [(4096, 4096)], "bf16")) == \
        pytest.approx(mm(4096, 4096, 4096))


COMPLETE = {"kernel_floor_us": 3.0,
            "gemm": {"peak_fraction": 0.8, "mainloop_fraction": 0.9, "tiles": [[128, 128, 1.0]], "k_overhead": 64,
                     "max_split_k": 4, "latency_us": 5.0},
            "attention": {"fwd_fraction": 0.6, "bwd_fraction": 0.4, "seq_half": 512},
            "compute_efficiency": {"default": 0.5}, "memory_efficiency": {"default": 0.8}}


def _without(table, key):
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in COMPLETE.items()}
    (d[table] if table else d).pop(key)
    return d


@pytest.mark.parametrize("table, key, message", [
    ("gemm", "k_overhead", r"cal.toml: missing \[gemm\] k_overhead \(valid: 0 <= k_overhead <= 4096 \(K elements\)\)"),
    ("attention", "seq_half", r"missing \[attention\] seq_half \(valid: 0 <= seq_half <= 1e\+06"),
    ("gemm", "tiles", r"missing \[gemm\] tiles \(valid: a list of \[tile_m, tile_n, rel\]"),
    ("gemm", "latency_us", r"missing \[gemm\] latency_us \(valid: 0 <= latency_us <= 1000 \(us\)\)"),
    ("gemm", "mainloop_fraction", r"missing \[gemm\] mainloop_fraction \(valid: 0 < mainloop_fraction <= 1"),
    ("", "kernel_floor_us", r"missing kernel_floor_us \(valid: 0 <= kernel_floor_us <= 1000 \(us\)\)"),
    ("memory_efficiency", "default", r"missing \[memory_efficiency\] default \(valid: 0 < default <= 1"),
])
def test_missing_calibration_key_names_key_and_range(table, key, message):
    with pytest.raises(FlintError, match=message):
        parse_calibration(_without(table, key), "cal.toml")


@pytest.mark.parametrize("table, key, value, message", [
    ("gemm", "peak_fraction", 1.3, r"\[gemm\] peak_fraction = 1.3 is out of range \(valid: 0 < peak_fraction <= 1"),
    ("gemm", "peak_fraction", math.nan, r"\[gemm\] peak_fraction = nan is out of range"),
    ("gemm", "peak_fraction", 0.0, r"peak_fraction = 0.0 is out of range"),
    ("gemm", "max_split_k", 0, r"\[gemm\] max_split_k = 0 is out of range \(valid: 1 <= max_split_k <= 64"),
    ("gemm", "max_split_k", 2.5, r"max_split_k = 2.5 must be an integer"),
    ("attention", "fwd_fraction", True, r"fwd_fraction = True must be a number"),
    ("attention", "bwd_fraction", "0.4", r"bwd_fraction = '0.4' must be a number"),
    ("gemm", "tiles", [[8, 128, 1.0]], r"\[gemm\] tiles entry \[8, 128, 1.0\] is out of range"),
    ("gemm", "bogus", 1, r"\[gemm\] unknown keys \['bogus'\]"),
    ("gemm", "latency_us", -1.0, r"\[gemm\] latency_us = -1.0 is out of range \(valid: 0 <= latency_us <= 1000"),
    ("gemm", "mainloop_fraction", 0.7, r"mainloop_fraction = 0.7 is out of range \(valid: peak_fraction = 0.8 <= "
     r"mainloop_fraction <= 1\)"),
    ("memory_efficiency", "elementwise", 1.5, r"\[memory_efficiency\] elementwise = 1.5 is out of range"),
])
def test_out_of_range_calibration_key_names_key_and_range(table, key, value, message):
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in COMPLETE.items()}
    d[table][key] = value
    with pytest.raises(FlintError, match=message):
        parse_calibration(d, "cal.toml")


def test_calibration_file_errors_name_the_file(tmp_path):
    p = tmp_path / "cal.toml"
    p.write_text("[gemm]\npeak_fraction = 2.0\n")
    with pytest.raises(FlintError, match=rf"{p}: \[gemm\] peak_fraction = 2.0 is out of range"):
        load_device("h100-sxm", calibration=p)
    with pytest.raises(FlintError, match=r"unknown keys \['gemm_fraction'\]"):
        load_device("h100-sxm", calibration={"gemm_fraction": 0.5})
    dev = {"name": "x", "peak_tflops_bf16": 100.0, "hbm_capacity_gib": 16.0, "hbm_bandwidth_gbytes_per_s": 1000.0,
           "sm_count": 10, "calibration": str(p)}
    with pytest.raises(FlintError, match=r"missing kernel_floor_us"):
        device_from_dict(dev)
    with pytest.raises(FlintError, match="unknown calibration 'nope'"):
        device_from_dict({**dev, "calibration": "nope"})


def test_bad_device_numbers_are_errors():
    base = {"name": "x", "peak_tflops_bf16": 100.0, "hbm_capacity_gib": 16.0, "hbm_bandwidth_gbytes_per_s": 1000.0}
    with pytest.raises(FlintError, match=r"peak_tflops_bf16 = 0.0 must be a positive finite number"):
        device_from_dict({**base, "peak_tflops_bf16": 0.0})
    # an infinite capacity (TOML's inf, or 1e400) was accepted and crashed the memory check (fuzz, seed 40)
    with pytest.raises(FlintError, match=r"hbm_capacity_gib = inf must be a positive finite number"):
        device_from_dict({**base, "hbm_capacity_gib": float("inf")})
    with pytest.raises(FlintError, match=r"sm_count = 1.5 must be a positive integer"):
        device_from_dict({**base, "sm_count": 1.5})


def test_sustained_fraction_divides_every_compute_kernels_time(tmp_path):
    slow = H100.calibrated({"sustained_fraction": 0.8})
    assert H100.calibration.sustained_fraction == 1.0  # the presets leave it out: no source measures it
    assert mm(4096, 4096, 4096, slow) == pytest.approx(mm(4096, 4096, 4096) / 0.8)  # GEMM model
    sdpa = op_cost("aten._scaled_dot_product_flash_attention.default", [(1, 16, 2048, 128)] * 3, "bf16",
                   [(1, 16, 2048, 128)], "bf16", {"is_causal": True})
    assert sdpa.attention_seq is not None  # the attention model prices it
    assert slow.op_time_us(sdpa) == pytest.approx(H100.op_time_us(sdpa) / 0.8)
    assert slow.compute_time_us(0, 1e9, "elementwise") == pytest.approx(
        H100.compute_time_us(0, 1e9, "elementwise") / 0.8)
    assert slow.compute_time_us(0, 0, "elementwise") == pytest.approx(3.0 / 0.8)  # the kernel floor too
    assert slow.compute_time_us_array([0.0, 1e12], [1e9, 0.0])[1] == pytest.approx(
        H100.compute_time_us_array([0.0, 1e12], [1e9, 0.0])[1] / 0.8)
    p = tmp_path / "dev.toml"
    p.write_text(slow.to_toml())
    assert load_device(p).calibration.sustained_fraction == 0.8  # round-trips


@pytest.mark.parametrize("value, message", [
    (0.0, r"sustained_fraction = 0.0 is out of range \(valid: 0 < sustained_fraction <= 1 \(fraction of the "
          r"calibrated kernel rates\)\)"),
    (1.2, r"sustained_fraction = 1.2 is out of range"),
    ("0.9", r"sustained_fraction = '0.9' must be a number"),
])
def test_out_of_range_sustained_fraction_names_key_and_range(value, message):
    with pytest.raises(FlintError, match=message):
        parse_calibration({**COMPLETE, "sustained_fraction": value}, "cal.toml")
    with pytest.raises(FlintError, match=message):
        load_device("h100-sxm", calibration={"sustained_fraction": value})


def test_the_shipped_fitted_calibrations_load_by_name_and_say_they_are_fitted():
    """flint/devices/calibration/fitted/<device>.toml (bench/accuracy.py writes them): each loads onto its
    device by name, as `--calibration fitted/<device>`, sets only the sustained fraction, and says it is
    fitted and on which rows."""
    assert list_overrides() == ["fitted/a100-80gb", "fitted/h100-sxm"]  # the devices with public rows
    for name in list_overrides():
        device = name.split("/")[1]
        dev = load_device(device, calibration=name)
        assert 0.5 < dev.calibration.sustained_fraction < 1.0
        assert replace(dev.calibration, sustained_fraction=1.0) == load_device(device).calibration
        text = shipped_override(name).read_text()
        assert text.startswith("# FITTED, not sourced") and "leave-one-configuration-out" in text
        assert load_device(device, calibration="fitted").calibration == dev.calibration  # the device's own
    with pytest.raises(FlintError, match=r"calibration file 'fitted/h200' does not exist \(or name a shipped "
                                         r"one: fitted, fitted/a100-80gb, fitted/h100-sxm\)"):
        load_device("h200", calibration="fitted/h200")
    with pytest.raises(FlintError, match=r"no fitted calibration for device 'h200' \(fitted: a100-80gb, h100-sxm\)"):
        load_device("h200", calibration="fitted")
    # a file for another device is refused, not silently applied
    with pytest.raises(FlintError, match=r"h100-sxm\.toml: a calibration for device 'h100-sxm', not 'a100-80gb'"):
        load_device("a100-80gb", calibration="fitted/h100-sxm")
