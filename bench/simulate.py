"""Benchmark: simulate one Llama-3-70B training iteration at 1,024 ranks.

Builds the per-rank node graph directly with :mod:`flint.trace` (no capture):
80 layers, FSDP over ``dp`` x tensor parallelism over ``tp`` (mesh (128, 8)),
one symbolic table shared by all ranks plus per-rank group bindings. Per layer
the forward has 12 compute nodes and 4 collectives (FSDP all-gather of the
attention and MLP weights, TP all-reduce after attention and after the MLP),
the backward 24 compute nodes and 6 collectives (re-gather of both weight
groups, two TP all-reduces of input gradients, two FSDP reduce-scatters of
weight gradients). Compute nodes carry FLOPs and bytes only; the device
roofline prices them.

    python bench/simulate.py                   # 1,024 ranks, symmetric reduction
    python bench/simulate.py --full            # also simulate every rank (slow)
    python bench/simulate.py --ranks 64 --full --timeline out/llama70b.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from flint.cost import load_device, load_network
from flint.mesh import Mesh, assign_group_ids
from flint.sim import simulate, write_chrome_trace
from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

# Llama-3-70B shape
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 80, 8192, 28672, 64, 8, 128, 128256
SEQ, MICRO_BATCH = 8192, 1
BF16 = 2


def build_table(tp: int, dp: int):
    """The per-rank node table (slot 0 = the rank's TP group, slot 1 = its DP group)."""
    TP, DP = 0, 1
    tok = SEQ * MICRO_BATCH
    h_loc, kv_loc = HEADS // tp, max(KV_HEADS // tp, 1)
    q_out, kv_out, ffn = h_loc * HEAD_DIM, kv_loc * HEAD_DIM, FFN // tp
    w_attn = HIDDEN * (q_out + 2 * kv_out) + q_out * HIDDEN  # per TP rank
    w_mlp = 3 * HIDDEN * ffn
    act = tok * HIDDEN * BF16
    b = NodeTableBuilder()

    def mm(name, m, k, n, deps, ctrl=()):
        return b.add_comp(name, flops=2 * m * k * n, tensor_bytes=(m * k + k * n + m * n) * BF16,
                          data_deps=deps, ctrl_deps=ctrl)

    def ew(name, nbytes, deps):
        return b.add_comp(name, flops=0, tensor_bytes=nbytes, data_deps=deps)

    attn_flops = 4 * MICRO_BATCH * h_loc * SEQ * SEQ * HEAD_DIM
    x = ew("embedding", act + VOCAB // tp * HIDDEN * BF16, [])
    saved = []
    prev_qkv = None
    for L in range(LAYERS):
        ctrl = [prev_qkv] if prev_qkv is not None else []
        ag_a = b.add_coll(f"L{L}.ag_attn", CollKind.ALL_GATHER, w_attn * BF16 // dp, DP, ctrl_deps=ctrl)
        ag_m = b.add_coll(f"L{L}.ag_mlp", CollKind.ALL_GATHER, w_mlp * BF16 // dp, DP, ctrl_deps=[ag_a])
        n1 = ew(f"L{L}.norm1", 2 * act, [x])
        qkv = mm(f"L{L}.qkv", tok, HIDDEN, q_out + 2 * kv_out, [n1, ag_a])
        split = ew(f"L{L}.qkv_split", 2 * tok * (q_out + 2 * kv_out) * BF16, [qkv])
        rope = ew(f"L{L}.rope", 4 * tok * (q_out + kv_out) * BF16, [split])
        at = b.add_comp(f"L{L}.attn", flops=attn_flops, tensor_bytes=tok * (2 * q_out + 2 * kv_out) * BF16,
                        data_deps=[rope])
        o = mm(f"L{L}.oproj", tok, q_out, HIDDEN, [at])
        ar_a = b.add_coll(f"L{L}.ar_attn", CollKind.ALL_REDUCE, act, TP, data_deps=[o])
        a1 = ew(f"L{L}.add1", 3 * act, [ar_a, x])
        n2 = ew(f"L{L}.norm2", 2 * act, [a1])
        gu = mm(f"L{L}.gate_up", tok, HIDDEN, 2 * ffn, [n2, ag_m])
        sm = ew(f"L{L}.silu_mul", 3 * tok * ffn * BF16, [gu])
        dn = mm(f"L{L}.down", tok, ffn, HIDDEN, [sm])
        ar_m = b.add_coll(f"L{L}.ar_mlp", CollKind.ALL_REDUCE, act, TP, data_deps=[dn])
        x = ew(f"L{L}.add2", 3 * act, [ar_m, a1])
        saved.append((n1, rope, at, n2, sm))
        prev_qkv = qkv
    head = mm("lm_head", tok, HIDDEN, VOCAB // tp, [x])
    g = ew("loss_and_grad", 4 * tok * VOCAB // tp * BF16, [head])
    g = mm("lm_head.dgrad", tok, VOCAB // tp, HIDDEN, [g])
    prev_ag = None
    rs_all = []
    for L in reversed(range(LAYERS)):
        n1, rope, at, n2, sm = saved[L]
        ctrl = [prev_ag] if prev_ag is not None else []
        ag_m = b.add_coll(f"L{L}.bwd.ag_mlp", CollKind.ALL_GATHER, w_mlp * BF16 // dp, DP, ctrl_deps=ctrl)
        ag_a = b.add_coll(f"L{L}.bwd.ag_attn", CollKind.ALL_GATHER, w_attn * BF16 // dp, DP, ctrl_deps=[ag_m])
        prev_ag = ag_a
        rc2 = ew(f"L{L}.bwd.norm2_recompute", 2 * act, [n2])
        rcs = ew(f"L{L}.bwd.silu_recompute", 3 * tok * ffn * BF16, [sm])
        dd = mm(f"L{L}.bwd.down_dgrad", tok, HIDDEN, ffn, [g, ag_m])
        dw = mm(f"L{L}.bwd.down_wgrad", ffn, tok, HIDDEN, [g, rcs])
        smb = ew(f"L{L}.bwd.silu_mul", 4 * tok * ffn * BF16, [dd, rcs])
        gud = mm(f"L{L}.bwd.gate_up_dgrad", tok, 2 * ffn, HIDDEN, [smb, ag_m])
        guw = mm(f"L{L}.bwd.gate_up_wgrad", HIDDEN, tok, 2 * ffn, [smb, rc2])
        ar_m = b.add_coll(f"L{L}.bwd.ar_mlp", CollKind.ALL_REDUCE, act, TP, data_deps=[gud])
        c_dw = ew(f"L{L}.bwd.cast_down_grad", HIDDEN * ffn * (BF16 + 4), [dw])
        c_guw = ew(f"L{L}.bwd.cast_gate_up_grad", 2 * HIDDEN * ffn * (BF16 + 4), [guw])
        rs_m = b.add_coll(f"L{L}.bwd.rs_mlp", CollKind.REDUCE_SCATTER, w_mlp * BF16, DP, data_deps=[c_dw, c_guw])
        n2b = ew(f"L{L}.bwd.norm2", 3 * act, [ar_m])
        g1 = ew(f"L{L}.bwd.add1", 3 * act, [n2b, g])
        rc1 = ew(f"L{L}.bwd.norm1_recompute", 2 * act, [n1])
        rcr = ew(f"L{L}.bwd.rope_recompute", 4 * tok * (q_out + kv_out) * BF16, [rope])
        od = mm(f"L{L}.bwd.oproj_dgrad", tok, HIDDEN, q_out, [g1, ag_a])
        ow = mm(f"L{L}.bwd.oproj_wgrad", q_out, tok, HIDDEN, [g1, at])
        atb = b.add_comp(f"L{L}.bwd.attn", flops=int(2.5 * attn_flops), data_deps=[od, rcr],
                         tensor_bytes=tok * (4 * q_out + 4 * kv_out) * BF16)
        rpb = ew(f"L{L}.bwd.rope", 4 * tok * (q_out + kv_out) * BF16, [atb])
        cat = ew(f"L{L}.bwd.qkv_cat", 2 * tok * (q_out + 2 * kv_out) * BF16, [rpb])
        qd = mm(f"L{L}.bwd.qkv_dgrad", tok, q_out + 2 * kv_out, HIDDEN, [cat, ag_a])
        qw = mm(f"L{L}.bwd.qkv_wgrad", HIDDEN, tok, q_out + 2 * kv_out, [cat, rc1])
        ar_a = b.add_coll(f"L{L}.bwd.ar_attn", CollKind.ALL_REDUCE, act, TP, data_deps=[qd])
        c_ow = ew(f"L{L}.bwd.cast_oproj_grad", q_out * HIDDEN * (BF16 + 4), [ow])
        c_qw = ew(f"L{L}.bwd.cast_qkv_grad", HIDDEN * (q_out + 2 * kv_out) * (BF16 + 4), [qw])
        rs_a = b.add_coll(f"L{L}.bwd.rs_attn", CollKind.REDUCE_SCATTER, w_attn * BF16, DP, data_deps=[c_ow, c_qw])
        n1b = ew(f"L{L}.bwd.norm1", 3 * act, [ar_a])
        g = ew(f"L{L}.bwd.add2", 3 * act, [n1b, g1])
        rs_all += [rs_m, rs_a]
    shard_params = (LAYERS * (w_attn + w_mlp) + 2 * VOCAB // tp * HIDDEN) // dp
    b.add_comp("optimizer.adamw", flops=0, tensor_bytes=shard_params * (BF16 + 4 * 4 + 4 * 3), data_deps=rs_all)
    return b.build()


def build_trace(world: int, tp: int = 8):
    dp = world // tp
    mesh = Mesh((dp, tp), ("dp", "tp"))
    groups, lookup = assign_group_ids(mesh, [("tp",), ("dp",)])
    t0 = time.perf_counter()
    table = build_table(tp, dp)
    tp_ids, dp_ids = lookup[(1,)], lookup[(0,)]
    empty = np.zeros(0, dtype=np.int64)
    ranks = [RankProgram(table, np.array([tp_ids[r], dp_ids[r]]), empty) for r in range(world)]
    trace = Trace(world, ranks, groups)
    return trace, mesh, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--device", default="h100-sxm")
    ap.add_argument("--network", default="dgx-h100")
    ap.add_argument("--full", action="store_true", help="also simulate every rank (no symmetric reduction)")
    ap.add_argument("--timeline", help="write a Chrome-trace JSON of the representative rank here")
    args = ap.parse_args()
    trace, mesh, build_s = build_trace(args.ranks, args.tp)
    dev, net = load_device(args.device), load_network(args.network)
    tokens = SEQ * MICRO_BATCH * (args.ranks // args.tp)
    n_params = LAYERS * (HIDDEN * (HEADS * HEAD_DIM * 2 + 2 * KV_HEADS * HEAD_DIM) + 3 * HIDDEN * FFN) + 2 * VOCAB * HIDDEN
    model_flops = 6 * n_params * tokens  # the usual 6·N·D (attention excluded)
    rows = []
    modes = [("symmetric", True)] + ([("full", False)] if args.full else [])
    results = {}
    for label, sym in modes:
        t0 = time.perf_counter()
        res = simulate(trace, dev, net, mesh, model_flops=model_flops, symmetric=sym)
        wall = time.perf_counter() - t0
        results[label] = res
        rows.append((label, res.nodes, res.simulated_nodes, res.events, res.events / wall, wall,
                     res.iteration_time_us / 1e3, res.exposed_comm_us.mean() / 1e3, res.mfu))
    print(f"Llama-3-70B, {args.ranks} ranks, mesh {mesh.shape} {mesh.axis_names}, {args.device} on {args.network}; "
          f"table {len(trace.ranks[0].table)} nodes/rank, built in {build_s:.2f} s")
    hdr = ("mode", "nodes", "simulated", "events", "events/s", "wall s", "iter ms", "exposed ms", "MFU (6ND)")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print(f"| {r[0]} | {r[1]:,} | {r[2]:,} | {r[3]:,} | {r[4]:,.0f} | {r[5]:.2f} | {r[6]:.1f} | {r[7]:.1f} | {r[8]:.1%} |")
    if args.full:
        a, b = results["symmetric"], results["full"]
        print(f"symmetric vs full iteration time: {a.iteration_time_us:.3f} vs {b.iteration_time_us:.3f} us")
    if args.timeline:
        print("timeline:", write_chrome_trace(results["symmetric"], args.timeline))


if __name__ == "__main__":
    main()
