"""The wafer-scale study: Llama-3 70B FSDP-16 on a switch and on a 2D-mesh wafer, collectives whole and decomposed.

One command writes ``docs/studies/wafer.md`` (table + reading) and ``docs/studies/wafer.png``:

    .venv/bin/python bench/study_wafer.py              # llama3-70b, 16 ranks, seq 8192
    .venv/bin/python bench/study_wafer.py --model llama-tiny --seq 64 --out /tmp/study   # a quick check

For each network (``switch``: a flat non-blocking 400 Gb/s switch, the
baseline; ``wafer-2d-mesh``: dies in rows of 16 on a 2D mesh without
wraparound, 100 GB/s per link) the same captured step is simulated twice by
Flint's simulator: with every collective as one node (priced by the one
collective formula, ring algorithm) and decomposed into ring send/recv steps
(``decompose-collectives{algorithm=ring}``, priced message by message). It
reports the communication time per rank and the bytes moved per link class
(network dimension): for the decomposed form, each message's bytes times the
links it crosses on that dimension (a mesh hop per coordinate step; one link
on a switch); for whole collectives, what the formula's ring moves (per step
S/n from every member, over 2 hops per step on a mesh line, as its snake
embedding assumes; one on a switch). Both forms first run FSDP's schedule
within an iteration (``sink-waits,assign-streams``), so asynchronous
collectives overlap compute whole and decomposed alike.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

NETWORKS = ("switch", "wafer-2d-mesh")
SCHEDULE = "sink-waits,assign-streams"


def _hops(net, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Links crossed per network dimension for messages src -> dst: [len, ndims]."""
    from flint.cost.collective import Topology

    a, b = net.coords(src), net.coords(dst)
    out = np.zeros(a.shape, np.int64)
    for i, d in enumerate(net.dims):
        diff = np.abs(a[:, i] - b[:, i])
        if d.link.topology is Topology.RING:
            diff = np.minimum(diff, d.size - diff)
        elif d.link.topology in (Topology.SWITCH, Topology.FULLY_CONNECTED):
            diff = (diff > 0).astype(np.int64)
        out[:, i] = diff
    return out


def link_bytes_decomposed(trace, net) -> dict[str, float]:
    from flint.trace import NodeKind

    tot = np.zeros(len(net.dims))
    for r, p in enumerate(trace.ranks):
        t = p.table
        rows = np.nonzero(t.kind == NodeKind.SEND)[0]
        if not rows.size:
            continue
        dst = p.peers()[rows]
        h = _hops(net, np.full(rows.size, r), dst)
        tot += (h * t.comm_bytes[rows][:, None]).sum(axis=0)
    return {d.name: float(x) for d, x in zip(net.dims, tot)}


def link_bytes_whole(trace, net) -> dict[str, float]:
    """What the ring formula moves for every collective node, per network dimension."""
    from flint.cost.collective import Topology
    from flint.trace import CollKind, NodeKind

    tot = {d.name: 0.0 for d in net.dims}
    for r, p in enumerate(trace.ranks):
        t = p.table
        rows = np.nonzero(t.kind == NodeKind.COLL)[0]
        gids = p.groups()[rows]
        for row, gid in zip(rows.tolist(), gids.tolist()):
            members = trace.comm_groups[gid]
            n = len(members)
            kind = CollKind(int(t.comm_type[row]))
            nb = float(t.comm_bytes[row])
            full = nb * n if kind is CollKind.ALL_GATHER else nb
            sent = {CollKind.ALL_REDUCE: 2 * (n - 1) / n * full}.get(kind, (n - 1) / n * full)
            levels = net.group_levels(members)
            for d in net.dims:
                if any(lk is d.link for lk, _ in levels):
                    hops = 2 if d.link.topology is Topology.MESH and n > 2 else 1
                    tot[d.name] += sent * hops / len(levels)
    return tot


def run(model: str, ranks: int, seq: int, out: Path) -> None:
    from xdsl.context import Context

    from flint.capture import capture_step
    from flint.chakra.from_ir import trace_from_ir
    from flint.cost import load_device, load_network
    from flint.importer import import_step
    from flint.models import factory
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.decompose_collectives import DecomposeCollectivesPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.schedule.pipelines import run_pipeline
    from flint.sim import simulate

    t0 = time.perf_counter()
    step = capture_step(factory(model), {"tokens": (ranks, seq), "labels": (ranks, seq)}, world_size=ranks,
                        plan="fsdp", dtype="bfloat16")
    base = import_step(step)
    # FSDP's overlap within an iteration (waits sunk to first use, all-gathers and reduce-scatters on
    # streams of their own), for both forms; cross-iteration prefetch cannot be decomposed yet
    run_pipeline(base, SCHEDULE)
    print(f"captured {model} fsdp-{ranks} in {time.perf_counter() - t0:.1f} s", flush=True)
    device = load_device("h100-sxm")
    traces = {}
    for form in ("whole", "decomposed"):
        m = base.clone()
        if form == "decomposed":
            DecomposeCollectivesPass(algorithm="ring").apply(Context(), m)
        CanonicalizeDistPass().apply(Context(), m)
        LowerToChakraPass().apply(Context(), m)
        traces[form] = trace_from_ir(m)
    rows = []
    for name in NETWORKS:
        net = load_network(name).for_world(ranks)
        for form, trace in traces.items():
            t = time.perf_counter()
            res = simulate(trace, device, net, algorithm="ring")
            lb = link_bytes_decomposed(trace, net) if form == "decomposed" else link_bytes_whole(trace, net)
            rows.append({"network": name, "form": form, "iteration_ms": res.iteration_time_us / 1e3,
                         "comm_ms": float(res.comm_time_us.mean()) / 1e3,
                         "exposed_ms": float(res.exposed_comm_us.mean()) / 1e3,
                         "link_gb": {k: v / 1e9 for k, v in lb.items()}, "sim_s": time.perf_counter() - t,
                         "nodes_per_rank": len(trace.ranks[0].table)})
            print(rows[-1], flush=True)
    write_report(rows, model, ranks, seq, out)


def write_report(rows, model: str, ranks: int, seq: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Wafer-scale study: {model}, FSDP-{ranks}, sequence {seq}", "",
             "Generated by `bench/study_wafer.py` (Flint's simulator, H100 compute model, ring collectives, schedule `sink-waits,assign-streams`).", "",
             "| network | collectives | iteration (ms) | communication (ms/rank) | exposed comm (ms/rank) | "
             "nodes per rank | bytes per link class (GB, all ranks) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lb = ", ".join(f"{k}: {v:,.1f}" for k, v in r["link_gb"].items())
        lines.append(f"| {r['network']} | {r['form']} | {r['iteration_ms']:,.1f} | {r['comm_ms']:,.1f} | "
                     f"{r['exposed_ms']:,.1f} | {r['nodes_per_rank']:,} | {lb} |")
    by = {(r["network"], r["form"]): r for r in rows}
    lines += ["", "## Reading", ""]
    for name in NETWORKS:
        w, d = by[(name, "whole")], by[(name, "decomposed")]
        lines.append(f"- {name}: decomposed communication {d['comm_ms']:,.1f} ms/rank vs {w['comm_ms']:,.1f} as whole "
                     f"collectives ({d['comm_ms'] / w['comm_ms']:.2f}x); link traffic "
                     f"{sum(d['link_gb'].values()):,.1f} GB vs {sum(w['link_gb'].values()):,.1f} GB.")
    sw, wf = by[("switch", "decomposed")], by[("wafer-2d-mesh", "decomposed")]
    lines.append(f"- wafer vs switch (decomposed): communication {wf['comm_ms'] / sw['comm_ms']:.2f}x, iteration "
                 f"{wf['iteration_ms'] / sw['iteration_ms']:.2f}x.")
    ww, wd = by[("wafer-2d-mesh", "whole")], by[("wafer-2d-mesh", "decomposed")]
    ratio = sum(wd["link_gb"].values()) / sum(ww["link_gb"].values())
    lines.append(f"- On the mesh the decomposed ring runs along a row (neighbour messages, plus one message per step "
                 f"from the last die back to the first across the whole row); the whole-collective formula assumes a "
                 f"snake embedding (2 hops per message). The decomposed form moves {ratio:.2f}x the link traffic of "
                 f"that assumption, and both put one message per direction on every link per step, so neither "
                 f"congests; the wrap-around message adds only hop latency.")
    sww = by[("switch", "whole")]
    lines.append(f"- Overlap: both forms run FSDP's in-iteration schedule ({SCHEDULE}); decomposed asynchronous "
                 f"collectives keep their start and wait positions, their steps and reductions on channels of "
                 f"the collective's stream. Exposed communication on the switch: {sw['exposed_ms']:,.1f} of "
                 f"{sw['comm_ms']:,.1f} ms decomposed against {sww['exposed_ms']:,.1f} of {sww['comm_ms']:,.1f} ms "
                 f"whole; iteration {(sw['iteration_ms'] / sww['iteration_ms'] - 1) * 100:+.1f}%.")
    lines.append("- The simulator models no contention inside the fabric (a rank's concurrent channel sends do "
                 "share its ports); traffic per link class is what a congestion model would load, time is the "
                 "uncongested estimate.")
    (out / "wafer.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['network']}\n{r['form']}" for r in rows]
    axes[0].bar(labels, [r["comm_ms"] for r in rows], color=["#4477aa", "#66ccee", "#228833", "#ccbb44"])
    axes[0].set_ylabel("communication per rank (ms)")
    axes[0].set_title(f"{model} FSDP-{ranks}: communication time")
    classes = sorted({k for r in rows for k in r["link_gb"]})
    bottom = np.zeros(len(rows))
    for c in classes:
        vals = np.array([r["link_gb"].get(c, 0.0) for r in rows])
        axes[1].bar(labels, vals, bottom=bottom, label=c)
        bottom += vals
    axes[1].set_ylabel("bytes x links crossed (GB, all ranks)")
    axes[1].set_title("traffic per link class")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "wafer.png", dpi=120)
    print(f"wrote {out / 'wafer.md'} and {out / 'wafer.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "studies"))
    args = ap.parse_args()
    run(args.model, args.ranks, args.seq, Path(args.out))


if __name__ == "__main__":
    main()
