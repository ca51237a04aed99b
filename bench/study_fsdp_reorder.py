"""The paper's FSDP study: reordered all-gathers against iteration time and peak memory. One command each.

    .venv/bin/python bench/study_fsdp_reorder.py scale       # (a) Llama-3 8B and 70B, 8 to 1,024 GPUs
    .venv/bin/python bench/study_fsdp_reorder.py bandwidth   # (b) 70B, per-GPU link bandwidth 12.5-500 GB/s

Each writes a Markdown table and a matplotlib chart into ``docs/studies/``.

Setup: the model's real training step (forward, loss, backward, AdamW) captured with PyTorch under
FSDP (``fully_shard``-equivalent SimpleFSDP parametrization, reshard after forward) at the given
world size, one 4,096-token sequence per GPU, bf16, on H100 SXM; the repeated-block capture, so
the IR holds one block body whatever the depth. The capture is repeated per world size (each
rank's parameter shards, hence every collective's size, depend on it); the bandwidth sweep reuses
one capture, since only the network changes. Each schedule is a pass pipeline on the same IR:

- ``captured order`` (``--passes ''``): every collective issued where the captured graph has it;
  a collective waits for the compute before it (NCCL's stream waits for the compute stream).
- ``delayed`` (``reorder-all-gather{prefetch=0 delay=true}``): each gather right before its use,
  after the previous block's compute: the memory-saving variant.
- ``FSDP2 default`` (the default pipeline, ``reorder-all-gather{prefetch=1},sink-waits,assign-streams``):
  one block ahead in forward and backward, all-gathers and reduce-scatters on their own streams,
  reduce-scatters waited for at the end of backward.
- ``reordered, 2 ahead`` (``reorder-all-gather{prefetch=2},sink-waits,assign-streams``).

Networks: (a) ``dgx-h100`` (8 GPUs on NVLink, 450 GB/s each way, in a 400 Gb/s-per-GPU
InfiniBand fat-tree); (b) a flat switch of the given per-GPU bandwidth (2 us latency, NCCL-like
efficiency curves off), 128 GPUs. Peak memory is the tensor-lifetime model's
(``flint/sim/lifetimes.py``): parameters, gradients, optimizer state, activations and gathered
buffers along the schedule, no allocator caching.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "studies"
SEQ = 4096
SCHEDULES = [
    ("captured order", ""),
    ("delayed", "reorder-all-gather{prefetch=0 delay=true}"),
    ("FSDP2 default", "reorder-all-gather{prefetch=1},sink-waits,assign-streams"),
    ("reordered, 2 ahead", "reorder-all-gather{prefetch=2},sink-waits,assign-streams"),
]
GIB = 2 ** 30


def capture(model: str, world: int):
    from flint.capture import capture_step
    from flint.importer import import_step
    from flint.models import factory

    t0 = time.perf_counter()
    batch = (world, SEQ)
    step = capture_step(factory(model), {"tokens": batch, "labels": batch}, world_size=world, plan="fsdp",
                        dtype="bfloat16")
    module = import_step(step)
    print(f"  captured {model} x {world} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return module


def estimate(module, spec: str, network) -> tuple[float, float, float]:
    """(iteration time ms, exposed comm ms, peak memory GiB) of ``module`` under pipeline ``spec``."""
    from xdsl.context import Context

    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.schedule.pipelines import run_pipeline
    from flint.sim import simulate
    from flint.sim.lifetimes import step_memory

    m = module.clone()
    run_pipeline(m, spec)
    mem = step_memory(m)
    CanonicalizeDistPass().apply(Context(), m)
    LowerToChakraPass(device="h100-sxm").apply(Context(), m)
    res = simulate(trace_from_ir(m), load_device("h100-sxm"), network, mesh_of(m))
    return res.iteration_time_us / 1e3, float(res.exposed_comm_us.mean()) / 1e3, mem.peak_bytes / GIB


def _write_keeping_reading(path: Path, text: str) -> None:
    """Write the generated table; a hand-written ``## Reading`` section the page already has is kept after it
    (and flagged on stderr: its figures are the previous run's until someone rereads it)."""
    old = path.read_text() if path.exists() else ""
    at = old.find("\n## Reading")
    if at >= 0:
        text = text.rstrip("\n") + "\n\n" + old[at + 1:]
        print(f"kept the '## Reading' section of {path}: check its figures against the new table", file=sys.stderr)
    path.write_text(text)


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def study_scale(models: list[str], worlds: list[int]) -> None:
    from flint.cost import load_network

    net = load_network("dgx-h100")
    results = {}  # (model, world, schedule) -> (it, exposed, mem)
    for model in models:
        for world in worlds:
            module = capture(model, world)
            for name, spec in SCHEDULES:
                results[(model, world, name)] = estimate(module, spec, net)
                it, ex, mem = results[(model, world, name)]
                print(f"  {model} {world:>5} {name:<20} {it:10.1f} ms  exposed {ex:9.1f} ms  peak {mem:7.2f} GiB",
                      file=sys.stderr)
    rows = []
    for model in models:
        for world in worlds:
            base = results[(model, world, "FSDP2 default")][0]
            for name, _ in SCHEDULES:
                it, ex, mem = results[(model, world, name)]
                rows.append([model, f"{world:,}", name, f"{it:,.1f}", f"{ex:,.1f}", f"{it / base:.3f}", f"{mem:,.2f}"])
    md = [f"# FSDP all-gather reordering across scale\n",
          f"Generated by `bench/study_fsdp_reorder.py scale` (module docstring: setup). Network `dgx-h100`, "
          f"device H100 SXM, one {SEQ}-token sequence per GPU, bf16, AdamW.\n",
          _table(["model", "GPUs", "schedule", "iteration (ms)", "exposed comm (ms)", "time vs FSDP2 default",
                  "peak memory / rank (GiB)"], rows), "", "![iteration time and peak memory](fsdp_reorder_scale.png)", ""]
    OUT.mkdir(parents=True, exist_ok=True)
    _write_keeping_reading(OUT / "fsdp_reorder_scale.md", "\n".join(md))
    _plot_scale(results, models, worlds)
    print(f"wrote {OUT / 'fsdp_reorder_scale.md'} and fsdp_reorder_scale.png")


def _plot_scale(results, models, worlds) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    for c, model in enumerate(models):
        for name, _ in SCHEDULES:
            axes[0][c].plot(worlds, [results[(model, w, name)][0] for w in worlds], marker="o", label=name)
            axes[1][c].plot(worlds, [results[(model, w, name)][2] for w in worlds], marker="o", label=name)
        axes[0][c].set_title(model)
        for r, label in ((0, "iteration time (ms)"), (1, "peak memory per rank (GiB)")):
            axes[r][c].set_xscale("log", base=2)
            axes[r][c].set_xlabel("GPUs")
            axes[r][c].set_ylabel(label)
            axes[r][c].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "fsdp_reorder_scale.png", dpi=110)


def study_bandwidth(model: str, world: int, bandwidths: list[float]) -> None:
    from flint.cost import load_network

    module = capture(model, world)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for bw in bandwidths:
            path = Path(tmp) / f"switch-{bw}.toml"
            path.write_text(f'name = "switch-{bw:g}GBps"\ndescription = "flat switch"\n\n[[dims]]\nname = "switch"\n'
                            f'topology = "switch"\nsize = 0\nbandwidth_gbytes_per_s = {bw}\nlatency_us = 2.0\n')
            net = load_network(str(path))
            for name, spec in SCHEDULES:
                results[(bw, name)] = estimate(module, spec, net)
                it, ex, mem = results[(bw, name)]
                print(f"  {bw:7.1f} GB/s {name:<20} {it:10.1f} ms  exposed {ex:9.1f} ms  peak {mem:7.2f} GiB",
                      file=sys.stderr)
    rows = []
    for bw in bandwidths:
        base = results[(bw, "captured order")][0]
        for name, _ in SCHEDULES:
            it, ex, mem = results[(bw, name)]
            rows.append([f"{bw:g}", name, f"{it:,.1f}", f"{ex:,.1f}", f"{(base - it) / base:+.1%}", f"{mem:,.2f}"])
    md = [f"# FSDP all-gather reordering against link bandwidth\n",
          f"Generated by `bench/study_fsdp_reorder.py bandwidth` (module docstring: setup). {model}, {world} GPUs "
          f"on a flat switch, H100 SXM, one {SEQ}-token sequence per GPU, bf16, AdamW.\n",
          _table(["GB/s per GPU", "schedule", "iteration (ms)", "exposed comm (ms)", "gain vs captured order",
                  "peak memory / rank (GiB)"], rows), "", "![iteration time vs bandwidth](fsdp_reorder_bandwidth.png)", ""]
    OUT.mkdir(parents=True, exist_ok=True)
    _write_keeping_reading(OUT / "fsdp_reorder_bandwidth.md", "\n".join(md))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, _ in SCHEDULES:
        ax.plot(bandwidths, [results[(bw, name)][0] for bw in bandwidths], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-GPU link bandwidth (GB/s)")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(f"{model}, {world} GPUs, FSDP")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "fsdp_reorder_bandwidth.png", dpi=110)
    print(f"wrote {OUT / 'fsdp_reorder_bandwidth.md'} and fsdp_reorder_bandwidth.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="study", required=True)
    a = sub.add_parser("scale", help="(a) 8B and 70B from 8 to 1,024 GPUs")
    a.add_argument("--models", default="llama3-8b,llama3-70b")
    a.add_argument("--worlds", default="8,32,128,512,1024")
    b = sub.add_parser("bandwidth", help="(b) 70B against per-GPU link bandwidth")
    b.add_argument("--model", default="llama3-70b")
    b.add_argument("--world", type=int, default=128)
    b.add_argument("--bandwidths", default="12.5,25,50,500")
    args = ap.parse_args(argv)
    if args.study == "scale":
        study_scale(args.models.split(","), [int(w) for w in args.worlds.split(",")])
    else:
        study_bandwidth(args.model, args.world, [float(x) for x in args.bandwidths.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
