"""``flint inspect DIR``: what a Chakra trace contains and whether it is sound.

:func:`summarize` reduces a :class:`flint.trace.Trace` to a plain dict: per
class of ranks with identical statistics (node counts by kind, FLOPs, bytes
by collective kind, send/recv bytes, compute time), totals, and the
:func:`flint.chakra.check_trace` problems. :func:`format_table` renders it
for people; :func:`to_json` gives the stable JSON text (sorted keys, rank
classes ordered by first rank) that tests compare against.

:func:`main` is the command (the ``flint`` CLI delegates to it). Exit status:
0 when the trace has no problems, 1 when the checks found problems, 2 when
the trace cannot be read (the message, never a traceback, goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

import numpy as np

from flint.chakra.check import check_trace
from flint.chakra.reader import COMM_GROUPS_HELP, read_trace
from flint.errors import FlintError, run_cli
from flint.trace import CollKind, NodeKind, NodeTable, Trace

_COMM_OP_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
_KIND_NAMES = {int(k): k.name for k in NodeKind}


def _table_stats(table: NodeTable) -> dict:
    kind = table.kind
    nodes = {}
    for k, c in zip(*np.unique(kind, return_counts=True)):
        nodes[_KIND_NAMES.get(int(k), f"TYPE_{int(k)}")] = int(c)
    comp = kind == NodeKind.COMP
    flops = table.flops[comp]
    dur = table.duration_us[comp]
    coll = kind == NodeKind.COLL
    comm_bytes: dict[str, int] = {}
    comm_count: dict[str, int] = {}
    for ct in np.unique(table.comm_type[coll]):
        m = coll & (table.comm_type == ct)
        name = CollKind(int(ct)).name if 0 <= ct <= int(CollKind.BARRIER) else f"COMM_TYPE_{int(ct)}"
        comm_bytes[name] = int(np.clip(table.comm_bytes[m], 0, None).sum())
        comm_count[name] = int(m.sum())
    send = kind == NodeKind.SEND
    recv = kind == NodeKind.RECV
    # chakra_converter keeps a CPU run's collectives as compute nodes named after the c10d/gloo/nccl ops.
    comm_like = sum(1 for i in np.flatnonzero(comp) if table.names[i].startswith(_COMM_OP_PREFIXES))
    streams: dict[str, int] = {}  # named stream (Flint's comm_stream attribute) -> nodes queued on it
    if table.comm_stream is not None and table.stream_names:
        for k, c in zip(*np.unique(table.comm_stream[table.comm_stream >= 0], return_counts=True)):
            streams[table.stream_names[int(k)]] = int(c)
    held = table.comm_sms[send] if table.comm_sms is not None else np.zeros(0, np.int16)
    return {
        "comm_like_comp_nodes": comm_like,
        "streams": streams,
        "sms_sends": int((held > 0).sum()),
        "nodes": nodes,
        "total_nodes": int(len(table)),
        "flops": int(flops[flops > 0].sum()),
        "compute_us": round(float(np.nansum(dur)), 3),
        "collectives": comm_count,
        "collective_bytes": comm_bytes,
        "send_bytes": int(np.clip(table.comm_bytes[send], 0, None).sum()),
        "recv_bytes": int(np.clip(table.comm_bytes[recv], 0, None).sum()),
    }


def _ranges(ranks: Sequence[int]) -> str:
    out = []
    start = prev = ranks[0]
    for r in ranks[1:]:
        if r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def summarize(trace: Trace, *, max_problems: int = 50) -> dict:
    """Per-rank-class statistics, totals and check results of ``trace`` as a JSON-ready dict."""
    by_table: dict[int, dict] = {}
    classes: dict[str, list[int]] = {}
    stats_of: dict[str, dict] = {}
    for rank, prog in enumerate(trace.ranks):
        st = by_table.get(id(prog.table))
        if st is None:
            st = by_table[id(prog.table)] = _table_stats(prog.table)
        key = json.dumps(st, sort_keys=True)
        classes.setdefault(key, []).append(rank)
        stats_of[key] = st
    rank_classes = []
    totals = {"nodes": 0, "flops": 0, "compute_us": 0.0, "collective_bytes": {}, "send_bytes": 0, "recv_bytes": 0}
    for key, ranks in sorted(classes.items(), key=lambda kv: kv[1][0]):
        st = stats_of[key]
        rank_classes.append({"ranks": _ranges(ranks), "count": len(ranks), **st})
        n = len(ranks)
        totals["nodes"] += st["total_nodes"] * n
        totals["flops"] += st["flops"] * n
        totals["compute_us"] += st["compute_us"] * n
        totals["send_bytes"] += st["send_bytes"] * n
        totals["recv_bytes"] += st["recv_bytes"] * n
        for k, v in st["collective_bytes"].items():
            totals["collective_bytes"][k] = totals["collective_bytes"].get(k, 0) + v * n
    totals["compute_us"] = round(totals["compute_us"], 3)
    problems = check_trace(trace)
    return {
        "world_size": trace.world_size,
        "comm_groups": len(trace.comm_groups),
        "rank_classes": rank_classes,
        "totals": totals,
        "problem_count": len(problems),
        "problems": [p.to_json() for p in problems[:max_problems]],
    }


def to_json(summary: dict) -> str:
    """Stable JSON text of a summary: sorted keys, two-space indent, trailing newline."""
    return json.dumps(summary, sort_keys=True, indent=2) + "\n"


def _human(n: float, unit: str) -> str:
    if unit == "B":
        from flint.units import fmt_bytes

        return fmt_bytes(n)
    for prefix in ("", "K", "M", "G", "T", "P", "E"):
        if abs(n) < 1000:
            return f"{n:.3g} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1000
    return f"{n:.3g} Z{unit}"


def format_table(summary: dict) -> str:
    """A human-readable report of :func:`summarize`'s result."""
    lines = [f"world size {summary['world_size']}, {summary['comm_groups']} comm groups, "
             f"{len(summary['rank_classes'])} distinct rank class(es)", ""]
    kinds = sorted({k for c in summary["rank_classes"] for k in c["nodes"]})
    colls = sorted({k for c in summary["rank_classes"] for k in c["collective_bytes"]})
    head = ["ranks", "nodes", *kinds, "FLOPs", "compute", *[f"{c} bytes" for c in colls], "send", "recv"]
    rows = []
    for c in summary["rank_classes"]:
        rows.append([
            c["ranks"] if len(c["ranks"]) <= 24 else c["ranks"][:21] + "...",
            str(c["total_nodes"]), *[str(c["nodes"].get(k, 0)) for k in kinds],
            _human(c["flops"], "FLOP"), f"{c['compute_us'] / 1000:.3f} ms",
            *[_human(c["collective_bytes"].get(k, 0), "B") for k in colls],
            _human(c["send_bytes"], "B"), _human(c["recv_bytes"], "B"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)
    t = summary["totals"]
    comm_like = sum(c["comm_like_comp_nodes"] * c["count"] for c in summary["rank_classes"])
    if comm_like:
        lines += ["", f"note: {comm_like} compute node(s) are named after c10d/gloo/nccl collectives "
                  "(chakra_converter output of a CPU run); they are counted as compute, not communication"]
    named = [c for c in summary["rank_classes"] if c["streams"] or c["sms_sends"]]
    if named:
        lines += ["", "named streams (nodes per stream; sends whose kernel holds SMs):"]
        for c in named:
            ranks = c["ranks"] if len(c["ranks"]) <= 24 else c["ranks"][:21] + "..."
            parts = [f"{k} {v}" for k, v in sorted(c["streams"].items())]
            if c["sms_sends"]:
                parts.append(f"{c['sms_sends']} send(s) holding SMs")
            lines.append(f"  ranks {ranks}: " + ", ".join(parts))
    lines += ["", f"total: {t['nodes']} nodes, {_human(t['flops'], 'FLOP')}, "
              + ", ".join(f"{k} {_human(v, 'B')}" for k, v in sorted(t["collective_bytes"].items()))]
    n = summary["problem_count"]
    if n == 0:
        lines.append("checks: OK (no cycles, dangling deps, group, collective-order or send/recv problems)")
    else:
        lines.append(f"checks: {n} problem(s)")
        for p in summary["problems"]:
            where = ", ".join(x for x in (f"rank {p['rank']}" if p["rank"] is not None else "",
                                          f"node {p['node_id']}" if p["node_id"] is not None else "") if x)
            lines.append(f"  {where}: {p['message']}" if where else f"  {p['message']}")
        if n > len(summary["problems"]):
            lines.append(f"  ... and {n - len(summary['problems'])} more")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flint inspect", description="Summarize and check a Chakra execution trace.")
    ap.add_argument("trace", help="trace directory, DIR/PREFIX, or one <prefix>.<rank>.et file")
    ap.add_argument("--json", action="store_true", help="print the summary as stable JSON")
    ap.add_argument("--comm-groups", default=None, help=COMM_GROUPS_HELP)
    ap.add_argument("--max-problems", type=int, default=50, help="problems to list (default 50)")
    args = ap.parse_args(argv)

    def run() -> int:
        try:
            trace = read_trace(args.trace, comm_groups=args.comm_groups)
            summary = summarize(trace, max_problems=args.max_problems)
        except FlintError as e:
            print(f"flint inspect: error: {e}", file=sys.stderr)
            return 2
        sys.stdout.write(to_json(summary) if args.json else format_table(summary))
        return 1 if summary["problem_count"] else 0

    return run_cli("flint inspect", run)


if __name__ == "__main__":
    sys.exit(main())
