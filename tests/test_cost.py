"""Cost model: dtypes, FLOPs and bytes per ATen op, device presets and the roofline."""

import math

import pytest
import torch

from flint.cost import load_device, list_devices, op_bytes, op_cost, op_flops
from flint.cost.dtypes import dtype_bytes, tensor_bytes
from flint.errors import FlintError


@pytest.mark.parametrize("spelling,size", [("bf16", 2), ("bfloat16", 2), (torch.bfloat16, 2), ("torch.float32", 4),
                                           ("f32", 4), ("f8E4M3FN", 1), ("i64", 8), ("bool", 1), ("fp16", 2),
                                           (torch.complex64, 8), ("complex<f32>", 8), ("complex<f64>", 16)])
def test_dtype_bytes(spelling, size):
    assert dtype_bytes(spelling) == size


def test_unknown_dtype_is_a_flint_error():
    with pytest.raises(FlintError, match="unknown dtype 'qint3'"):
        dtype_bytes("qint3")


def test_tensor_bytes():
    assert tensor_bytes((4, 8), "bf16") == 64
    assert tensor_bytes((), "f32") == 4


def test_gemm_flops_by_hand():
    m, k, n = 16, 32, 8
    assert op_flops("aten.mm.default", [(m, k), (k, n)], [(m, n)]) == 2 * m * k * n
    assert op_flops("aten.addmm.default", [(n,), (m, k), (k, n)], [(m, n)]) == 2 * m * k * n
    assert op_flops("aten::bmm", [(3, m, k), (3, k, n)], [(3, m, n)]) == 3 * 2 * m * k * n
    assert op_flops("aten.baddbmm.default", [(3, m, n), (3, m, k), (3, k, n)], [(3, m, n)]) == 3 * 2 * m * k * n
    assert op_flops("aten._scaled_mm.default", [(m, k), (k, n), (), ()], [(m, n)]) == 2 * m * k * n
    # ops PyTorch's registry lacks, same 2*M*N*K convention
    assert op_flops("aten.linear.default", [(2, 5, k), (n, k), (n,)], [(2, 5, n)]) == 2 * 10 * k * n
    assert op_flops("aten._grouped_mm.default", [(40, k), (4, k, n)], [(40, n)]) == 2 * 40 * k * n


@pytest.mark.parametrize("target", ["aten._scaled_dot_product_flash_attention.default",
                                    "aten._scaled_dot_product_efficient_attention.default",
                                    "aten._scaled_dot_product_cudnn_attention.default"])
def test_attention_forward_flops_by_hand(target):
    b, h, s, d = 2, 8, 128, 64
    # QK^T and PV: two batched matmuls of 2*s*s*d per head
    assert op_flops(target, [(b, h, s, d)] * 3, [(b, h, s, d)]) == 4 * b * h * s * s * d


@pytest.mark.parametrize("target", ["aten._scaled_dot_product_flash_attention_backward.default",
                                    "aten._scaled_dot_product_efficient_attention_backward.default",
                                    "aten._scaled_dot_product_cudnn_attention_backward.default"])
def test_attention_backward_flops_by_hand(target):
    b, h, s, d = 2, 8, 128, 64
    # recompute QK^T, then dV, dP, dQ, dK: five batched matmuls
    assert op_flops(target, [(b, h, s, d)] * 5, []) == 10 * b * h * s * s * d


def test_attention_gqa_counts_query_heads():
    b, hq, hkv, s, d = 1, 8, 2, 64, 32
    got = op_flops("aten._scaled_dot_product_flash_attention.default",
                   [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)], [(b, hq, s, d)])
    assert got == 4 * b * hq * s * s * d


def test_conv_flops_by_hand():
    # 8 output channels x 3 input channels x 3x3 kernel x 30x30 outputs x 2
    got = op_flops("aten.convolution.default", [(1, 3, 32, 32), (8, 3, 3, 3), None], [(1, 8, 30, 30)],
                   [(1, 1), (0, 0), (1, 1), False, (0, 0), 1])
    assert got == 2 * 8 * 3 * 9 * 900


def test_pointwise_ops_count_zero_flops_like_pytorch():
    assert op_flops("aten.add.Tensor", [(4, 4), (4, 4)], [(4, 4)]) == 0
    assert op_flops("aten.native_layer_norm.default", [(4, 4), (4,), (4,)], [(4, 4), (4, 1), (4, 1)], [[4], 1e-5]) == 0


@pytest.mark.slow  # the first FlopCounterMode run costs a few seconds of torch start-up
def test_matches_flop_counter_mode_on_real_tensors():
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(6, 10), torch.randn(10, 12)
    with FlopCounterMode(display=False) as fc:
        torch.mm(x, w)
    assert op_flops("aten.mm.default", [(6, 10), (10, 12)], [(6, 12)]) == fc.get_total_flops()


def test_gathers_read_the_selected_rows_not_the_whole_source():
    # an embedding lookup of 16 tokens in a 50,000 x 64 bf16 table: 16 rows read, the index, 16 rows written
    c = op_cost("aten.embedding.default", [(50_000, 64), (16,)], ["bf16", "i64"], [(16, 64)], ["bf16"])
    assert c.bytes == 16 * 64 * 2 + 16 * 8 + 16 * 64 * 2
    c = op_cost("aten.index_select.default", [(50_000, 64), (16,)], ["f32", "i64"], [(16, 64)], ["f32"],
                {"dim": 0})
    assert c.bytes == 16 * 64 * 4 + 16 * 8 + 16 * 64 * 4
    # never more than the source: a gather whose output is larger than its source reads the source once
    c = op_cost("aten.gather.default", [(4,), (64,)], ["f32", "i64"], [(64,)], ["f32"], {"dim": 0})
    assert c.bytes == 4 * 4 + 64 * 8 + 64 * 4


def test_op_bytes_sums_inputs_and_outputs():
    assert op_bytes([(4, 8), (8, 2)], "bf16", [(4, 2)], "f32") == 4 * 8 * 2 + 8 * 2 * 2 + 4 * 2 * 4
    assert op_bytes([(4,), None], ["f32", None], [(4,)], ["f32"]) == 32


def test_op_cost_classes_and_views():
    c = op_cost("aten.mm.default", [(4, 8), (8, 2)], "bf16", [(4, 2)], "bf16")
    assert (c.op_class, c.flops, c.bytes) == ("gemm", 2 * 4 * 8 * 2, 64 + 32 + 16)
    assert op_cost("aten.add.Tensor", [(4, 4), (4, 4)], "f32", [(4, 4)], "f32").op_class == "elementwise"
    v = op_cost("aten.view.default", [(4, 4)], "f32", [(16,)], "f32")
    assert (v.op_class, v.flops, v.bytes) == ("view", 0, 0)


def test_causal_attention_work_fraction():
    s = 4
    c = op_cost("aten._scaled_dot_product_flash_attention.default", [(1, 1, s, 8)] * 3, "bf16",
                [(1, 1, s, 8)], "bf16", {"is_causal": True})
    assert c.work_fraction == pytest.approx((1 + 2 + 3 + 4) / 16)
    assert c.flops == 4 * s * s * 8  # model FLOPs are not discounted
    nc = op_cost("aten._scaled_dot_product_flash_attention.default", [(1, 1, s, 8)] * 3, "bf16", [(1, 1, s, 8)], "bf16")
    assert nc.work_fraction == 1.0


def test_all_presets_load_with_sane_numbers():
    assert set(list_devices()) >= {"a100-40gb", "a100-80gb", "h100-sxm", "h100-96gb-hbm2e", "h200", "b200", "mi300x"}
    for name in list_devices():
        d = load_device(name)
        assert d.peak_tflops["bf16"] >= d.peak_tflops["tf32"] > d.peak_tflops["fp32"] > 0
        assert 0 < d.compute_eff("gemm") <= 1 and 0 < d.memory_eff("elementwise") <= 1
        assert d.hbm_capacity_gib >= 40 and d.hbm_bandwidth_gbytes_per_s > 1000
        assert d.sm_count and d.power_limit_w and d.calibration.gemm and d.calibration.attention


def test_roofline_by_hand():
    d = load_device("h100-sxm", calibration={"compute_efficiency": {"gemm": 0.7}})
    f = 2 * 8192 ** 3
    assert d.compute_time_us(f, 0, "gemm") == pytest.approx(f / (989.4e12 * 0.7) * 1e6)
    nbytes = 3 * 2 ** 30
    assert d.compute_time_us(0, nbytes, "elementwise") == pytest.approx(nbytes / (3350e9 * 0.867) * 1e6)
    assert d.compute_time_us(10, 10, "elementwise") == d.kernel_floor_us == 3.0
    assert d.compute_time_us(10, 10, "view") == 0.0
    arr = d.compute_time_us_array([f, 0, 10], [0, nbytes, 10], "gemm")
    assert arr[0] == pytest.approx(d.compute_time_us(f, 0, "gemm"))
    assert arr[2] == 3.0


def test_calibration_overrides_per_class(tmp_path):
    cal = tmp_path / "cal.toml"
    cal.write_text("kernel_floor_us = 2.5\n[compute_efficiency]\ngemm = 0.9\n")
    d = load_device("h100-sxm", calibration=cal)
    assert d.compute_eff("gemm") == 0.9 and d.compute_eff("attention") == pytest.approx((0.39 + 0.283) / 2)  # PyTorch SDPA: FA2
    assert d.kernel_floor_us == 2.5
    assert d.calibration.gemm == load_device("h100-sxm").calibration.gemm  # other keys keep the preset's
    with pytest.raises(FlintError, match="unknown op class 'gemmm'"):
        load_device("h100-sxm", calibration={"compute_efficiency": {"gemmm": 0.9}})
    with pytest.raises(FlintError, match="must be in"):
        load_device("h100-sxm", calibration={"memory_efficiency": {"default": 1.5}})


def test_unknown_device_lists_valid_names():
    with pytest.raises(FlintError) as e:
        load_device("h100")
    assert "unknown device 'h100'" in str(e.value) and "h100-sxm" in str(e.value) and "mi300x" in str(e.value)


def test_device_without_fp8_says_so():
    with pytest.raises(FlintError, match="no peak for dtype 'fp8'"):
        load_device("a100-80gb").peak_flops_per_s("fp8")
    assert load_device("h100-sxm").peak_flops_per_s("float8_e4m3fn") == pytest.approx(1978.9e12)


def test_device_from_a_toml_path(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('name = "mine"\npeak_tflops_bf16 = 100.0\nhbm_capacity_gib = 16.0\n'
                 'hbm_bandwidth_gbytes_per_s = 1000.0\nkernel_floor_us = 1.0\n')
    d = load_device(p)
    assert d.name == "mine" and math.isclose(d.compute_time_us(1e12, 0, "gemm"), 1e12 / (100e12 * 0.5) * 1e6)
    p.write_text('name = "bad"\npeak_tflops_bf16 = 1.0\nhbm_capacity_gib = 1\nhbm_bandwidth_gbytes_per_s = 1\nhbm_bw = 3\n')
    with pytest.raises(FlintError, match="unknown keys \\['hbm_bw'\\]"):
        load_device(p)
