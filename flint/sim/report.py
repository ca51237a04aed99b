"""The estimate report: one simulated iteration (+ peak memory) as a dict and a table.

:func:`estimate_report` gathers, from a :class:`~flint.sim.SimResult` (and
optionally a :class:`~flint.sim.lifetimes.StepMemory`), the numbers
``flint estimate`` prints; :func:`format_report` renders them as a text
table with units in the headings; the dict is what ``--json`` prints.

Per-rank quantities are reported as the mean and the max over ranks.
``comm by kind`` is, per collective kind (and ``send``/``recv``), the summed
transfer time of those nodes on a rank (start to finish, waiting for
partners excluded), mean over ranks; kinds overlap each other and compute,
so they do not add up to the iteration time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flint.sim.result import SimResult
from flint.trace import CollKind, NodeKind

GIB = 2 ** 30


def comm_time_by_kind_us(result: SimResult) -> dict[str, float]:
    """Mean over ranks of each communication kind's summed transfer time (us)."""
    raw = result.raw
    totals: dict[str, float] = {}
    world = result.world_size
    for s, ranks in enumerate(raw.classes):
        t = raw.plans[s].table
        dur = raw.finish_us[s] - raw.start_us[s]
        kind = t.kind
        for k in (NodeKind.SEND, NodeKind.RECV):
            m = kind == k
            if m.any():
                name = k.name.lower()
                totals[name] = totals.get(name, 0.0) + float(dur[m].sum()) * len(ranks)
        coll = kind == NodeKind.COLL
        if coll.any():
            ct = t.comm_type[coll]
            d = dur[coll]
            for c in np.unique(ct):
                name = CollKind(int(c)).name.lower()
                totals[name] = totals.get(name, 0.0) + float(d[ct == c].sum()) * len(ranks)
    return {k: v / world for k, v in sorted(totals.items())} if world else {}


def _trace_notes(result: SimResult) -> list[str]:
    notes = []
    comp_rows = uncosted = 0
    for p in {id(p.table): p for p in result.raw.trace.ranks}.values():
        t = p.table
        comp = (t.kind == NodeKind.COMP) | (t.kind == NodeKind.MEM_LOAD) | (t.kind == NodeKind.MEM_STORE)
        comp_rows += int(comp.sum())
        uncosted += int((comp & np.isnan(t.duration_us) & (t.flops <= 0) & (t.tensor_bytes <= 0)).sum())
    if uncosted:
        notes.append(f"{uncosted} of {comp_rows} distinct compute nodes have no duration, FLOPs or bytes and cost 0 "
                     "(e.g. chakra_converter output of a CPU run)")
    if result.total_flops == 0:
        notes.append("the trace carries no FLOPs (num_ops): MFU is 0")
    return notes


def estimate_report(result: SimResult, *, source: str, device: str | None, network: str, algorithm: Any,
                    dtype: str, memory=None, memory_note: str | None = None,
                    durations: str = "", pipeline: dict | None = None) -> dict:
    """The numbers of one estimate as a JSON-able dict (module docstring)."""
    def stats(a: np.ndarray) -> dict:
        return {"mean": float(a.mean()) if a.size else 0.0, "max": float(a.max()) if a.size else 0.0}

    rep: dict[str, Any] = {
        "input": source,
        "device": device,
        "network": network,
        "algorithm": algorithm if isinstance(algorithm, str) else dict(algorithm),
        "dtype": dtype,
        "compute_durations": durations,
        "world_size": result.world_size,
        "simulated_ranks": len(result.simulated_ranks),
        "iteration_time_us": result.iteration_time_us,
        "compute_time_us": stats(result.compute_busy_us),
        "comm_time_us": stats(result.comm_time_us),
        "exposed_comm_us": stats(result.exposed_comm_us),
        "comm_wait_us": stats(result.comm_wait_us),
        "comm_time_by_kind_us": comm_time_by_kind_us(result),
        "model_flops": result.model_flops,
        "model_flops_definition": "sum of compute-node num_ops (FLOPs) over all ranks",
        "peak_flops_per_s": result.peak_flops_per_s,
        "mfu": result.mfu,
        "nodes": result.nodes,
        "notes": _trace_notes(result),
    }
    slowed = result.port_slowed_us
    if slowed is not None and slowed.size and slowed.max() > 0:  # NIC sharing (the simulator's shared ports)
        rep["nic_sharing_us"] = stats(slowed)
    if pipeline is not None:
        rep["pipeline"] = pipeline_report(result, pipeline)
    if memory is not None:
        r = memory.report
        rep["peak_memory"] = {
            "per_rank": "every rank (the IR is one SPMD program)",
            "peak_bytes": r.peak_bytes,
            "at_peak_bytes": dict(r.at_peak_bytes),
            "category_peak_bytes": dict(r.category_peak_bytes),
            "capacity_bytes": r.capacity_bytes,
            "fits": r.fits,
            "where": {"function": memory.peak_function, "iteration": memory.peak_iteration,
                      "op_index": memory.peak_op_index, "op": memory.peak_op, "module": memory.peak_module,
                      "source": memory.peak_source},
            "notes": list(memory.notes),
        }
    else:
        rep["peak_memory"] = None
        rep["peak_memory_note"] = memory_note
    return rep


BUBBLE_DEFINITION = ("1 - compute busy / iteration time, per rank, mean over ranks (includes exposed "
                     "communication and the optimizer; with negligible communication it is the schedule's bubble)")


def pipeline_report(result: SimResult, pipeline: dict) -> dict:
    """Bubble fraction of a pipelined step and the textbook figure for its schedule."""
    it = result.iteration_time_us
    idle = 1.0 - result.compute_busy_us / it if it > 0 else np.zeros_like(result.compute_busy_us)
    p, m = pipeline["ranks"], pipeline["microbatches"]
    v = pipeline["stages"] // p
    out = dict(pipeline)
    out["bubble_fraction"] = float(idle.mean()) if idle.size else 0.0
    out["bubble_fraction_max"] = float(idle.max()) if idle.size else 0.0
    out["bubble_fraction_definition"] = BUBBLE_DEFINITION
    out["ideal_bubble_fraction"] = (p - 1) / (v * m + p - 1)
    return out


def _time_unit(us: float) -> tuple[str, float]:
    return ("ms", 1e3) if us >= 1e3 else ("us", 1.0)


def _mem_unit(nbytes: int) -> tuple[str, float]:
    for name, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return name, float(scale)
    return "B", 1.0


def _rate(x: float) -> str:
    """A throughput with three significant digits at most (tiny test models run far below a unit)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def format_report(rep: dict) -> str:
    """The report as a text table; units are in the headings."""
    lines = [f"flint estimate: {rep['input']}",
             f"  {rep['world_size']} ranks ({rep['simulated_ranks']} simulated), device {rep['device'] or '-'}, "
             f"network {rep['network']}, algorithm {rep['algorithm']}, compute durations {rep['compute_durations']}"]
    if "passes" in rep:
        lines.append(f"  passes: {rep['passes'] or '(none)'}")
    if "scheduled_by" in rep:
        lines.append(f"  scheduled by flint-opt before: {rep['scheduled_by']} (module attribute flint.scheduled_by; "
                     "no default pipeline runs on such IR)")
    if "sm_sharing" in rep:
        lines.append(f"  SM sharing: {rep['sm_sharing']}")
    if "nic_sharing_us" in rep:
        ns = rep["nic_sharing_us"]
        lines.append(f"  NIC sharing: transfers sharing a port with other traffic finished {ns['mean'] / 1e3:.3f} ms "
                     f"later, summed per rank (mean over ranks; max {ns['max'] / 1e3:.3f} ms)")
    if "attention" in rep:
        lines.append(f"  attention: {rep['attention']}")
    if "optimizer" in rep:
        lines.append(f"  optimizer: {rep['optimizer']}")
    lines.append("")
    unit, scale = _time_unit(rep["iteration_time_us"])

    def t(us: float) -> str:
        return f"{us / scale:,.3f}"

    rows = [("iteration time", t(rep["iteration_time_us"]), "")]
    for key, label in (("compute_time_us", "compute time"), ("comm_time_us", "communication time"),
                       ("exposed_comm_us", "exposed communication"), ("comm_wait_us", "waiting for partners")):
        rows.append((label, t(rep[key]["mean"]), t(rep[key]["max"])))
    for kind, us in rep["comm_time_by_kind_us"].items():
        rows.append((f"  comm {kind}", t(us), ""))
    w = max(len(r[0]) for r in rows)
    lines.append(f"{'quantity':<{w}}  {f'mean/rank ({unit})':>15}  {f'max/rank ({unit})':>14}")
    for label, mean, mx in rows:
        lines.append(f"{label:<{w}}  {mean:>15}  {mx:>14}")
    lines.append("")
    lines.append(f"MFU (%)                 {100 * rep['mfu']:.4g}")
    lines.append(f"model FLOPs (GFLOP)     {rep['model_flops'] / 1e9:,.6g}   "
                 f"[{rep['model_flops_definition']}; peak {rep['peak_flops_per_s'] / 1e12:,.1f} TFLOP/s {rep['dtype']}]")
    for n in rep.get("notes", []):
        lines.append(f"note: {n}")
    br = rep.get("compute_by_class")
    if br is not None and br["total_us"] > 0:
        lines.append("")
        where = "" if br["graph"] == "step" else f", pipeline graph @{br['graph']}"
        lines.append(f"compute kernels by op class (as priced, per rank{where}; SM sharing slows them while "
                     "collectives run)")
        w = max(len("class"), *(len(c) for c in br["classes"]))
        lines.append(f"  {'class':<{w}}  {f'time ({unit})':>12}  {'share':>6}  {'kernels':>8}  {'TFLOP/s':>8}  {'TB/s':>5}")
        for c, v in br["classes"].items():
            us = v["time_us"]
            rate = _rate(v["flops"] / us / 1e6) if us > 0 and v["flops"] > 0 else "-"
            bw = _rate(v["bytes"] / us / 1e6) if us > 0 and v["bytes"] > 0 else "-"
            lines.append(f"  {c:<{w}}  {t(us):>12}  {100 * us / br['total_us']:>5.1f}%  "
                         f"{v['kernels']:>8,}  {rate:>8}  {bw:>5}")
        lines.append(f"  {'total':<{w}}  {t(br['total_us']):>12}")
        if "attention" in br["classes"]:
            lines.append("  (FLOPs as PyTorch counts them: a causal attention kernel's masked half is included)")
    pp = rep.get("pipeline")
    if pp is not None:
        lines.append("")
        lines.append(f"pipeline                {pp['schedule']}: {pp['ranks']} ranks, {pp['stages']} stages, "
                     f"{pp['microbatches']} microbatches, repeated blocks per stage {pp['layers']}")
        lines.append("                        (a block: one layer, or a repeating pattern of layers captured as one)")
        lines.append(f"bubble fraction (%)     {100 * pp['bubble_fraction']:.2f} mean, "
                     f"{100 * pp['bubble_fraction_max']:.2f} max   [ideal (p-1)/(v*m+p-1) = "
                     f"{100 * pp['ideal_bubble_fraction']:.2f}"
                     f"{'; zero-bubble schedules fill it with W' if 'zero-bubble' in pp['schedule'] else ''}]")
        if "peak_memory_bytes_per_pp_rank" in pp:
            mu, ms = _mem_unit(max(pp["peak_memory_bytes_per_pp_rank"]))
            lines.append(f"peak memory per pp rank ({mu})  "
                         + ", ".join(f"{b / ms:,.1f}" for b in pp["peak_memory_bytes_per_pp_rank"]))
    lines.append("")
    mem = rep.get("peak_memory")
    if mem is None:
        lines.append(f"peak memory per rank: n/a ({rep.get('peak_memory_note') or 'not computed'})")
    else:
        cap = mem["capacity_bytes"]
        mu, ms = _mem_unit(mem["peak_bytes"])
        fit = "" if cap is None else f" of {cap / GIB:,.2f} GiB HBM: {'fits' if mem['fits'] else 'DOES NOT FIT'}"
        lines.append(f"peak memory per rank ({mu})  {mem['peak_bytes'] / ms:,.3f}{fit}")
        wh = mem["where"]
        lines.append(f"  at @{wh['function']} iteration {wh['iteration']}, op {wh['op_index']}"
                     + (f": {wh['op']}" if wh.get("op") else "")
                     + (f" in module {wh['module']}" if wh.get("module") else "")
                     + (f" ({wh['source']})" if wh.get("source") else ""))
        lines.append(f"  {'category':<12}  {f'at peak ({mu})':>14}  {f'own peak ({mu})':>15}")
        for c, b in mem["at_peak_bytes"].items():
            lines.append(f"  {c:<12}  {b / ms:>14,.3f}  {mem['category_peak_bytes'][c] / ms:>15,.3f}")
        for n in mem["notes"]:
            lines.append(f"  note: {n}")
    if rep.get("timeline"):
        lines.append(f"wrote timeline {rep['timeline']} (open it in ui.perfetto.dev)")
    return "\n".join(lines)
