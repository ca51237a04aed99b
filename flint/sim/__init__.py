"""Flint's embedded simulator: run a :class:`~flint.trace.Trace` on a device and network model.

>>> from flint.cost import load_device, load_network
>>> res = simulate(trace, load_device("h100-sxm"), load_network("dgx-h100"))   # doctest: +SKIP
>>> res.iteration_time_us, res.mfu                                           # doctest: +SKIP

The model (streams, collective synchronization, symmetric-rank reduction,
deadlock detection) is described in :mod:`flint.sim.engine`; the reported
quantities in :mod:`flint.sim.result`; the timeline in :mod:`flint.sim.chrome`.
Peak memory per rank from the step IR's tensor lifetimes is
:func:`flint.sim.lifetimes.step_memory` (over :func:`peak_memory`); the
``flint estimate`` / ``flint simulate`` commands and their report live in
:mod:`flint.sim.cli` and :mod:`flint.sim.report` (imported on demand: they
pull in xDSL and the passes).
"""

from __future__ import annotations

from typing import Mapping

from flint.cost.device import Device
from flint.cost.network import Network
from flint.mesh import Mesh
from flint.sim.chrome import chrome_trace_events, write_chrome_trace
from flint.sim.engine import SimDeadlock, run
from flint.sim.memory import MemoryReport, peak_memory
from flint.sim.result import SimResult, summarize
from flint.trace import Trace


def simulate(trace: Trace, device: Device | None, network: Network, mesh: Mesh | None = None, *,
             algorithm: str | Mapping = "ring", dtype: str = "bf16", model_flops: float | None = None,
             symmetric: bool = True) -> SimResult:
    """Simulate one iteration of ``trace``.

    ``device`` prices compute nodes without ``duration_us`` and gives the peak
    for MFU (``None`` if every compute node has a duration; MFU is then 0);
    ``network`` prices collectives and send/recv (its outermost size-0
    dimension is filled for the trace's world size); ``mesh``, if given, must
    have the trace's world size. ``algorithm`` is one collective algorithm for
    every kind or a mapping kind -> algorithm (default ``ring``); ``dtype``
    selects the device peak; ``model_flops`` overrides the FLOPs used for MFU;
    ``symmetric=False`` simulates every rank even when classes of identical
    ranks could be simulated once.
    """
    raw = run(trace, device, network, mesh, algorithm=algorithm, dtype=dtype, symmetric=symmetric)
    peak = device.peak_flops_per_s(dtype) if device is not None else 0.0
    return summarize(raw, peak, model_flops)


__all__ = ["simulate", "SimResult", "SimDeadlock", "write_chrome_trace", "chrome_trace_events", "peak_memory",
           "MemoryReport"]
