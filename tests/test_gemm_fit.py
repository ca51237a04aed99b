"""The GEMM model's per-device fit to published per-shape measurements (flint.cost.gemm_fit)."""

import math
from dataclasses import replace

import pytest

from flint.cost import load_device
from flint.cost import gemm_fit as gf
from flint.errors import FlintError

H100_DATA = gf.DATA_DIR / "h100-sxm-gemm.csv"


def test_h100_data_is_the_published_table_with_its_source():
    points = gf.load_points(H100_DATA)
    assert len(points) == 375  # b in {1, 2, 4} x m, n, k in {256, ..., 4096}
    assert {p.batch for p in points} == {1, 2, 4} and {p.m for p in points} == {256, 512, 1024, 2048, 4096}
    head = H100_DATA.read_text().split("batch,m,n,k")[0]
    assert "openxla/xla, commit 71feeddf7c" in head and "matmul_interpolator_data.h" in head
    # H100 SXM, not PCIe: some shapes beat the PCIe card's 756 TFLOP/s dense peak, none the SXM's 989
    assert 756e12 < max(p.flops_per_s for p in points) < 989.4e12


def test_h100_calibration_reproduces_the_published_gemm_times():
    h100 = load_device("h100-sxm")
    points = gf.load_points(H100_DATA)
    errors = [abs(math.expm1(e)) for e in gf.log_errors(h100, points)]
    assert sum(errors) / len(errors) < 0.05 and sorted(errors)[len(errors) // 2] < 0.04 and max(errors) < 0.30
    # the estimates it replaced (no latency, k_overhead 128, guessed tile throughputs) were 34% too fast
    old = replace(h100.calibration.gemm, mainloop_fraction=None, latency_us=0.0, k_overhead=128.0,
                  tiles=((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.92), (128, 64, 0.8), (64, 64, 0.6)))
    before = gf.log_errors(gf._with_gemm(h100, old), points)
    assert math.expm1(sum(before) / len(before)) < -0.3
    # the H100 96 GB and H200 share the silicon and so the fit
    for name in ("h100-96gb-hbm2e", "h200"):
        assert load_device(name).calibration.gemm == h100.calibration.gemm


def _synthetic(model, shapes, device):
    """Points whose times are ``device`` with GEMM ``model``'s own prices."""
    dev = gf._with_gemm(device, model)
    pts = [gf.GemmPoint(b, m, n, k, 1.0) for b, m, n, k in shapes]
    return [replace(p, flops_per_s=2 * p.batch * p.m * p.n * p.k / (dev.op_time_us(c) * 1e-6))
            for p, c in zip(pts, gf._costs(pts))]


SHAPES = [(1, m, n, k) for m in (256, 1024, 4096) for n in (512, 2048) for k in (256, 1024, 4096)]


def test_fit_recovers_the_parameters_that_made_the_data():
    h100 = load_device("h100-sxm")
    truth = replace(h100.calibration.gemm, latency_us=3.0, k_overhead=64.0)
    points = _synthetic(truth, SHAPES, h100)
    start = replace(truth, latency_us=0.0, k_overhead=300.0)
    fitted, loss = gf.fit_gemm(h100, points, ("latency_us", "k_overhead"), start=start)
    assert fitted.latency_us == pytest.approx(3.0, rel=0.03) and fitted.k_overhead == pytest.approx(64.0, rel=0.1)
    assert loss < 1e-4


def test_leave_one_out_exposes_a_point_the_model_cannot_explain():
    h100 = load_device("h100-sxm")
    truth = replace(h100.calibration.gemm, latency_us=4.0)
    points = _synthetic(truth, SHAPES[:8], h100)
    points[3] = replace(points[3], flops_per_s=points[3].flops_per_s / 2)  # measured twice as slow
    fitted, _ = gf.fit_gemm(h100, points, ("latency_us",))
    held_out = gf.leave_one_out(h100, points, fitted, ("latency_us",))
    assert held_out[3] < -0.5  # predicted ~half the measured time once it no longer pulls the fit
    assert max(abs(e) for i, e in enumerate(held_out) if i != 3) < abs(held_out[3]) / 2


def test_fit_cli_and_bad_data_files(tmp_path, capsys):
    h100 = load_device("h100-sxm")
    data = tmp_path / "g.csv"
    rows = "\n".join(f"{p.batch},{p.m},{p.n},{p.k},{p.flops_per_s:.0f}"
                     for p in _synthetic(h100.calibration.gemm, SHAPES[:4], h100))
    data.write_text(f"# made up\nbatch,m,n,k,flops_per_s\n{rows}\n")
    assert gf.main([str(data), "--device", "h100-sxm", "--params", "latency_us", "--loo"]) == 0
    out = capsys.readouterr().out
    assert "latency_us = 5.1" in out and "leave-one-out: 4 points" in out
    bad = tmp_path / "bad.csv"
    bad.write_text("batch,m,n,k,flops_per_s\n1,256,256,256,1e12\n1,256,x,256,1e12\n")
    with pytest.raises(FlintError, match=rf"{bad}:3: expected 4 positive integers"):
        gf.load_points(bad)
    bad.write_text("b,m,n,k\n")
    with pytest.raises(FlintError, match="header batch,m,n,k,flops_per_s"):
        gf.load_points(bad)
    assert gf.main([str(bad), "--device", "h100-sxm"]) == 1
    assert "gemm_fit: error:" in capsys.readouterr().err
    with pytest.raises(FlintError, match="cannot fit 'peak_fraction'"):
        gf.fit_gemm(h100, gf.load_points(data), ("peak_fraction",))
