"""Fit a device's GEMM model once to published per-shape GEMM measurements, with leave-one-out.

The GEMM model (:mod:`flint.cost.compute`) has parameters no datasheet gives:
the smaller tiles' relative throughputs, the per-tile ``k_overhead``, the
main-loop rate and the fixed per-kernel ``latency_us``. Where a public
per-shape microbenchmark exists for a device, this module fits them to it
*once*; the data ships beside the calibration
(``flint/devices/calibration/data/<device>-gemm.csv``, its source in its
header) and the fitted values go into the device's calibration TOML by hand,
with a comment naming the data. Training runs are never used.

The fit minimises the mean squared log error of the predicted kernel time,
where the prediction is the device's own pricing of an ``aten.bmm`` of that
shape (:meth:`flint.cost.Device.op_time_us`), so the fitted model is the one
Flint runs. The search is a deterministic coordinate (pattern) search: each
parameter in turn is moved up or down by a step, kept if the loss drops, and
the steps halve when no move helps (no scipy). :func:`leave_one_out` refits
with each point held out (started from the full fit) and reports the held-out
point's error: the model's error on shapes it was not fitted to.

``python -m flint.cost.gemm_fit DATA.csv --device h100-sxm [--loo]`` prints the
fit, its in-sample and (with ``--loo``) leave-one-out errors.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from flint.cost.compute import GemmModel
from flint.errors import FlintError, run_cli

DATA_DIR = Path(__file__).resolve().parent.parent / "devices" / "calibration" / "data"

# The parameters a fit may move, their bounds and whether they step multiplicatively (fractions)
# or additively (in units of ``scale``).
_BOUNDS = {"mainloop_fraction": (0.05, 1.0), "k_overhead": (0.0, 4096.0), "latency_us": (0.0, 1000.0),
           "rel1": (0.05, 1.0), "rel2": (0.05, 1.0), "rel3": (0.05, 1.0), "rel4": (0.05, 1.0)}
_ADDITIVE = {"k_overhead": 64.0, "latency_us": 1.0}
DEFAULT_PARAMS = ("mainloop_fraction", "k_overhead", "latency_us", "rel2", "rel3", "rel4")


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: ``batch`` products of ``m x n x k`` at ``flops_per_s``."""

    batch: int
    m: int
    n: int
    k: int
    flops_per_s: float

    @property
    def time_us(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k / self.flops_per_s * 1e6


def load_points(path: str | Path) -> list[GemmPoint]:
    """The rows of a GEMM data CSV (``#`` comment lines, then ``batch,m,n,k,flops_per_s``)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise FlintError(f"cannot read GEMM data file '{path}': {e.strerror}") from None
    body = [(i + 1, line) for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    want = ["batch", "m", "n", "k", "flops_per_s"]
    if not body or [c.strip() for c in next(csv.reader([body[0][1]]))] != want:
        raise FlintError(f"{path}: the first non-comment line must be the header {','.join(want)}")
    points = []
    for lineno, line in body[1:]:
        cells = [c.strip() for c in next(csv.reader([line]))]
        try:
            if len(cells) != 5:
                raise ValueError
            b, m, n, k = (int(c) for c in cells[:4])
            f = float(cells[4])
            if min(b, m, n, k) < 1 or not f > 0 or math.isinf(f):
                raise ValueError
        except ValueError:
            raise FlintError(f"{path}:{lineno}: expected 4 positive integers and a positive flops_per_s, "
                             f"got {line!r}") from None
        points.append(GemmPoint(b, m, n, k, f))
    if not points:
        raise FlintError(f"{path}: no data rows")
    return points


def _costs(points: Sequence[GemmPoint]):
    from flint.cost import op_cost
    return [op_cost("aten.bmm.default", [(p.batch, p.m, p.k), (p.batch, p.k, p.n)], "bf16",
                    [(p.batch, p.m, p.n)], "bf16") for p in points]


def _with_gemm(device, gemm: GemmModel):
    return replace(device, calibration=replace(device.calibration, gemm=gemm))


def log_errors(device, points: Sequence[GemmPoint], costs=None) -> list[float]:
    """ln(predicted / measured) kernel time per point, priced by ``device`` as an ``aten.bmm``."""
    costs = _costs(points) if costs is None else costs
    return [math.log(device.op_time_us(c) / p.time_us) for c, p in zip(costs, points)]


def _get(g: GemmModel, name: str) -> float:
    if name.startswith("rel"):
        return g.tiles[int(name[3:])][2]
    if name == "mainloop_fraction" and g.mainloop_fraction is None:
        return g.peak_fraction
    return float(getattr(g, name))


def _set(g: GemmModel, name: str, v: float) -> GemmModel:
    if name.startswith("rel"):
        i = int(name[3:])
        tiles = list(g.tiles)
        tiles[i] = (tiles[i][0], tiles[i][1], v)
        return replace(g, tiles=tuple(tiles))
    if name == "mainloop_fraction":
        v = max(v, g.peak_fraction)  # the main loop is never slower than the ceiling it must reach
    return replace(g, **{name: v})


def fit_gemm(device, points: Sequence[GemmPoint], params: Sequence[str] = DEFAULT_PARAMS, *,
             start: GemmModel | None = None, step: float = 0.3, tol: float = 1e-3, max_evals: int = 4000,
             costs=None) -> tuple[GemmModel, float]:
    """``device``'s GEMM model with ``params`` fitted to ``points``: (model, mean squared log error).

    ``peak_fraction`` (the sourced MAMF ceiling), the tile shapes and ``max_split_k`` stay as the
    device has them. ``rel<i>`` is the relative throughput of the device's i-th tile."""
    g = start or device.calibration.gemm
    if g is None:
        raise FlintError(f"device '{device.name}' has no GEMM model to fit")
    for name in params:
        if name not in _BOUNDS:
            raise FlintError(f"cannot fit '{name}' (valid: {', '.join(_BOUNDS)})")
        if name.startswith("rel") and int(name[3:]) >= len(g.tiles):
            raise FlintError(f"cannot fit '{name}': device '{device.name}' has {len(g.tiles)} tiles")
    costs = _costs(points) if costs is None else costs

    def loss(model: GemmModel) -> float:
        e = log_errors(_with_gemm(device, model), points, costs)
        return sum(x * x for x in e) / len(e)

    best, evals = loss(g), 1
    steps = {name: step for name in params}
    while max(steps.values()) > tol and evals < max_evals:
        improved = False
        for name in params:
            lo, hi = _BOUNDS[name]
            v = _get(g, name)
            for sign in (1.0, -1.0):
                if name in _ADDITIVE:
                    w = v + sign * steps[name] * (abs(v) + _ADDITIVE[name])
                else:
                    w = v * math.exp(sign * steps[name] / 2)
                w = min(hi, max(lo, w))
                if w == v:
                    continue
                cand = _set(g, name, w)
                val = loss(cand)
                evals += 1
                if val < best - 1e-12:
                    g, best, improved = cand, val, True
                    break
        if not improved:
            steps = {name: s / 2 for name, s in steps.items()}
    return g, best


def leave_one_out(device, points: Sequence[GemmPoint], fitted: GemmModel,
                  params: Sequence[str] = DEFAULT_PARAMS, *, step: float = 0.05, tol: float = 2e-3,
                  **kw) -> list[float]:
    """Held-out ln(predicted / measured) of each point, its model fitted to all the others
    (each refit starts from ``fitted``, the fit to every point, with smaller first steps)."""
    costs = _costs(points)
    out = []
    for i in range(len(points)):
        rest = [j for j in range(len(points)) if j != i]
        g, _ = fit_gemm(device, [points[j] for j in rest], params, start=fitted,
                        costs=[costs[j] for j in rest], step=step, tol=tol, **kw)
        out.append(log_errors(_with_gemm(device, g), [points[i]], [costs[i]])[0])
    return out


def summary(errors: Sequence[float]) -> str:
    """Error statistics of ln(predicted / measured) values, as percentages of the measured time."""
    a = sorted(abs(math.expm1(e)) for e in errors)
    med = a[len(a) // 2] if len(a) % 2 else (a[len(a) // 2 - 1] + a[len(a) // 2]) / 2
    bias = math.expm1(sum(errors) / len(errors))
    return (f"{len(a)} points: mean |error| {100 * sum(a) / len(a):.1f}%, median {100 * med:.1f}%, "
            f"90th percentile {100 * a[int(0.9 * (len(a) - 1))]:.1f}%, max {100 * a[-1]:.1f}%, "
            f"bias {100 * bias:+.1f}%")


def _describe(g: GemmModel) -> str:
    tiles = ", ".join(f"[{tm}, {tn}, {rel:.3f}]" for tm, tn, rel in g.tiles)
    return (f"peak_fraction = {g.peak_fraction}\nmainloop_fraction = {_get(g, 'mainloop_fraction'):.3f}\n"
            f"tiles = [{tiles}]\nk_overhead = {g.k_overhead:.1f}\nmax_split_k = {g.max_split_k}\n"
            f"latency_us = {g.latency_us:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flint.cost.gemm_fit", description=__doc__.split("\n")[0])
    ap.add_argument("data", help="GEMM data CSV (flint/devices/calibration/data/*.csv)")
    ap.add_argument("--device", required=True, help="device preset or device TOML whose GEMM model to fit")
    ap.add_argument("--params", default=",".join(DEFAULT_PARAMS),
                    help=f"comma-separated parameters to fit (default {','.join(DEFAULT_PARAMS)})")
    ap.add_argument("--loo", action="store_true", help="also report the leave-one-out error")
    args = ap.parse_args(argv)

    def run() -> int:
        from flint.cost import load_device
        device = load_device(args.device)
        points = load_points(args.data)
        params = [p for p in args.params.split(",") if p]
        print(f"device {device.name}: before the fit, {summary(log_errors(device, points))}")
        g, _ = fit_gemm(device, points, params)
        fitted = _with_gemm(device, g)
        print(_describe(g))
        print(f"in-sample: {summary(log_errors(fitted, points))}")
        if args.loo:
            print(f"leave-one-out: {summary(leave_one_out(device, points, g, params))}")
        return 0

    return run_cli("gemm_fit", run)


if __name__ == "__main__":
    raise SystemExit(main())
