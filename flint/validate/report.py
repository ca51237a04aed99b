"""The validation report: Markdown tables (docs/validation.md) and the ratio bar chart."""

from __future__ import annotations

import math
import platform
from pathlib import Path
from typing import Sequence

from flint.capture import opclass
from flint.validate.classify import C10D_TO_FUNCTIONAL, COMPARED_CLASSES, COMPARED_COLLECTIVES
from flint.validate.compare import op_deltas
from flint.validate.expected import explain, explain_collective, explain_collective_bytes
from flint.validate.run import CaseResult

EXACT_CLASSES = (opclass.GEMM, opclass.ATTENTION, *COMPARED_COLLECTIVES)

_SHORT = {"gemm": "GEMM", "attention": "attention", "elementwise": "elementwise", "reduction": "reduction",
          "all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
          "all_to_all": "all-to-all", "multi-tensor": "multi-tensor"}


def _ratio_text(flint: int, executed: int) -> str:
    if executed == 0:
        return "–" if flint == 0 else "∞"
    return f"{flint / executed:.2f}"


def _cell(flint: int, executed: int) -> str:
    return f"{flint}/{executed} ({_ratio_text(flint, executed)})"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f}"


def _multi_tensor_elements(res: CaseResult) -> list[str]:
    """``op a / b`` per multi-tensor op of the optimizer: the elements its first tensor list covers, over all
    its calls, in Flint and in the executed step (rank 0)."""
    from flint.validate.expected import base_op

    def merged(counter) -> dict[str, int]:
        out: dict[str, int] = {}
        for (phase, op), n in counter.items():
            if phase == "optim":
                out[base_op(op)] = out.get(base_op(op), 0) + n
        return out

    a, b = merged(res.flint.multi_tensor_elements), merged(res.ranks[0].multi_tensor_elements)
    return [f"`{op}` {a.get(op, 0)} / {b.get(op, 0)}" for op in sorted(set(a) | set(b))]


def markdown(results: Sequence[CaseResult], *, command: str, chart: str | None,
             failed: Sequence[tuple[str, str]] = ()) -> str:
    """The whole docs/validation.md text; ``failed`` lists (case, error) of runs that failed."""
    import torch

    out = ["# Validation against real execution traces", "",
           f"Regenerate this page and its chart with one command: `{command}` (the same as "
           "`python -m flint.validate.cli`; about 15 minutes on 2 cores). Flint source: `flint/validate/`; "
           "tests: `tests/test_validate.py`.", "",
           "Does the graph Flint builds from compiler IR match what actually executes? For each case "
           "below, one real training step (forward, loss, backward, `torch.optim.AdamW`) ran with "
           "`torch.distributed` on CPU (gloo backend, one process per rank on 127.0.0.1), parallelized "
           "with PyTorch's own APIs following the same Flint recipe (`parallelize_module` with "
           "`flint.capture.recipes.apply_tp`'s plans, FSDP2 `fully_shard`, FSDP2-based `replicate` for DP, "
           "on the embedding, every block, the head and the root). The second step of each run was "
           "recorded with `torch.profiler.ExecutionTraceObserver` and converted with Chakra's own "
           "`chakra_converter PyTorch`. Flint captured the same model, recipe, world size and global "
           "batch on fake tensors with a fake process group (`capture_step(..., repeat=False)`).",
           "",
           f"Setup: torch {torch.__version__}, {platform.machine()} CPU, fp32, global batch "
           f"{results[0].case.batch[0] if results else '?'} × sequence {results[0].case.batch[1] if results else '?'}"
           ", AdamW (foreach=False, torch's choice on CPU, unless a case names `foreach` or `fused`: "
           "AdamW(foreach=True) / AdamW(fused=True), the plan's `optimizer_impl`). 2-D recipes run at world "
           "size 4 (2 × 2). No supported "
           "recipe issues all-to-all (expert parallelism is not a recipe yet), so that column is empty.", "",
           "## How operators are counted", "",
           "- One classifier: `flint.capture.opclass.classify_aten`. Executed operator names map to ATen "
           "targets (the overload named by the trace's `op_schema`), c10d process-group operators to the "
           "functional collective of the same semantics; see `flint/validate/classify.py`. torch's "
           "multi-tensor ops (`_foreach_*`, `_fused_adamw_`), `other` to that classifier, are compared as "
           "their own class, `multi-tensor`, on both sides:",
           "",
           "  | executed c10d operator | counted as |", "  |---|---|"]
    for c10d, fn in C10D_TO_FUNCTIONAL.items():
        out.append(f"  | `c10d::{c10d}` | `_c10d_functional.{fn}` |")
    out += ["",
            "- `gloo:*` records are the backend's implementation inside a c10d operator (gloo runs a "
            "reduce-scatter as an all-reduce) and are not counted; autograd nodes, profiler labels and "
            "`c10d::barrier` have no class.",
            "- Eager PyTorch nests operators (`aten::linear` → `aten::matmul` → `aten::mm`; a DTensor op on "
            "the DTensor and again on its local shard). A node counts for its class only if no node below "
            "it has the same class.",
            "- Collective bytes are each rank's input buffer (Chakra's `comm_size`), from the trace's input "
            "shapes and types, on both sides.",
            "- Counts are read from the host execution trace JSON: chakra_converter 1.0.0 keeps a node's "
            "caller (`ctrl_deps`) only when the caller was converted first, and the nesting rule needs it. "
            "Every counted node is checked to be in the converted Chakra trace under the same id and name.",
            "- Flint's program is SPMD: each real rank is compared with Flint's one per-rank count.",
            "",
            "## Ratio Flint / executed (rank 0)", "",
            "Each cell is `Flint/executed (ratio)`. GEMM, attention and collectives must match exactly; "
            "`–`: neither side has the class.", ""]
    header = "| case | " + " | ".join(_SHORT[c] for c in COMPARED_CLASSES) + " |"
    out += [header, "|" + "---|" * (len(COMPARED_CLASSES) + 1)]
    for res in results:
        cells = [_cell(r.flint, r.executed) for r in res.rows if r.rank == 0]
        out.append(f"| {res.case.label()} | " + " | ".join(cells) + " |")
    if chart:
        out += ["", f"![Flint / executed operator-count ratio per class]({chart})"]
    out += ["", "## Collective bytes per rank (MiB, Flint / executed)", "",
            "| case | rank | " + " | ".join(_SHORT[c] for c in COMPARED_COLLECTIVES) + " |",
            "|" + "---|" * (len(COMPARED_COLLECTIVES) + 2)]
    for res in results:
        for rank in range(res.case.world_size):
            cells = []
            for r in res.rows:
                if r.rank == rank and r.cls in COMPARED_COLLECTIVES:
                    fb, eb = r.flint_bytes or 0, r.executed_bytes or 0
                    cells.append("–" if fb == eb == 0 else f"{_mib(fb)} / {_mib(eb)}" + ("" if fb == eb else " ✗"))
            out.append(f"| {res.case.label()} | {rank} | " + " | ".join(cells) + " |")
    out += ["", "## Every rank", "", header.replace("| case |", "| case | rank |"),
            "|" + "---|" * (len(COMPARED_CLASSES) + 2)]
    for res in results:
        for rank in range(res.case.world_size):
            cells = [_cell(r.flint, r.executed) for r in res.rows if r.rank == rank]
            out.append(f"| {res.case.label()} | {rank} | " + " | ".join(cells) + " |")
    out += ["", "## Exact classes", ""]
    bad = [(res, r) for res in results for r in res.rows if r.cls in EXACT_CLASSES
           and (r.flint != r.executed or r.flint_bytes != r.executed_bytes)]
    if not bad:
        out.append("GEMM, attention and every collective match exactly on every rank of every case.")
    else:
        out.append("Mismatches in classes that must match exactly, rank 0 (every rank is in the table above; "
                   "GEMM and attention reasons in the next section):")
        out.append("")
        seen = set()
        for res, r in bad:
            key = (res.case.label(), r.cls)
            if key in seen:
                continue
            seen.add(key)
            extra = "" if r.flint_bytes == r.executed_bytes else f", bytes {r.flint_bytes} vs {r.executed_bytes}"
            out.append(f"- {res.case.label()}, {_SHORT[r.cls]}: Flint {r.flint} vs executed {r.executed}{extra}")
            if r.cls in COMPARED_COLLECTIVES:
                rc = res.ranks[r.rank]
                for phase in ("fwd", "bwd", "optim"):
                    a, b = res.flint.collectives.get((r.cls, phase), 0), rc.collectives.get((r.cls, phase), 0)
                    if a != b:
                        note = explain_collective(r.cls, phase, res.case.plan)
                        out.append(f"  - {phase}: Flint {a} vs executed {b}: "
                                   + (f"**{note.key}**: {note.reason}" if note else "**unexplained**"))
                        continue
                    a, b = (res.flint.collective_bytes.get((r.cls, phase), 0),
                            rc.collective_bytes.get((r.cls, phase), 0))
                    if a != b:
                        note = explain_collective_bytes(r.cls, phase, res.case.max_norm > 0)
                        out.append(f"  - {phase}: the same count, bytes Flint {a} vs executed {b}: "
                                   + (f"**{note.key}**: {note.reason}" if note else "**unexplained**"))
    out += ["", "## Differences, operator by operator (rank 0), with their reasons", "",
            "Every operator whose count differs, in the compute classes (collectives are compared by count "
            "and bytes above), with the rule of `flint/validate/expected.py` that explains it. In-place and "
            "out-of-place forms of an operator are counted together.", ""]
    reasons: dict[str, str] = {}
    for res in results:
        rows = []
        for cls in COMPARED_CLASSES:
            if cls in COMPARED_COLLECTIVES:
                continue  # compared by count and bytes above; the two sides name them differently
            for phase, op, a, b in op_deltas(res.flint, res.ranks[0], cls):
                rule = explain(cls, phase, op, res.case.plan, res.case.model, res.case.loss_parallel,
                               res.case.max_norm > 0, res.case.ac != "none", more=b - a)
                if rule:
                    reasons[rule.key] = rule.reason
                rows.append(f"| {_SHORT[cls]} | {phase} | `{op}` | {a} | {b} | {rule.key if rule else '**unexplained**'} |")
        out += [f"### {res.case.label()}", ""]
        if rows:
            out += ["| class | phase | operator | Flint | executed | reason |", "|---|---|---|---|---|---|", *rows, ""]
        else:
            out += ["No operator-level differences.", ""]
        mt = _multi_tensor_elements(res)
        if mt:
            out += ["Elements of each optimizer multi-tensor op's first tensor list, all its ops summed (rank 0), "
                    "Flint / executed: " + ", ".join(mt) + ".", ""]
    out += ["### Reasons", ""]
    for key, reason in reasons.items():
        out.append(f"- **{key}**: {reason}")
    out += ["", "## The real traces through Flint's reader and simulator", "",
            "Each converted trace is read with `flint.chakra.read_trace`; its c10d collectives become "
            "COMM_COLL nodes (kind, input bytes, group of the recipe's mesh axis) "
            "(`flint.validate.imported.import_executed_trace`); every other node gets its measured "
            "exclusive host time from the profiler trace of the same step (the converter writes 0 without "
            "Kineto linking, `chakra_trace_link`, which is not on PyPI). `flint.chakra.check_trace` checks "
            "the result (cross-rank collective order per group) and `flint.sim.simulate` replays it: "
            "measured compute, communication priced by the `switch` network preset (not by gloo's "
            "loopback TCP, so the replay is not expected to equal the measured step). At world size 4 "
            "four ranks share 2 cores, so measured host durations include time spent descheduled and the "
            "replay, which sums them, exceeds the measured step.", "",
            "| case | nodes (all ranks) | collectives (all ranks) | converter check | check_trace "
            "| measured step ms | replayed ms |",
            "|---|---|---|---|---|---|---|"]
    for res in results:
        conv = "ok" if not res.converter_problems else f"{len(res.converter_problems)} problems"
        chk = "ok" if not res.trace_problems else f"{len(res.trace_problems)} problems"
        out.append(f"| {res.case.label()} | {res.imported_nodes} | {res.imported_collectives} | {conv} | {chk} "
                   f"| {res.measured_step_us / 1e3:.1f} | {res.simulated_us / 1e3:.1f} |")
    if failed:
        out += ["", "## Failed cases", ""] + [f"- {label}: {error}" for label, error in failed]
    out += ["", "## Limits", "",
            "- GEMM and attention do not match yet: Flint's capture traces scaled-dot-product attention on "
            "meta tensors, where PyTorch takes the math path. Apart from that path's `bmm`s, GEMM counts "
            "match exactly (tested). Calling `aten._scaled_dot_product_flash_attention_for_cpu` on meta "
            "tensors works (meta kernel and autograd formula exist): with `F.scaled_dot_product_attention` "
            "routed to it during capture, Flint counts GEMM 45, attention 4 and reduction 22 for llama-tiny "
            "fsdp and tp at world size 2, exactly the executed counts, collectives unchanged (checked by "
            "hand, not yet in flint/capture).",
            "- On a 2-D mesh the process group of an executed collective is inferred (FSDP / replicate "
            "profiler label: `dp`, otherwise `tp`): the execution trace does not name a gloo collective's "
            "group. `check_trace` confirms every group's members issue the same collectives in order.",
            "- Durations come from the CPU profiler (host time, including profiler overhead); gloo's "
            "loopback transport is not modelled, the replay prices collectives with a network preset.",
            "- CPU host operators are what is compared; GPU kernels (fusion, NCCL's own kernels) are not.",
            "- fp32 only, tiny configurations whose shards divide evenly (so every rank counts the same).",
            ""]
    return "\n".join(out)


def chart(results: Sequence[CaseResult], path: str | Path) -> None:
    """Grouped bars: Flint / executed count ratio per class (rank 0), one bar per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = list(COMPARED_CLASSES)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    n = max(len(results), 1)
    width = 0.8 / n
    cap = 2.0
    for k, res in enumerate(results):
        rows = {r.cls: r for r in res.rows if r.rank == 0}
        xs, ys, labels = [], [], []
        for i, cls in enumerate(classes):
            r = rows[cls]
            if r.flint == r.executed == 0:
                continue
            ratio = r.ratio
            xs.append(i - 0.4 + width * (k + 0.5))
            ys.append(min(ratio, cap))
            labels.append("∞" if math.isinf(ratio) else f"{ratio:.2f}" if ratio != 1 else "")
        bars = ax.bar(xs, ys, width, label=res.case.label())
        for b, text in zip(bars, labels):
            if text:
                ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(classes)), [_SHORT[c] for c in classes])
    ax.set_ylabel("operator count, Flint / executed")
    ax.set_ylim(0, cap + 0.4)
    ax.set_title("Flint's captured step vs. real execution trace (rank 0; no bar: neither side has the class)")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
