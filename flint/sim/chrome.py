"""Chrome-trace / Perfetto JSON timeline of simulated ranks.

One process per rank (``pid`` = rank), one thread per stream (compute, coll,
send, recv). Every node is a complete event (``"ph": "X"``) from its start
to its finish, ``ts``/``dur`` in microseconds; a communication node that
waited for its partners also gets a ``wait:<name>`` slice from issue to
start. Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from flint.fileio import atomic_text_file
from flint.sim.result import SimResult
from flint.trace import CollKind, NodeKind


def chrome_trace_events(result: SimResult, ranks: Sequence[int] | None = None, max_ranks: int = 16,
                        labels: dict[int, str] | None = None) -> list[dict]:
    """The trace events for ``ranks`` (default: the simulated representatives, at most ``max_ranks``).

    ``labels`` adds a note to a rank's process name (e.g. its pipeline stage).

    A rank that was not simulated itself is shown with its representative's
    timeline (they are identical, see :mod:`flint.sim.engine`).
    """
    raw = result.raw
    rep_of = {}
    for s, cls in enumerate(raw.classes):
        for r in cls:
            rep_of[r] = s
    if ranks is None:
        ranks = raw.sim_ranks[:max_ranks]
    events: list[dict] = []
    for r in ranks:
        s = rep_of[int(r)]
        plan = raw.plans[s]
        t = plan.table
        same = len(raw.classes[s])
        events.append({"ph": "M", "name": "process_name", "pid": int(r),
                       "args": {"name": f"rank {r}" + (f" {labels[int(r)]}" if labels and int(r) in labels else "")
                                + (f" (x{same} identical ranks)" if same > 1 else "")}})
        for k, name in enumerate(plan.stream_names):
            events.append({"ph": "M", "name": "thread_name", "pid": int(r), "tid": k, "args": {"name": name}})
        st, en, iss = raw.start_us[s], raw.finish_us[s], raw.issue_us[s]
        for row in range(len(t)):
            k = plan.stream[row]
            kind = int(t.kind[row])
            args = {"node_id": int(t.node_ids[row])}
            if kind == NodeKind.COMP:
                if t.flops[row] >= 0:
                    args["flops"] = int(t.flops[row])
                if t.tensor_bytes[row] >= 0:
                    args["tensor_bytes"] = int(t.tensor_bytes[row])
            else:
                args["comm_bytes"] = int(t.comm_bytes[row])
                if kind == NodeKind.COLL:
                    args["comm_type"] = CollKind(int(t.comm_type[row])).name
                if iss[row] < st[row]:
                    events.append({"ph": "X", "name": f"wait:{t.names[row]}", "cat": "wait", "pid": int(r), "tid": k,
                                   "ts": float(iss[row]), "dur": float(st[row] - iss[row])})
            events.append({"ph": "X", "name": t.names[row], "cat": plan.stream_names[k], "pid": int(r), "tid": k,
                           "ts": float(st[row]), "dur": float(en[row] - st[row]), "args": args})
    return events


def write_chrome_trace(result: SimResult, path: str | os.PathLike, ranks: Sequence[int] | None = None,
                       max_ranks: int = 16, labels: dict[int, str] | None = None) -> Path:
    """Write the timeline JSON to ``path`` atomically (temp file + rename); returns the path."""
    path = Path(path)
    doc = {"traceEvents": chrome_trace_events(result, ranks, max_ranks, labels), "displayTimeUnit": "ms",
           "otherData": {"iteration_time_us": result.iteration_time_us, "world_size": result.world_size,
                         "mfu": result.mfu}}
    with atomic_text_file(path) as f:
        json.dump(doc, f)
    return path
