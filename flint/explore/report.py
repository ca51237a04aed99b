"""Reports of a sweep: tables (CSV, Parquet), a summary (Markdown, HTML) and plots.

Written into one directory, every file atomically:

- ``points.csv`` / ``points.parquet``: every point the strategy chose, one
  row each: the inputs (one column per axis), ``status``
  (``ok``/``error``/``pruned``), the constraint or error, and the outputs
  (iteration time, compute, exposed communication, MFU, tokens/s, peak
  memory and its split, whether it fits, GPU count, ...).
- ``summary.md`` / ``summary.html``: counts (evaluated, reused, pruned by
  each constraint, errors, cache hits), the best point per objective and the
  Pareto front.
- plots (matplotlib, PNG): ``pareto.png`` (iteration time against peak
  memory, coloured by GPU count, front marked), ``breakdown.png`` (compute
  against exposed communication per point), ``memory.png`` (peak memory
  split by category per point), and one ``line-<x>.png`` per ``[[report.line]]``
  of the space (bandwidth sweeps, scaling curves).

The Pareto front is over the points that ran and fit in memory, on the
space's objectives (all minimized): a point is on it when no other point is
at least as good on every objective and better on one.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from flint.explore.space import Space
from flint.fileio import atomic_binary_file, write_text_atomic


def pareto_mask(values: Sequence[Sequence[float]]) -> list[bool]:
    """For each row of ``values`` (minimized), whether no other row dominates it."""
    out = []
    for i, a in enumerate(values):
        dominated = False
        for j, b in enumerate(values):
            if j != i and all(y <= x for x, y in zip(a, b)) and any(y < x for x, y in zip(a, b)):
                dominated = True
                break
        out.append(not dominated)
    return out


def dataframe(rows: Iterable[Mapping[str, Any]], space: Space):
    """One row per point: axis columns (short names), status, constraint/error, outputs, ``pareto``."""
    import pandas as pd

    from flint.explore.runner import objective_values

    recs = []
    for r in rows:
        rec: dict[str, Any] = {"point_id": r["point_id"]}
        for k, v in r["inputs"].items():
            rec[k] = _cell(v)
        rec["status"] = r["status"]
        rec["constraint"] = r.get("constraint_name")
        rec["error"] = r.get("error")
        rec["capture_hit"] = r.get("capture_hit")
        rec["eval_s"] = r.get("eval_s")
        for k, v in (r.get("outputs") or {}).items():
            rec[k] = v
        recs.append(rec)
    df = pd.DataFrame.from_records(recs)
    if df.empty:
        return df
    if "peak_memory_bytes" in df:
        df["peak_memory_gib"] = df["peak_memory_bytes"] / 2**30
    df["pareto"] = False
    if "iteration_time_us" in df:
        ok = (df["status"] == "ok") & (df.get("fits", True) == True)  # noqa: E712
        sub = df[ok]
        if len(sub):
            vals = [objective_values(row, space.objectives) for row in sub.to_dict("records")]
            df.loc[sub.index, "pareto"] = pareto_mask(vals)
    return df


def _cell(v: Any) -> Any:
    return ",".join(map(str, v)) if isinstance(v, list) else v


def _short(name: str) -> str:
    return name.removeprefix("workload.").removeprefix("system.")


def _legend(v: Any) -> str:
    """A legend value: an empty pipeline is "(none)"."""
    return "(none)" if v == "" else str(v)


def _label(row: Mapping[str, Any], cols: Sequence[str]) -> str:
    return " ".join(f"{_short(c)}={_legend(row[c])}" for c in cols)


def write_reports(df, space: Space, summary, out_dir: str | Path) -> list[Path]:
    """Write the tables, the summary and the plots into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_text_atomic(out / "points.csv", df.to_csv(index=False))]
    buf = io.BytesIO()
    df.astype({c: "string" for c in df.columns if df[c].dtype == object}).to_parquet(buf, index=False)
    with atomic_binary_file(out / "points.parquet") as f:
        f.write(buf.getvalue())
    written.append(out / "points.parquet")
    plots = _plots(df, space, out)
    written += plots
    md = summary_markdown(df, space, summary, [p.name for p in plots])
    written.append(write_text_atomic(out / "summary.md", md))
    written.append(write_text_atomic(out / "summary.html", _html(md, space.name)))
    return written


def _varying(df, space: Space) -> list[str]:
    return [a for a in space.varying() if a in df.columns and df[a].nunique() > 1]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def _table(df, cols: Sequence[str]) -> list[str]:
    lines = ["| " + " | ".join(_short(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in df[cols].to_dict("records"):
        lines.append("| " + " | ".join(_fmt(row[c]) for c in cols) + " |")
    return lines


def summary_markdown(df, space: Space, summary, plots: Sequence[str] = ()) -> str:
    ok = df[df["status"] == "ok"] if not df.empty else df
    n_err = int((df["status"] == "error").sum()) if not df.empty else 0
    lines = [f"# flint explore: {space.name}", "",
             f"Space `{space.source}` ({space.size:,} points in the full grid; axes varied: "
             f"{', '.join(f'`{_short(a)}`' for a in space.varying()) or 'none'}). Strategy `{summary.strategy}`: "
             f"{len(df)} points chosen, {len(ok)} evaluated successfully, {n_err} failed, "
             f"{int((df['status'] == 'pruned').sum()) if not df.empty else 0} pruned before evaluation.", ""]
    lines.append(f"This run evaluated {summary.evaluated} points ({summary.cache_hits} with the captured program "
                 f"from the cache) and reused {summary.reused} stored ones, in {summary.wall_s:.1f} s.")
    lines.append("")
    if summary.pruned:
        lines += ["| constraint | points removed | the first one's reason |", "|---|---|---|"]
        for c, n in sorted(summary.pruned.items()):
            why = df[(df["status"] == "pruned") & (df["constraint"] == c)]["error"] if not df.empty else ()
            first = str(why.iloc[0]).replace("|", "/").replace("\n", " ") if len(why) else ""
            lines.append(f"| `{c}` | {n} | {first} |")
        lines.append("")
    vary = _varying(df, space)
    if len(ok):
        outs = [c for c in ("iteration_time_us", "exposed_comm_us", "mfu", "peak_memory_gib", "fits", "gpus")
                if c in ok]
        lines += ["## Best point per objective", ""]
        best = []
        cand = ok[ok["fits"] == True].copy() if "fits" in ok else ok.copy()  # noqa: E712
        if "mfu" in cand:
            cand["neg_mfu"] = -cand["mfu"]
        for o in space.objectives:
            if len(cand) and o in cand:  # ties broken by the other objectives, in order
                keys = [o, *[x for x in space.objectives if x != o and x in cand]]
                best.append(cand.sort_values(keys, kind="stable").index[0])
        if best:
            sub = ok.loc[best].copy()
            sub.insert(0, "objective", [o for o in space.objectives][:len(best)])
            lines += _table(sub, ["objective", *vary, *outs])
        if "mfu" in outs:
            lines += ["", "`mfu` counts the FLOPs the step runs, activation checkpointing's recompute included "
                          "(hardware FLOPs): it rises under checkpointing while the step slows."]
        if space.reference:
            lines += ["", "## Against the reference point", ""]
            m = ok
            for k, v in space.reference.items():
                m = m[m[k] == _cell(v)] if k in m else m.iloc[0:0]
            fit = ok[ok["fits"] == True] if "fits" in ok else ok  # noqa: E712
            if len(m) and len(fit):
                ref = m.sort_values("iteration_time_us").iloc[0]
                best = fit.sort_values("iteration_time_us").iloc[0]
                both = ok.loc[[best.name, ref.name]].copy()
                both.insert(0, "point", ["fastest that fits", "reference"])
                lines += _table(both, ["point", *vary, *outs])
                note = ""
                if "fits" in ref and not ref["fits"]:
                    note = (f" The reference does not fit: {ref['peak_memory_bytes'] / 2**30:,.1f} GiB peak per rank "
                            f"against {ref['hbm_capacity_bytes'] / 2**30:,.1f} GiB of HBM.")
                lines += ["", f"Speed of the fastest point that fits relative to the reference: "
                              f"{ref['iteration_time_us'] / best['iteration_time_us']:.3f}x "
                              f"({best['iteration_time_us'] / 1e3:,.1f} ms against "
                              f"{ref['iteration_time_us'] / 1e3:,.1f} ms per iteration).{note}"]
            else:
                lines.append("(the reference point, or any point that fits, was not evaluated)")
        lines += ["", f"## Pareto front ({', '.join(space.objectives)}; points that fit in memory)", ""]
        front = ok[ok["pareto"]].sort_values(space.objectives[0] if space.objectives[0] in ok else "iteration_time_us")
        lines += _table(front, [*vary, *outs]) if len(front) else ["(no point fits in memory)"]
        if len(ok) <= 40:
            lines += ["", "## All evaluated points", ""]
            lines += _table(ok.sort_values("iteration_time_us"), [*vary, *outs])
    errs = df[df["status"] == "error"] if not df.empty else df
    if len(errs):
        lines += ["", "## Failed points", ""]
        for row in errs.head(20).to_dict("records"):
            lines.append(f"- {_label(row, vary) or row['point_id']}: {row['error']}")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _html(md: str, title: str) -> str:
    """A self-contained HTML page of the Markdown summary (tables, headings, images, lists)."""
    import html as h

    body, in_table, in_list = [], False, False
    for line in md.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            if not in_table:
                body.append("<table>")
                in_table = True
                body.append("<tr>" + "".join(f"<th>{h.escape(c)}</th>" for c in cells) + "</tr>")
            else:
                body.append("<tr>" + "".join(f"<td>{h.escape(c)}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("- "):
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{h.escape(line[2:])}</li>")
            continue
        if in_list:
            body.append("</ul>")
            in_list = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{h.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("!["):
            src = line[line.index("(") + 1:-1]
            body.append(f'<p><img src="{h.escape(src)}" style="max-width:900px"></p>')
        elif line.strip():
            body.append(f"<p>{h.escape(line)}</p>")
    if in_table:
        body.append("</table>")
    if in_list:
        body.append("</ul>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{h.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


# ------------------------------------------------------------------ plots


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    with atomic_binary_file(path) as f:
        f.write(buf.getvalue())
    return path


def _plots(df, space: Space, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if df.empty or "iteration_time_us" not in df:
        return []
    ok = df[df["status"] == "ok"].copy()
    if ok.empty:
        return []
    paths = []
    vary = _varying(df, space)
    label_cols = list(space.breakdown_label) or vary
    ok["label"] = [_label(r, label_cols) or r["point_id"][:8] for r in ok.to_dict("records")]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sc = ax.scatter(ok["peak_memory_bytes"] / 2**30, ok["iteration_time_us"] / 1e3, c=ok["gpus"], cmap="viridis",
                    s=28, alpha=0.8, norm=matplotlib.colors.LogNorm() if ok["gpus"].nunique() > 1 else None)
    front = ok[ok["pareto"]].sort_values("peak_memory_bytes")
    ax.plot(front["peak_memory_bytes"] / 2**30, front["iteration_time_us"] / 1e3, "r-o", mfc="none", ms=9,
            label="Pareto front (fits in memory)")
    if "hbm_capacity_bytes" in ok and ok["hbm_capacity_bytes"].nunique() == 1:
        ax.axvline(ok["hbm_capacity_bytes"].iloc[0] / 2**30, color="grey", ls="--", lw=1, label="device HBM")
    if ok["gpus"].nunique() > 1:
        fig.colorbar(sc, ax=ax, label="GPUs")
    else:
        ax.text(0.99, 0.01, f"{int(ok['gpus'].iloc[0])} GPUs", transform=ax.transAxes, ha="right", va="bottom",
                fontsize=8)
    ax.set_xlabel("peak memory per rank (GiB)")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(f"{space.name}: iteration time vs peak memory")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "pareto.png"))

    shown = ok.sort_values("iteration_time_us").head(24) if len(ok) > 24 else ok
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(shown) + 2), 4.5))
    x = range(len(shown))
    comp = shown["iteration_time_us"] - shown["exposed_comm_us"]
    ax.bar(x, comp / 1e3, label="compute + overlapped comm")
    ax.bar(x, shown["exposed_comm_us"] / 1e3, bottom=comp / 1e3, label="exposed communication")
    ax.set_xticks(list(x), shown["label"], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("time per iteration (ms)")
    ax.set_title(f"{space.name}: compute vs exposed communication" + (" (24 fastest)" if len(ok) > 24 else ""))
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "breakdown.png"))

    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(shown) + 2), 4.5))
    bottom = None
    for c in ("params", "grads", "optimizer", "activations", "comm", "other"):
        col = f"mem_{c}_bytes"
        if col not in shown or not shown[col].any():
            continue
        v = shown[col] / 2**30
        ax.bar(x, v, bottom=bottom, label=c)
        bottom = v if bottom is None else bottom + v
    if "hbm_capacity_bytes" in shown and shown["hbm_capacity_bytes"].nunique() == 1:
        ax.axhline(shown["hbm_capacity_bytes"].iloc[0] / 2**30, color="grey", ls="--", lw=1, label="device HBM")
    ax.set_xticks(list(x), shown["label"], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("memory at the peak, per rank (GiB)")
    ax.set_title(f"{space.name}: peak memory breakdown")
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "memory.png"))

    for ln in space.lines:
        if ln.x not in ok or ln.y not in ok:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        scale = 1e3 if ln.y.endswith("_us") else 2**30 if ln.y.endswith("_bytes") else 1
        groups = ok.groupby(ln.series, sort=True) if ln.series else [(None, ok)]
        for key, g in groups:
            g = g.sort_values(ln.x)
            others = [c for c in vary if c not in (ln.x, ln.series)]
            if others:  # one line per combination of the other varied axes too
                for k2, g2 in g.groupby(others, sort=True):
                    k2 = k2 if isinstance(k2, tuple) else (k2,)
                    lab = ", ".join(([f"{_short(ln.series)}={_legend(key)}"] if ln.series else [])
                                    + [f"{_short(c)}={_legend(v)}" for c, v in zip(others, k2)])
                    ax.plot(g2[ln.x], g2[ln.y] / scale, "-o", ms=3, label=lab)
            else:
                ax.plot(g[ln.x], g[ln.y] / scale, "-o", ms=4,
                        label=f"{_short(ln.series)}={_legend(key)}" if ln.series else None)
        ax.set_xlabel(_short(ln.x))
        xs, ys = ok[ln.x], ok[ln.y]
        if xs.dtype.kind in "if" and xs.min() > 0 and xs.max() / xs.min() >= 8:
            ax.set_xscale("log", base=2)
        if ys.dtype.kind in "if" and ys.min() > 0 and ys.max() / ys.min() > 5:
            ax.set_yscale("log")
        ax.set_ylabel(ln.y.replace("_us", " (ms)") if ln.y.endswith("_us") else
                      ln.y.replace("_bytes", " (GiB)") if ln.y.endswith("_bytes") else ln.y)
        ax.set_title(ln.title or f"{space.name}: {ln.y} vs {_short(ln.x)}")
        if ax.get_legend_handles_labels()[1]:  # one unlabelled line (only x varies): no legend
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        stem = f"line-{_short(ln.x).replace('.', '-')}" + ("" if ln.y == "iteration_time_us" else f"-{ln.y}")
        paths.append(_save(fig, out / f"{stem}.png"))
    return paths
