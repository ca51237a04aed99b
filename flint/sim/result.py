"""What a simulation reports: iteration time, busy times, exposed comm, MFU.

Definitions (per rank; arrays are indexed by rank):

``iteration_time_us``  latest finish of any node of any rank (all ranks start at 0).
``finish_us``          when the rank's last node finishes.
``compute_busy_us``    time the compute stream runs nodes (sum of compute durations).
``comm_time_us``       time at least one transfer (collective or send/recv) of the
                       rank is in flight: the union of [start, finish] of its
                       communication nodes; waiting for peers is not counted.
``comm_wait_us``       sum over communication nodes of issue -> start (waiting for
                       the slowest partner).
``exposed_comm_us``    communication time not overlapped by compute: the measure of
                       (union of comm intervals) minus (compute intervals).
``busy_us``            time the rank does anything: union of compute and comm.
``port_slowed_us``     how much later the rank's transfers (collectives, sends) finished
                       than alone on their ports: the sum of their delays from sharing a
                       port with other traffic (NIC sharing; overlapping delays add up).
``mfu``                model FLOPs / (iteration time × world size × device peak);
                       model FLOPs default to the sum of the trace's compute-node
                       FLOPs over all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flint.sim.engine import COMPUTE, RawSim


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals covering the given ones (zero-length dropped)."""
    keep = ends > starts
    s, e = starts[keep], ends[keep]
    if s.size == 0:
        return s, e
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    run_end = np.maximum.accumulate(e)
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    idx = np.nonzero(new)[0]
    return s[idx], np.maximum.reduceat(e, idx)


def _covered(s: np.ndarray, e: np.ndarray, t: np.ndarray) -> np.ndarray:
    """For disjoint sorted intervals (s, e): measure of their part in [0, t], for each t."""
    if s.size == 0:
        return np.zeros_like(t)
    prefix = np.concatenate([[0.0], np.cumsum(e - s)])
    k = np.searchsorted(s, t, side="right") - 1
    inside = np.where(k >= 0, np.clip(t - s[np.maximum(k, 0)], 0.0, (e - s)[np.maximum(k, 0)]), 0.0)
    return prefix[np.maximum(k, 0)] * (k >= 0) + inside


def _overlap(a_s, a_e, b_s, b_e) -> float:
    """Measure of the intersection of two disjoint sorted interval sets."""
    return float(np.sum(_covered(b_s, b_e, a_e) - _covered(b_s, b_e, a_s)))


@dataclass
class SimResult:
    """The summary of one simulated iteration (module docstring for definitions)."""

    world_size: int
    iteration_time_us: float
    finish_us: np.ndarray
    compute_busy_us: np.ndarray
    comm_time_us: np.ndarray
    comm_wait_us: np.ndarray
    exposed_comm_us: np.ndarray
    busy_us: np.ndarray
    total_flops: float
    model_flops: float
    peak_flops_per_s: float
    mfu: float
    nodes: int
    simulated_nodes: int
    events: int
    wall_s: float
    symmetric: bool
    simulated_ranks: list[int]
    raw: RawSim = field(repr=False)
    port_slowed_us: np.ndarray | None = None

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else float("inf")

    def summary(self) -> str:
        """A short human-readable report."""
        w = self.world_size
        return (f"iteration {self.iteration_time_us / 1e3:.3f} ms on {w} ranks "
                f"({len(self.simulated_ranks)} simulated{', symmetric' if self.symmetric else ''}); "
                f"compute busy {self.compute_busy_us.mean() / 1e3:.3f} ms/rank, "
                f"comm {self.comm_time_us.mean() / 1e3:.3f} ms/rank, "
                f"exposed comm {self.exposed_comm_us.mean() / 1e3:.3f} ms/rank, MFU {self.mfu:.1%}")


def summarize(raw: RawSim, peak_flops_per_s: float, model_flops: float | None = None) -> SimResult:
    """Build a :class:`SimResult` from the engine's per-node times."""
    trace = raw.trace
    world = trace.world_size
    fin = np.zeros(world)
    comp = np.zeros(world)
    comm = np.zeros(world)
    wait = np.zeros(world)
    exposed = np.zeros(world)
    busy = np.zeros(world)
    slowed = np.zeros(world)
    for s, ranks in enumerate(raw.classes):
        plan = raw.plans[s]
        st, en, iss = raw.start_us[s], raw.finish_us[s], raw.issue_us[s]
        is_comp = np.asarray(plan.stream) == COMPUTE
        c_s, c_e = _union(st[is_comp], en[is_comp])
        m_s, m_e = _union(st[~is_comp], en[~is_comp])
        a_s, a_e = _union(st, en)
        idx = np.asarray(ranks)
        fin[idx] = float(en.max()) if en.size else 0.0
        comp[idx] = float(np.sum(en[is_comp] - st[is_comp]))
        comm[idx] = float(np.sum(m_e - m_s))
        wait[idx] = float(np.sum(st[~is_comp] - iss[~is_comp]))
        exposed[idx] = float(np.sum(m_e - m_s)) - _overlap(m_s, m_e, c_s, c_e)
        busy[idx] = float(np.sum(a_e - a_s))
        if raw.port_slowed_us is not None:
            slowed[idx] = raw.port_slowed_us[s]
    per_table: dict[int, float] = {}
    total_flops = 0.0
    for p in trace.ranks:
        f = per_table.get(id(p.table))
        if f is None:
            f = per_table[id(p.table)] = float(np.clip(p.table.flops, 0, None).sum(dtype=np.float64))
        total_flops += f
    mf = total_flops if model_flops is None else float(model_flops)
    it = float(fin.max()) if world else 0.0
    mfu = mf / (it * 1e-6 * world * peak_flops_per_s) if it > 0 and peak_flops_per_s > 0 else 0.0
    nodes = sum(len(p.table) for p in trace.ranks)
    return SimResult(world, it, fin, comp, comm, wait, exposed, busy, total_flops, mf, peak_flops_per_s, mfu,
                     nodes, sum(len(p.table) for p in raw.plans), raw.events, raw.wall_s, raw.symmetric,
                     list(raw.sim_ranks), raw, slowed)
