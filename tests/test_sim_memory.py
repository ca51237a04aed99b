"""Peak memory from tensor lifetimes."""

import numpy as np
import pytest

from flint.cost import load_device
from flint.errors import FlintError
from flint.sim.memory import peak_memory


def test_peak_by_hand():
    # params live all step; two activations overlap at position 2; a comm buffer at 3
    r = peak_memory(alloc_bytes=[100, 10, 20, 5, 40],
                    free_after=[-1, 2, 4, 3, 4],
                    category=["params", "activations", "activations", "comm", "grads"],
                    alloc_pos=[0, 1, 2, 3, 4])
    assert r.live_bytes.tolist() == [100, 110, 130, 125, 160]
    assert (r.peak_bytes, r.peak_position) == (160, 4)
    assert r.at_peak_bytes == {"params": 100, "grads": 40, "optimizer": 0, "activations": 20, "comm": 0, "other": 0}
    assert r.category_peak_bytes["activations"] == 30 and r.category_peak_bytes["comm"] == 5


def test_default_positions_and_capacity():
    r = peak_memory([2 ** 30] * 3, [0, 1, 2], ["activations"] * 3, capacity_bytes=load_device("h100-sxm").hbm_capacity_bytes)
    assert r.peak_bytes == 2 ** 30 and r.fits
    big = peak_memory([90 * 2 ** 30], [-1], ["params"], capacity_bytes=load_device("h100-sxm").hbm_capacity_bytes)
    assert big.fits is False and "DOES NOT FIT" in big.summary()


def test_freed_before_allocated_is_an_error():
    with pytest.raises(FlintError, match="event 1 \\(activations\\) is freed after position 0, before its allocation at position 1"):
        peak_memory([1, 1], [1, 0], ["params", "activations"])
    with pytest.raises(FlintError, match="unknown memory categories \\['weights'\\]"):
        peak_memory([1], [-1], ["weights"])


def test_random_against_brute_force():
    rng = np.random.default_rng(0)
    n = 200
    pos = rng.integers(0, 50, n)
    free = np.where(rng.random(n) < 0.2, -1, pos + rng.integers(0, 20, n))
    nbytes = rng.integers(0, 1000, n)
    cats = rng.choice(["params", "activations", "comm"], n).tolist()
    r = peak_memory(nbytes, free, cats, alloc_pos=pos)
    horizon = int(max(pos.max(), free.max())) + 1
    brute = [sum(int(b) for b, a, f in zip(nbytes, pos, free) if a <= p and (f == -1 or p <= f)) for p in range(horizon)]
    assert r.live_bytes.tolist() == brute and r.peak_bytes == max(brute)
