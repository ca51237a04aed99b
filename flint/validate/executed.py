"""Count what a real training step executed, per rank, by Flint's op classes.

Input: the host execution trace (PyTorch's ``ExecutionTraceObserver`` JSON)
of one rank and, as a cross-check, the same trace after ``chakra_converter
PyTorch``. The counts are read from the host JSON because the converter
(mlc-chakra 1.0.0) keeps a node's caller in ``ctrl_deps`` only when the caller
happened to be converted first (about one node in eight in our runs), and the
nesting is what the counting rule needs
(:func:`flint.validate.classify.innermost_of_class`), minus the ops a Python
dispatch mode served without running them: an op whose call went into a
``PythonDispatchMode`` and ran nothing of its class below it. That is
selective activation checkpointing's cache: on recompute, its mode hands back
the output the forward saved (the trace still records the ``aten::mm`` call,
whose only callees are two ``detach`` and the mode). Node ids are the same in
both files; :func:`check_against_converted` verifies every counted op is in
the converted trace under the same name.

With the profiler's trace of the same step, each node also gets its measured
exclusive host duration (:func:`exclusive_durations_us`).

Phases follow execution order (ET ids increase with start time; a CPU step
runs forward, backward and the optimizer on one thread): ``fwd`` until the
first node the autograd engine records, ``bwd`` until
``Optimizer.step#...`` or the worker's gradient-norm clipping
(``CLIP_LABEL``), ``optim`` from there on.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from flint.capture import opclass
from flint.validate.classify import MULTI_TENSOR, collective_input_bytes, executed_class, innermost_of_class

_DP_LABELS = ("FSDP::", "Replicate::", "replicate::")
#: The record_function around the real run's gradient-norm clipping (flint.validate.worker.clip_grad_norm): its
#: ops count in the optimizer phase, where Flint's clipping functions run.
CLIP_LABEL = "clip_grad_norm_"


@dataclass
class ExecutedCollective:
    """One counted collective of a real run."""

    node_id: int
    name: str
    kind: str
    phase: str
    input_bytes: int
    data_parallel: bool  # issued under an FSDP / replicate profiler label


@dataclass
class RankCounts:
    """Per-class counts of one rank's executed step."""

    rank: int
    classes: Counter  # class -> count (innermost of class)
    collectives: Counter  # (kind, phase) -> count
    collective_bytes: Counter  # (kind, phase) -> input bytes
    ops: Counter = field(default_factory=Counter)  # (class, phase, op name) -> count
    counted: dict[int, str] = field(default_factory=dict)  # node id -> name of every counted op
    collective_ops: list[ExecutedCollective] = field(default_factory=list)
    inside_collectives: set[int] = field(default_factory=set)  # node ids nested in a counted collective
    durations_us: dict[int, float] = field(default_factory=dict)  # node id -> measured exclusive duration
    # (phase, op name) -> elements of the first tensor list of the multi-tensor ops counted
    multi_tensor_elements: Counter = field(default_factory=Counter)


def _list_elements(node: dict) -> int:
    """Elements of a node's first input when it is a tensor list (the execution trace records a tensor as
    ``[id, storage id, offset, numel, element size, device]``), else 0."""
    values = node.get("inputs", {}).get("values") or [None]
    first = values[0]
    if not isinstance(first, list) or not all(isinstance(t, list) and len(t) == 6 for t in first):
        return 0
    return sum(int(t[3]) for t in first)


def _attr(node: dict, name: str) -> str:
    for a in node.get("attrs", ()):
        if a.get("name") == name:
            return a.get("value", "")
    return ""


def count_host_trace(path: str | Path, rank: int, kineto: str | Path | None = None) -> RankCounts:
    """Count one rank's host execution trace JSON by op class (see the module docstring).

    With ``kineto`` (the profiler's Chrome trace of the same step), also each
    node's measured exclusive duration (:attr:`RankCounts.durations_us`).
    """
    with open(path) as f:
        nodes = sorted(json.load(f)["nodes"], key=lambda n: n["id"])
    index = {n["id"]: i for i, n in enumerate(nodes)}
    # a caller starts before its callees; a "caller" with a later id is no caller (records of
    # gloo's worker thread interleave with the main thread's: a view "inside" gloo:all_reduce)
    parents = [j if (j := index.get(n.get("ctrl_deps", -1), -1)) < i else -1 for i, n in enumerate(nodes)]
    events = _profiler_events(kineto) if kineto is not None else {}
    if events:
        parents = _parents_by_time(nodes, parents, events)
    schemas = [_attr(n, "op_schema") for n in nodes]
    classes = [executed_class(n["name"], s) for n, s in zip(nodes, schemas)]
    counts = innermost_of_class(classes, parents)
    for i, p in enumerate(parents):  # served by a dispatch mode (module docstring): no kernel ran
        if p >= 0 and counts[p] and nodes[i]["name"] == "PythonDispatchMode":
            counts[p] = False

    phase, phases = "fwd", []
    for n in nodes:
        name = n["name"]
        if phase == "fwd" and name.startswith("autograd::engine"):
            phase = "bwd"
        elif phase != "optim" and (name.startswith("Optimizer.step") or name == CLIP_LABEL):
            phase = "optim"
        phases.append(phase)

    result = RankCounts(rank, Counter(), Counter(), Counter())
    for i, n in enumerate(nodes):
        if not counts[i]:
            continue
        cls = classes[i]
        result.classes[cls] += 1
        result.ops[(cls, phases[i], n["name"])] += 1
        result.counted[n["id"]] = n["name"]
        if cls == MULTI_TENSOR:
            result.multi_tensor_elements[(phases[i], n["name"])] += _list_elements(n)
        if cls in opclass.COLLECTIVES:
            nbytes = collective_input_bytes(schemas[i], n["inputs"]["shapes"], n["inputs"]["types"])
            result.collectives[(cls, phases[i])] += 1
            result.collective_bytes[(cls, phases[i])] += nbytes
            p, dp = parents[i], False
            while p >= 0 and not dp:
                dp = nodes[p]["name"].startswith(_DP_LABELS)
                p = parents[p]
            result.collective_ops.append(ExecutedCollective(n["id"], n["name"], cls, phases[i], nbytes, dp))
    if kineto is not None:
        result.durations_us = exclusive_durations_us(nodes, parents, events)
    coll_rows = {index[c.node_id] for c in result.collective_ops}
    for i in range(len(nodes)):
        p = parents[i]
        while p >= 0:
            if p in coll_rows:
                result.inside_collectives.add(nodes[i]["id"])
                break
            p = parents[p]
    return result


def _profiler_events(kineto: str | Path) -> dict[int, dict]:
    """Record function id -> the profiler's (Kineto's) complete CPU event for it."""
    with open(kineto) as f:
        events = json.load(f).get("traceEvents", [])
    return {int(rf): e for e in events
            if e.get("ph") == "X" and (rf := e.get("args", {}).get("Record function id")) is not None}


def _parents_by_time(nodes: list[dict], parents: list[int], events: dict[int, dict]) -> list[int]:
    """Callers from the profiler's intervals: a node with a profiler event is called by the innermost
    event of its thread whose interval holds its own (the execution trace's ``ctrl_deps`` is not
    always that: under load it was seen to name an operator's caller's caller, or an op that had
    already returned, so a DTensor ``aten::add`` and the local ``aten::add`` below it both counted).
    With no enclosing event of its thread, a node keeps the nearest execution-trace ancestor that
    is not an event of its thread ended before it: the thread's root, or a caller on another thread
    (gloo's worker records under the main thread's collective)."""
    out = list(parents)
    span: dict[int, tuple] = {}  # node index -> (thread, start, end)
    for i, n in enumerate(nodes):
        e = events.get(int(_attr(n, "rf_id") or -1))
        if e is not None:
            ts = float(e["ts"])
            span[i] = (e.get("tid"), ts, ts + float(e.get("dur", 0.0)))
    by_thread: dict = {}
    for i, (tid, ts, end) in span.items():
        by_thread.setdefault(tid, []).append((ts, -end, i))
    for spans in by_thread.values():
        spans.sort()
        stack: list[tuple[float, int]] = []  # (end, node index) of the open intervals
        for ts, neg_end, i in spans:
            while stack and stack[-1][0] < -neg_end:  # ends before this one ends: not enclosing
                stack.pop()
            if stack and stack[-1][1] < i:
                out[i] = stack[-1][1]
            else:
                p = parents[i]
                while p >= 0 and p in span and span[p][0] == span[i][0]:
                    p = parents[p]  # an event of this thread that does not hold this one: not its caller
                out[i] = p
            stack.append((-neg_end, i))
    return out


def exclusive_durations_us(nodes: list[dict], parents: list[int], events: dict[int, dict]) -> dict[int, float]:
    """node id -> exclusive host duration (µs): the profiler event's duration minus its callees'.

    ``events`` are :func:`_profiler_events`: Profiler (Kineto) CPU events carry
    ``Record function id``, the ET node's ``rf_id`` (the link
    ``chakra_trace_link`` makes for device traces). Nodes without an event
    (labels, the ET's thread roots) get none.
    """
    inclusive = [float(e.get("dur", 0.0)) if (e := events.get(int(_attr(n, "rf_id") or -1))) is not None else None
                 for n in nodes]
    exclusive = [d if d is not None else 0.0 for d in inclusive]
    for i, p in enumerate(parents):
        if p >= 0 and inclusive[i] is not None and inclusive[p] is not None:
            exclusive[p] -= inclusive[i]
    return {n["id"]: max(exclusive[i], 0.0) for i, n in enumerate(nodes) if inclusive[i] is not None}


def check_against_converted(counts: RankCounts, table) -> list[str]:
    """Problems if a counted op is missing from the converted Chakra table or named differently."""
    names = dict(zip(table.node_ids.tolist(), table.names))
    problems = []
    for node_id, name in counts.counted.items():
        got = names.get(node_id)
        if got != name:
            problems.append(f"rank {counts.rank}: node {node_id} '{name}' is "
                            + ("missing from the converted trace" if got is None else f"'{got}' there"))
    return problems
