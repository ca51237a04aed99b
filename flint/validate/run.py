"""Validate one case end to end: real run, conversion, counting, Flint capture, comparison, import, simulation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from flint.validate.compare import Case, FlintCounts, Row, compare, flint_counts
from flint.validate.executed import RankCounts, check_against_converted, count_host_trace
from flint.validate.realrun import RunSpec, run_real


@dataclass
class CaseResult:
    """Everything the report shows about one case."""

    case: Case
    flint: FlintCounts
    ranks: list[RankCounts]
    rows: list[Row]
    converter_problems: list[str] = field(default_factory=list)  # counted op missing from the converted trace
    trace_problems: list[str] = field(default_factory=list)  # check_trace on the imported real trace
    imported_nodes: int = 0
    imported_collectives: int = 0
    simulated_us: float = 0.0  # the imported real trace through flint.sim.simulate
    measured_step_us: float = 0.0  # wall time of the traced step, slowest rank
    real_s: float = 0.0
    capture_s: float = 0.0


def validate_case(case: Case, *, work_dir: str | Path | None = None, timeout_s: float = 180.0,
                  keep: bool = False) -> CaseResult:
    """Run ``case`` for real and with Flint and compare (see :mod:`flint.validate`)."""
    from flint.chakra import check_trace, read_trace
    from flint.cost import load_network
    from flint.mesh import Mesh
    from flint.sim import simulate
    from flint.validate.imported import import_executed_trace

    t0 = time.perf_counter()
    real = run_real(RunSpec(case.model, case.plan, case.world_size, case.batch, tp=case.tp, timeout_s=timeout_s,
                            ac=case.ac, loss_parallel=case.loss_parallel,
                            max_norm=case.max_norm, optimizer_impl=case.optimizer_impl), work_dir)
    try:
        real_s = time.perf_counter() - t0
        ranks = [count_host_trace(h, r, k) for r, (h, k) in enumerate(zip(real.host_traces, real.kineto_traces))]
        shape, axes = case.mesh()
        trace = import_executed_trace(real.chakra_dir, ranks, Mesh(shape, axes))
        raw = read_trace(real.chakra_dir)  # as converted: every counted op must be there
        conv = [p for rc, prog in zip(ranks, raw.ranks) for p in check_against_converted(rc, prog.table)]
        problems = [str(p) for p in check_trace(trace)]
        sim = simulate(trace, None, load_network("switch"), Mesh(shape, axes), symmetric=False)
        n_nodes = sum(len(p.table) for p in trace.ranks)
        n_colls = sum(len(rc.collective_ops) for rc in ranks)
        measured = max(real.step_wall_us)
    finally:
        if not keep:
            real.cleanup()
    t1 = time.perf_counter()
    flint = flint_counts(case)
    capture_s = time.perf_counter() - t1
    return CaseResult(case, flint, ranks, compare(flint, ranks), conv, problems, n_nodes, n_colls,
                      float(sim.iteration_time_us), measured, real_s, capture_s)

