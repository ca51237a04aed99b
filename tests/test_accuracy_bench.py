"""bench/accuracy.py: capturing two blocks and repeating the block to the row's depth gives the
estimate of a capture at full depth (the IR has one body per repeated block)."""

import importlib.util
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
