"""Flint's estimates against published training runs: one command, writes docs/accuracy.md and its chart.

    .venv/bin/python bench/accuracy.py [--rows M1,M2] [--out docs]

Every row of ``bench/accuracy_rows.toml`` (the project's public rows: Megatron-LM's weak-scaling
table on H100, Korthikanti et al.'s iteration times on A100) is estimated from its stated
configuration only: the GPT model with the row's shape is captured with PyTorch on fake tensors
under the row's plan, ``fuse-pointwise{parts=block inline=false}`` groups the blocks' pointwise chains
into fused kernels (Megatron fuses its layers by hand, and its kernels store every value two kernels
read, where inductor would compute a cheap one again in each; its embedding and loss run eagerly, one
kernel per op),
``lower-to-chakra`` prices it with the device's calibration, and the simulator runs one iteration
on the row's network with NCCL's algorithm choice (``auto``). No parameter is fitted to any row:
the device calibrations (flint/devices/calibration/) and network curves (flint/networks/) are the
sourced ones, used unchanged.

Then, as a second set of figures, one factor per device fitted to that device's rows: the
calibration's ``sustained_fraction`` (every compute kernel's time / it), which the sourced
calibrations leave at 1. Each row is simulated at ``SUSTAINED_GRID`` (the lowered trace with its
compute durations scaled, ``Trace.with_compute_scaled``, which equals lowering on a calibration with
that factor); ``fit_sustained`` picks the factor minimising the mean absolute throughput error
(interpolated between the grid's simulations). Leave-one-configuration-out (``leave_one_out``): each
row is simulated again at the factor fitted on the other configurations of its device, never on
itself. The fit on all of a device's rows is written to ``flint/devices/calibration/fitted/<device>.toml``
(a ``--calibration`` file; only by a run of every row).

Throughput is Megatron's model TFLOP/s per GPU (Narayanan et al. 2021, no recompute counted):
``72 B s L h^2 (1 + s / 6h) + 6 B s h V`` FLOPs per iteration over iteration time x GPUs; MFU
against the device's dense bf16 peak. A row Flint cannot express yet (pipeline parallelism,
activation checkpointing, ...) is listed with the reason the plan or capture gives, taken from
``Plan.require`` at run time: such rows light up by themselves once capture implements the field.

Defaults where a row leaves a detail unstated (Megatron's own defaults; what a row's source
states wins), and what Flint does not model:

- Model: Megatron's GPT: learned absolute positions, LayerNorm, one fused QKV projection
  (``linear_qkv``, heads interleaved; in every Megatron version, so in the S rows too), GELU MLP of
  4h, biases, untied embeddings, ``hidden_dropout`` = ``attention_dropout`` = 0.1 (TransformerConfig
  defaults).
  Megatron-Core 0.8 rows (M) use fused attention with dropout, Transformer Engine's, which runs cuDNN's
  kernel on Hopper (``attention-kernel{kernel=cudnn}``); the 2022 A100 rows (S,
  ``attention = "unfused"``) Megatron's core attention of then: QK^T, fused scale-mask-softmax,
  dropout, xV, materialized per head. Korthikanti's selective recomputation checkpoints exactly
  that core attention (``torch.utils.checkpoint`` in the captured model); full recomputation is
  the plan's ``activation_checkpoint = "full"``.
- Eager execution: Megatron runs without ``torch.compile``. Its layers' pointwise ops are fused by
  hand (fused LayerNorm, bias-GELU, bias-dropout-add, scale-mask-softmax), which ``fuse-pointwise``
  stands for inside the blocks; the embedding and the loss run one kernel per op. At TP 1 the loss is
  Megatron's own cross-entropy (``megatron/core/tensor_parallel/cross_entropy.py``: fp32 copy of the
  logits, max, subtract, exp, sum, divide, the softmax saved for backward, which scales it by the
  incoming gradient: ``_megatron_cross_entropy``). The backward reads what eager autograd saved
  (``capture_step(partitioner="eager")``), not what torch.compile's min-cut partitioner would keep.
- Parallelism: sequence parallelism whenever TP > 1, and Megatron's vocab-parallel cross-entropy
  (the plan's ``loss_parallel``: torch's ``loss_parallel``; fp32 on the vocabulary shards, per-token
  max and sum all-reduces, no all-gather of the logits). Data parallelism of the M rows (Megatron-Core
  0.8): the distributed optimizer with gradients reduced in fp32 (the README's command for these
  runs states ``--overlap-grad-reduce --overlap-param-gather``, and ``megatron/training/arguments.py``
  allows ``--overlap-param-gather`` only with ``--use-distributed-optimizer`` and forces
  ``accumulate_allreduce_grads_in_fp32`` for bf16). Its PyTorch counterpart, captured:
  ``fully_shard(reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32))`` on an fp32 model (plan ``dp_shard`` = DP, ``zero = 2``,
  ``param_dtype = "bfloat16"``, ``reduce_dtype = "float32"``; Megatron's bf16 model with fp32 main
  parameters in the optimizer): per block one bf16 parameter all-gather, issued one block ahead of its forward (``reorder-all-gather{prefetch=1}``:
  Megatron's forward pre-hook waits for a bucket's gather and dispatches the next; under a
  pipeline the chain runs across model chunks, as Megatron numbers its gather handles) in the first
  micro-batch only (the gathered parameters stay for the step: one gather per step, which in
  steady state is Megatron's gather overlapped with the next iteration's forward); one fp32
  gradient reduce-scatter per block in the last micro-batch's backward, waited for only before the
  optimizer (``lower-to-chakra{grad-wait=optimizer}``: Megatron's ``finish_grad_sync``); the fp32 AdamW
  step on the 1/DP shard. All data-parallel collectives run on their own stream
  (``assign-streams{data-parallel=dp}``: Megatron's DP communicator, apart from the TP one); TP
  collectives stay in the compute stream's order. The S rows (2022) have no data parallelism; their
  optimizer is Megatron's mixed-precision one (``Float16OptimizerWithFloat16Params``, which every
  Megatron bf16 / fp16 run uses): the bf16 model's fp32 main parameters and fp32 Adam state, the
  gradients cast to fp32, the result copied back into the model (plan ``master_dtype = "float32"``).
  The optimizer step is multi-tensor, as Megatron's: its Adam is a fused multi-tensor kernel
  (apex's ``FusedAdam``, or Transformer Engine's in Megatron-Core when installed; the 2022 runs had
  apex), and it copies main parameters into the model with one multi-tensor copy. Plan
  ``optimizer_impl = "fused"``: torch's ``_fused_adamw_`` per part, one ``_foreach_copy_`` (README,
  "The optimizer's form").
  Gradient-norm clipping at Megatron-LM's default ``--clip-grad 1.0`` (plan ``max_norm = 1.0``;
  neither source states another): the captured ``clip_grad_norm_`` (README, "Gradient-norm
  clipping") in its multi-tensor form (``_foreach_norm``, ``_foreach_mul_``; Megatron runs apex's
  ``multi_tensor_l2norm`` and ``multi_tensor_scale``) and the norm's all-reduces. Megatron's own
  clipping differs in the norm over its fp32 main gradients (Flint: the gradients in the model's
  dtype) and one all-reduce of the squared norm over its model-parallel group (with the distributed
  optimizer, over every rank) where torch reduces per mesh axis. Megatron also accumulates the
  gradients in an fp32 buffer, which Flint does not (about 2 bytes per parameter more read by the
  step), and its main gradients need no cast, where Flint's master form casts each gradient to fp32
  (one kernel per gradient).
  Micro-batch: the row's (S rows); the M rows leave it unstated, so Megatron-LM's own
  example (``examples/gpt3/train_gpt3_175b_distributed.sh``: ``--micro-batch-size 1``): the local
  batch runs as micro-batches of one sequence with gradient accumulation, gradients reduced once
  per step (after the last micro-batch), also without pipelining. The table admits a second reading:
  every M row's local batch per pipeline is 4 x PP sequences (global batch / DP), which is also PP
  micro-batches of 4 (without pipelining one pass of 4 sequences, whose whole backward then hides the
  gradient reduce-scatters). Each M row is estimated at both; the report's ``other micro-batch``
  column shows the second, so the reader sees how much this unstated detail moves the row. The
  headline figures are micro-batch 1's.
  Pipeline rows: the row's interleaving (S rows). The M rows' source states that pipeline
  communication was overlapped with computation, which Megatron-LM supports only under its
  interleaved schedule (``megatron/training/arguments.py``: without virtual stages it sets
  ``overlap_p2p_comm = False``, "non-interleaved schedule does not support overlapping p2p
  communication"), so the M rows run interleaved 1F1B. The virtual-stage count is unstated;
  Megatron-Core 0.8 needs the layers per pipeline rank to be a multiple of
  ``--num-layers-per-virtual-pipeline-stage``, and M6 (23 layers per rank) and M9 (7) admit only
  1, so every M row uses one layer per virtual stage (virtual stages = layers / PP). Flint runs
  PyTorch's ``Interleaved1F1B`` order; the rows set ``pp_p2p = "overlap"`` (Megatron's
  ``overlap_p2p_comm``, stated by their source), which under a multi-stage schedule is what
  torch's runtime runs too: sends asynchronous, each recv posted at its ``RECV`` action and
  waited for by the compute that reads it (``pp_p2p = "blocking"`` waits for every send and
  recv where torch's order issues it: M5 3.643 s instead of 1.907 s, session 27). In session 22
  only 14 ms of M5's 225 ms of send/recv per rank was on the critical path (2.385 s with free
  transfers against 2.399 s; not measured since).
- TP communication overlap: rows with ``tp_comm_overlap = true`` (the M rows; their source states
  ``--tp-comm-overlap``) run ``micro-pipeline-tp{sms=16}`` (PyTorch's async TP: each all-gather -> GEMM and
  GEMM -> reduce-scatter as n - 1 peer-to-peer steps under 1/n-row GEMMs), after ``fuse-pointwise``;
  each reduce-scatter step's kernel holds 16 SMs while in flight, as Transformer Engine's userbuffers
  reduce-scatters do (``initialize_ub``'s default ``num_sm``; its all-gathers use the copy engines).
  With Megatron's fused QKV projection every tensor-parallel reduce-scatter is a GEMM's and is
  pipelined (three separate projections left the sum of their data gradients exposed). What stays
  exposed: the embedding's all-reduce (as in Megatron-Core: with learned positions its
  ``LanguageModelEmbedding`` all-reduces, then scatters to the sequence shards) and the
  sequence-parallel norms' gradient all-reduces (DTensor's, per layer and micro-batch; Megatron
  coalesces them once per step) (the ``if comm hidden`` column bounds what is left).
- SM sharing: compute slows while a collective of its rank is in flight (the device calibration's
  ``comm_sms``: NCCL's CTAs hold 24 of the H100's 132 SMs, 16 of the A100's 108); point-to-point
  transfers (pipeline sends, async-TP steps) do not hold SMs in Flint's model, except the
  reduce-scatter steps' (``sms=16``, above).
- NIC sharing: transfers crossing one rank's port share it (the simulator's max-min fair ports): on
  the pipelined M rows the stage-to-stage sends and the data-parallel reduce-scatters and gathers
  both leave through the GPU's 400 Gb/s NIC. Attention dropout: cuDNN's kernel with dropout costs the
  calibration's ``dropout_overhead`` (+3.4% on Hopper, measured).
- Not modelled: Transformer Engine's bulk overlaps beyond torch's patterns (above). Megatron's
  distributed optimizer keeps a persistent bf16 copy of the whole model and the whole fp32 gradient
  buffer (memory only; this report prices time), writes weight gradients straight into that buffer
  (Flint: FSDP2's copy-in and copy-out around the gather, on the compute stream, once per step); its
  buckets (about one block each at DP 48) are Flint's per-block groups.

Capture cost does not grow with depth: every row is captured with two blocks and the repeated
block's count set to the row's depth (``capture_row``), which gives the same estimate as a
full-depth capture (tests/test_accuracy_bench.py). A row Flint fails on is reported with its error.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
ROWS = Path(__file__).with_name("accuracy_rows.toml")
CAPTURE_LAYERS = 2  # blocks built and parallelized for capture; the IR repeats ONE block to the row's depth
DROPOUT = 0.1  # Megatron TransformerConfig: hidden_dropout = attention_dropout = 0.1 (defaults)
# Megatron runs the data-parallel collectives on the DP communicator, concurrently with the TP
# collectives and overlapped with backward (--overlap-grad-reduce): the distributed optimizer's
# gradient reduce-scatters and parameter all-gathers (M rows, the gathers one block ahead:
# --overlap-param-gather), on their own stream; the reductions are waited for before the optimizer
# (finish_grad_sync: lower-to-chakra{grad-wait=optimizer}). TP collectives stay in the compute stream's order.
PASSES = "sink-waits,assign-streams{data-parallel=dp}"
GRAD_WAIT = "optimizer"
# Megatron fuses its layers' pointwise ops by hand (bias-GELU, bias-dropout-add, fused LayerNorm, fused
# softmax) and runs the embedding and the cross-entropy eagerly, one kernel per op
BLOCK_PARTS = ("block",)
# Megatron runs eagerly: the backward reads what autograd saved (AOTAutograd's default partitioner), not
# what torch.compile's min-cut partitioner would save and recompute
PARTITIONER = "eager"
# --tp-comm-overlap runs Transformer Engine's userbuffers overlap; its initialize_ub defaults (TE 1.x,
# transformer_engine/pytorch/module/base.py: add_ub's num_sm = 16) run the pipelined and bulk
# reduce-scatters as kernels on 16 SMs, the ring-exchange all-gathers on the copy engines
TE_UB_SMS = 16
# Megatron-Core's fused attention is Transformer Engine's DotProductAttention, which prefers cuDNN's
# kernel on Hopper (TE's attention guide: "sm90: cuDNN attention > flash-attention"); Flint's default
# prices PyTorch's flash backend (FlashAttention-2)
ATTENTION_KERNEL = "cudnn"
GATHER_AHEAD = "reorder-all-gather{prefetch=1}"  # rows with sharded (dp_shard) parameters only
# Rows of Megatron-Core 0.8 (Megatron-LM README, commit f2e5db402c): distributed optimizer, fp32 gradient
# reduction (module docstring)
DISTRIBUTED_OPTIMIZER_SOURCE = "Megatron-LM weak scaling"


@dataclass
class Result:
    row: dict
    status: str                      # "estimated", "not expressible", "failed" or "skipped"
    reason: str = ""
    iteration_s: float = math.nan
    tflops_per_gpu: float = math.nan
    mfu: float = math.nan
    flint_mfu: float = math.nan
    wall_s: float = 0.0
    compute_s: float = math.nan      # compute stream busy, mean over ranks
    exposed_s: float = math.nan      # communication not hidden by compute, mean over ranks
    alt_error: float = math.nan      # the throughput error at the row's other reading of an unstated micro-batch
    breakdown: dict | None = None    # compute kernels by op class (flint.sim.breakdown, JSON form)
    # the iteration (s) simulated with every compute kernel's time / f, for f in SUSTAINED_GRID (fit_sustained)
    iteration_at: dict[float, float] = field(default_factory=dict)
    loo_fraction: float = math.nan   # the sustained fraction fitted without this row's configuration
    loo_error: float = math.nan      # the throughput error at it (simulated)
    # simulate this row again with every compute kernel's time / f: iteration s (None once the fits are done)
    resimulate: Callable[[float], float] | None = field(default=None, repr=False, compare=False)

    @property
    def published(self) -> float:
        return self.row.get("tflops_per_gpu", self.row.get("iteration_s", math.nan))

    @property
    def estimate(self) -> float:
        return self.tflops_per_gpu if "tflops_per_gpu" in self.row else self.iteration_s

    @property
    def error(self) -> float:
        """Throughput error: (estimated - published) / published throughput (for iteration-time rows,
        published time / estimated time - 1)."""
        if self.status != "estimated":
            return math.nan
        if "tflops_per_gpu" in self.row:
            return (self.estimate - self.published) / self.published
        return self.published / self.estimate - 1

    @property
    def published_iteration_s(self) -> float:
        """The published iteration time (for throughput rows: Megatron's FLOPs / (published rate x GPUs))."""
        if "tflops_per_gpu" in self.row:
            return megatron_flops(self.row) / (self.row["tflops_per_gpu"] * 1e12 * self.row["gpus"])
        return self.row["iteration_s"]

    def error_at(self, iteration_s: float) -> float:
        """The throughput error if Flint's iteration took ``iteration_s``."""
        return self.published_iteration_s / iteration_s - 1

    @property
    def error_comm_hidden(self) -> float:
        """The throughput error if every exposed communication were hidden (a sensitivity, not an estimate)."""
        if self.status != "estimated":
            return math.nan
        return (1 + self.error) * self.iteration_s / (self.iteration_s - self.exposed_s) - 1


def ideal_bubble(row: dict) -> float:
    """The schedule's textbook bubble fraction (p - 1) / (v m + p - 1) (0 without pipelining)."""
    p = row["pp"]
    if p == 1:
        return 0.0
    m = row["global_batch"] // (row["gpus"] // (row["tp"] * p)) // row.get("microbatch", 1)
    return (p - 1) / (row.get("interleave", 1) * m + p - 1)


def megatron_flops(row: dict) -> float:
    """Model FLOPs of one iteration (Megatron's formula, no recompute)."""
    b, s, L, h, v = row["global_batch"], row["seq"], row["layers"], row["hidden"], row["vocab"]
    return 72 * b * s * L * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v


# Calibration fitted per device, as issue 14 allows ("fitted once per device, its data stated, and tested
# leave-one-out on the rows it was not fitted to"): one factor, the calibration's sustained_fraction (every
# compute kernel's time / it; flint/cost/calibration.py), fitted to a device's published rows and reported
# leave-one-configuration-out: each row estimated with the factor fitted on the OTHER configurations of its device.
SUSTAINED_GRID = (0.7, 0.8, 0.9, 1.0)  # each row simulated at these; the fit interpolates between them
FIT_STEP = 0.0025                      # the fitted factor's resolution


def configuration(row: dict) -> str:
    """The configuration a row measures: Korthikanti's full and sel+SP rows of one model (S1-full,
    S1-sel+SP) are one, held out together."""
    return row["id"].split("-")[0]


def interpolated_iteration(r: "Result", fraction: float) -> float:
    """The row's iteration (s) at sustained fraction ``fraction``: linear in 1 / fraction between the
    fractions it was simulated at (``r.iteration_at``)."""
    pts = sorted((1 / f, t) for f, t in r.iteration_at.items())
    x = 1 / fraction
    if not pts[0][0] <= x <= pts[-1][0]:
        raise ValueError(f"sustained fraction {fraction} is outside the simulated {sorted(r.iteration_at)}")
    for (x0, t0), (x1, t1) in zip(pts, pts[1:]):
        if x <= x1:
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
    return pts[0][1]  # a single point


def fit_sustained(rows: list["Result"]) -> float:
    """The sustained fraction, from 1 down to the grid's lowest in steps of ``FIT_STEP``, that minimises the
    rows' mean absolute throughput error (ties: the larger, nearer the sourced calibration)."""
    n = round((1 - min(SUSTAINED_GRID)) / FIT_STEP)
    candidates = [round(1 - i * FIT_STEP, 6) for i in range(n + 1)]
    return min(candidates, key=lambda f: sum(abs(r.error_at(interpolated_iteration(r, f))) for r in rows))


def leave_one_out(results: list["Result"]) -> None:
    """Each estimated row's ``loo_fraction`` (fitted on the other configurations of its device; none: nan)
    and ``loo_error`` (the row simulated at it)."""
    est = [r for r in results if r.status == "estimated" and r.iteration_at]
    for r in est:
        train = [q for q in est
                 if q.row["device"] == r.row["device"] and configuration(q.row) != configuration(r.row)]
        if train:
            r.loo_fraction = fit_sustained(train)
            r.loo_error = r.error_at(r.resimulate(r.loo_fraction))


@dataclass
class DeviceFit:
    device: str
    fraction: float                 # fitted on every estimated row of the device
    rows: list                      # those rows (Result)
    errors: dict                    # row id -> throughput error at ``fraction`` (simulated)


def device_fits(results: list["Result"]) -> list[DeviceFit]:
    """Per device, the sustained fraction fitted on all its estimated rows and their errors at it."""
    out = []
    for device in sorted({r.row["device"] for r in results}):
        rows = [r for r in results if r.row["device"] == device and r.status == "estimated" and r.iteration_at]
        if rows:
            f = fit_sustained(rows)
            out.append(DeviceFit(device, f, rows, {r.row["id"]: r.error_at(r.resimulate(f)) for r in rows}))
    return out


def fitted_toml(fit: DeviceFit, command: str) -> str:
    """The calibration file of a device fit (``--calibration`` on top of the device's sourced one)."""
    sources = "; ".join(sorted({r.row["source"] for r in fit.rows}))
    loo = [r.loo_error for r in fit.rows if r.loo_error == r.loo_error]
    lines = ["# FITTED, not sourced: the share of the calibrated kernel rates "
             f"(flint/devices/calibration/{fit.device}.toml)",
             "# that published training runs on this device sustained. Every compute kernel's time is divided by it",
             "# (flint/cost/calibration.py, sustained_fraction). Use on top of the device's own calibration:",
             f"#   flint estimate STEP.mlir --device {fit.device} --calibration fitted/{fit.device}",
             f"# Generated by `{command}` (docs/accuracy.md): fitted once, to minimise the mean absolute",
             f"# throughput error over the {len(fit.rows)} published rows of this device: "
             f"{', '.join(r.row['id'] for r in fit.rows)}",
             f"# ({sources}), in steps of {FIT_STEP}. Their mean / max error: sourced calibration "
             f"{_stats([r.error for r in fit.rows])};",
             f"# at this factor (in sample) {_stats(list(fit.errors.values()))}"
             + (f"; leave-one-configuration-out (each row at the factor fitted without it) {_stats(loo)}." if loo
                else "."),
             f'device = "{fit.device}"', f"sustained_fraction = {fit.fraction}"]
    return "\n".join(lines) + "\n"


def plan_of(row: dict):
    from flint.plan import Plan

    tp, pp = row["tp"], row["pp"]
    dp = row["gpus"] // (tp * pp)
    local = row["global_batch"] // dp
    fields = {"tp": tp, "sp": bool(row.get("sequence_parallel", tp > 1)), "pp": pp, "dp_replicate": dp}
    if tp > 1:  # Megatron's vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py), every version
        fields["loss_parallel"] = True
    if row["source"] == DISTRIBUTED_OPTIMIZER_SOURCE and dp > 1:
        # Megatron's distributed optimizer: FSDP2 reshard_after_forward=False, gradients reduced in fp32
        # (fp32 master parameters, which the optimizer steps, gathered and computed in bf16)
        fields.update(dp_replicate=1, dp_shard=dp, zero=2, reduce_dtype="float32", param_dtype="bfloat16")
    else:  # Megatron's mixed-precision optimizer (Float16OptimizerWithFloat16Params), every bf16 / fp16 run:
        # bf16 model, fp32 main parameters and Adam state, the result copied back into the model's
        fields["master_dtype"] = "float32"
    if pp > 1 or "microbatch" in row:  # without pipelining: gradient accumulation over the micro-batches
        fields["microbatches"] = local // row.get("microbatch", 1)
        if row.get("interleave", 1) > 1:
            fields.update(pp_schedule="interleaved-1f1b", pp_virtual_stages=row["interleave"])
        if "pp_p2p" in row:
            fields["pp_p2p"] = row["pp_p2p"]
    fields["max_norm"] = 1.0  # Megatron-LM's default --clip-grad (megatron/training/arguments.py)
    # Megatron's Adam is a multi-tensor fused kernel (apex / Transformer Engine FusedAdam), as are its clipping
    # (apex multi_tensor_l2norm / multi_tensor_scale) and its main-to-model parameter copy
    fields["optimizer_impl"] = "fused"
    recompute = row.get("recompute")
    if recompute == "full":  # selective: the model checkpoints its core attention (megatron_gpt)
        fields["activation_checkpoint"] = "full"
    return Plan.from_dict(fields, world_size=row["gpus"])


def _megatron_cross_entropy():
    import torch

    class MegatronCrossEntropy(torch.autograd.Function):
        """Megatron's cross-entropy as it runs eagerly (``megatron/core/tensor_parallel/cross_entropy.py``,
        one tensor-parallel rank): an fp32 copy of the logits; its max subtracted; the target logit
        picked; exp; the sum over the vocabulary; loss = log(sum) - target logit; the softmax (exp / sum)
        saved for backward, which subtracts one at each target and scales by the incoming gradient.
        Megatron updates the fp32 copy in place; the captured graph has the same reads and writes out
        of place. The backward scales first and subtracts the target's gradient after (the same values;
        the subtraction touches one element per token, as Megatron's indexed update does)."""

        @staticmethod
        def forward(ctx, logits, target):
            x = logits.float()
            x = x - x.max(dim=-1, keepdim=True)[0]
            predicted = x.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            x = x.exp()
            sum_exp = x.sum(dim=-1)
            loss = torch.log(sum_exp) - predicted
            ctx.save_for_backward(x / sum_exp.unsqueeze(-1), target)
            return loss

        @staticmethod
        def backward(ctx, grad):
            softmax, target = ctx.saved_tensors
            g = softmax * grad.unsqueeze(-1)
            return g.scatter_add(-1, target.unsqueeze(-1), -grad.unsqueeze(-1)), None

    return MegatronCrossEntropy


def megatron_gpt(row: dict):
    """Factory of the row's GPT as Megatron runs it (module docstring): flint's GPT-2 zoo model
    (module names kept, so TP rules and parameter groups apply unchanged) with Megatron's
    dropout (``hidden_dropout`` = ``attention_dropout`` = 0.1, TransformerConfig's defaults), one fused
    QKV projection ``wqkv`` (Megatron's ``linear_qkv``: its output holds q, k, v head by head, so a
    colwise TP shard holds whole heads and the data gradient is one GEMM) and,
    for rows that predate fused attention (``attention = "unfused"``: Korthikanti et al. 2022),
    Megatron's core attention: QK^T, fused scale-mask-softmax, attention dropout, xV, which is
    also what its selective recomputation checkpoints (``recompute = "selective"``)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from flint.models import factory
    from flint.models.gpt2 import Attention

    MegatronCrossEntropy = _megatron_cross_entropy()
    p = float(row.get("dropout", DROPOUT))
    unfused = row.get("attention", "fused") == "unfused"
    selective = row.get("recompute") == "selective"

    class MegatronAttention(Attention):
        def core(self, q, k, v):
            if not unfused:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            s = q.shape[-2]
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            probs = F.dropout(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1), p)
            return torch.matmul(probs, v)

        def forward(self, x):
            bsz, seq, _ = x.shape
            qkv = self.wqkv(x).view(bsz, seq, -1, 3 * self.head_dim)
            q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))
            out = checkpoint(self.core, q, k, v, use_reentrant=False) if selective else self.core(q, k, v)
            return F.dropout(self.wo(out.transpose(1, 2).reshape(bsz, seq, -1)), p)

    def mlp_forward(self, x):
        return F.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")), p)

    def head_forward(self, h, labels):  # TP 1: Megatron's own cross-entropy (MegatronCrossEntropy)
        return MegatronCrossEntropy.apply(self.output(self.norm(h)), labels).mean()

    base = factory("gpt2-small", dim=row["hidden"], n_layers=row["layers"], n_heads=row["heads"],
                   vocab_size=row["vocab"], ffn_dim=4 * row["hidden"], max_seq_len=row["seq"])

    def make():
        model = base()
        for block in model.layers:
            old = block.attention
            new = MegatronAttention.__new__(MegatronAttention)
            new.__dict__.update(old.__dict__)
            h = row["hidden"]
            for name in ("wq", "wk", "wv"):
                del new._modules[name]
            new.wqkv = torch.nn.Linear(h, 3 * h)
            block.attention = new
            mlp = block.feed_forward
            mlp.forward = mlp_forward.__get__(mlp)
        if row["tp"] == 1:  # with TP, the plan's loss_parallel: torch's vocabulary-parallel loss (plan_of)
            model.head.forward = head_forward.__get__(model.head)
        return model

    return make


def capture_row(row: dict, plan):
    """The row's step, captured with ``CAPTURE_LAYERS`` blocks and the repeated block's count set to
    the row's depth: the IR has one body per repeated block (pipeline-split cuts the repeat count
    into stages), so capturing more layers only builds and parallelizes more identical modules."""
    from dataclasses import replace

    from flint.capture import capture_step

    few = dict(row, layers=min(row["layers"], CAPTURE_LAYERS))
    make = megatron_gpt(few)

    def model():  # CAPTURE_LAYERS real blocks; the config states the row's depth for the plan's checks
        m = make()
        m.config = replace(m.config, n_layers=row["layers"])
        return m

    shape = (row["global_batch"], row["seq"])
    # bf16 parameters, or fp32 master parameters that FSDP gathers in bf16 (plan.param_dtype)
    dtype = "float32" if plan.param_dtype == "bfloat16" else "bfloat16"
    step = capture_step(model, {"tokens": shape, "labels": shape}, plan=plan, dtype=dtype, partitioner=PARTITIONER)
    blocks = [p for p in step.parts if p.name == "block"]
    if len(blocks) != 1 or blocks[0].repeat != few["layers"]:
        raise RuntimeError(f"{row['id']}: expected one repeated block of {few['layers']} layers, got "
                           f"{[(p.name, p.repeat) for p in step.parts]}")
    step.parts = [replace(p, repeat=row["layers"]) if p.name == "block" else p for p in step.parts]
    return step


def estimate(row: dict) -> Result:
    from xdsl.context import Context

    from flint.capture.recipes import CAPTURE_FIELDS
    from flint.chakra.from_ir import mesh_of, trace_from_ir
    from flint.cost import load_device, load_network
    from flint.errors import FlintError
    from flint.importer import import_step
    from flint.passes.attention_kernel import AttentionKernelPass
    from flint.passes.canonicalize_dist import CanonicalizeDistPass
    from flint.passes.fuse_pointwise import FusePointwisePass
    from flint.passes.lower_to_chakra import LowerToChakraPass
    from flint.passes.micro_pipeline_tp import MicroPipelineTPPass
    from flint.schedule.pipelines import run_pipeline
    from flint.sim import simulate
    from flint.sim.breakdown import compute_breakdown

    t0 = time.perf_counter()
    try:
        plan = plan_of(row)
        plan.require(CAPTURE_FIELDS, "capture")
    except FlintError as e:
        return Result(row, "not expressible", str(e))
    device, network = load_device(row["device"]), load_network(row["network"])
    step = capture_row(row, plan)
    module = import_step(step)
    ctx = Context()
    if row.get("attention", "fused") == "fused":  # Megatron-Core's attention: TE's, cuDNN's kernel on Hopper
        AttentionKernelPass(kernel=ATTENTION_KERNEL).apply(ctx, module)
    # hand-fused kernels store what two kernels read; inductor's inlining of cheap values is not Megatron's
    FusePointwisePass(device=row["device"], parts=BLOCK_PARTS, inline=False).apply(ctx, module)
    CanonicalizeDistPass().apply(ctx, module)
    if row.get("tp_comm_overlap") and row["tp"] > 1:  # after fuse-pointwise, which re-prices every op it sees
        MicroPipelineTPPass(sms=TE_UB_SMS).apply(ctx, module)
    run_pipeline(module, f"{GATHER_AHEAD},{PASSES}" if plan.dp_shard > 1 else PASSES)
    LowerToChakraPass(device=row["device"], grad_wait=GRAD_WAIT, class_times=True).apply(ctx, module)
    breakdown = compute_breakdown(module)  # where the compute goes
    mesh = mesh_of(module)
    trace = trace_from_ir(module)
    result = simulate(trace, device, network, mesh, algorithm="auto")
    it_s = result.iteration_time_us * 1e-6
    tflops = megatron_flops(row) / (it_s * row["gpus"]) / 1e12
    alt_error = math.nan
    if "microbatch_alternative" in row:  # the same row at the other reading of its unstated micro-batch
        other = {k: v for k, v in row.items() if k != "microbatch_alternative"}
        alt_error = estimate(dict(other, microbatch=row["microbatch_alternative"])).error

    @cache
    def resimulate(fraction: float) -> float:  # Trace.with_compute_scaled: as a calibration's sustained_fraction
        scaled = trace.with_compute_scaled(1 / fraction)
        return simulate(scaled, device, network, mesh, algorithm="auto").iteration_time_us * 1e-6

    return Result(row, "estimated", "", it_s, tflops, tflops * 1e12 / device.peak_flops_per_s("bf16"), result.mfu,
                  time.perf_counter() - t0, float(result.compute_busy_us.mean()) * 1e-6,
                  float(result.exposed_comm_us.mean()) * 1e-6, alt_error,
                  breakdown.to_json() if breakdown is not None else None, resimulate=resimulate)


def _rest(r: Result) -> float:
    """Iteration - compute - exposed comm: pipeline bubble and waiting (float noise below 0.5 ms shown as 0)."""
    rest = r.iteration_s - r.compute_s - r.exposed_s
    return 0.0 if abs(rest) < 5e-4 else rest


def _alt(r: Result) -> str:
    """The other-micro-batch cell: the error and the micro-batch it assumes (empty where the row states it)."""
    if "microbatch_alternative" not in r.row:
        return ""
    return f"{_fmt(100 * r.alt_error, '+.1f')}% (micro-batch {r.row['microbatch_alternative']})"


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x != x else format(x, spec)


def write_report(results: list[Result], out: Path, command: str = ".venv/bin/python bench/accuracy.py",
                 fits: list[DeviceFit] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flint.fileio import write_text_atomic

    est = [r for r in results if r.status == "estimated"]
    errs = [abs(r.error) for r in est]
    lines = ["# Accuracy against published training runs", "",
             f"Generated by `{command}` (see its docstring for the method and the defaults "
             "assumed where a row leaves a detail unstated). The first figures fit no parameter to any row: the "
             "device calibrations (`flint/devices/calibration/`) and network curves (`flint/networks/`) are the "
             "sourced ones. The second fit one factor per device, each row left out of its own fit. Throughput "
             "is Megatron's model TFLOP/s per GPU (no recompute counted); MFU against the dense "
             "bf16 peak.", ""]
    if est:
        lines += [f"**{len(est)} of {len(results)} rows estimated: mean absolute error {100 * sum(errs) / len(errs):.1f}%, "
                  f"max {100 * max(errs):.1f}%** (target: mean <= 5%, max <= 10%).", ""]
    loo = [r for r in est if r.loo_error == r.loo_error]
    if loo:
        e = [abs(r.loo_error) for r in loo]
        lines += [f"With one factor per device fitted on that device's other published rows (the calibration's "
                  f"`sustained_fraction`, below), leave-one-configuration-out: **mean absolute error "
                  f"{100 * sum(e) / len(e):.1f}%, max {100 * max(e):.1f}%** over {len(loo)} rows. No row's estimate "
                  "uses its own published figure; the sourced-only figures above use none.", ""]
    lines += ["Error is on throughput (for the iteration-time rows: published time / Flint's time - 1). "
              "`compute` is the compute stream's busy time and `exposed comm` the communication no compute hides "
              "(means over ranks); `rest` = iteration - compute - exposed comm is pipeline bubble and waiting (beside it, "
              "the schedule's textbook bubble (p-1)/(v m+p-1) as a share of the iteration). `if comm hidden` is "
              "the error Flint would have with every exposed transfer hidden: a sensitivity to what stays "
              "exposed (Megatron's `--tp-comm-overlap` runs as `micro-pipeline-tp` on rows that state it, "
              "which covers torch's async-TP patterns only), not an estimate. `other micro-batch` is the error "
              "at the other reading of a micro-batch the row's source does not state (the Megatron rows: local "
              "batch 4 x PP sequences, run as micro-batches of 1, Megatron-LM's example, or as PP micro-batches "
              "of 4): how much that unstated detail moves the row.", ""]
    unstated = [r for r in est if r.alt_error == r.alt_error]
    alts = [abs(r.alt_error) for r in unstated]
    if alts:
        base = [abs(r.error) for r in unstated]
        mixed = [abs(r.alt_error) if r.alt_error == r.alt_error else abs(r.error) for r in est]
        lines += [f"The {len(alts)} rows that leave their micro-batch unstated: mean absolute error "
                  f"{100 * sum(base) / len(base):.1f}% (max {100 * max(base):.1f}%) as estimated, "
                  f"{100 * sum(alts) / len(alts):.1f}% (max {100 * max(alts):.1f}%) at the other micro-batch "
                  f"(column `other micro-batch`); all rows with that reading: {100 * sum(mixed) / len(mixed):.1f}% "
                  f"(max {100 * max(mixed):.1f}%).", ""]
    lines += ["| row | source | GPUs | TP | PP | published | Flint | error | Flint MFU (Megatron FLOPs) | "
              "iteration s | compute s | exposed comm s | rest s (ideal bubble) | if comm hidden | "
              "other micro-batch | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r.row
        unit = "TFLOP/s/GPU" if "tflops_per_gpu" in row else "s/iteration"
        pub = f"{r.published:.4g} {unit}"
        head = f"| {row['id']} | {row['source']} | {row['gpus']} | {row['tp']} | {row['pp']} | {pub} | "
        if r.status == "estimated":
            lines.append(head + f"{r.estimate:.4g} | {100 * r.error:+.1f}% | {100 * r.mfu:.1f}% | "
                         f"{r.iteration_s:.3f} | {r.compute_s:.3f} | {r.exposed_s:.3f} | "
                         f"{_rest(r):.3f} ({100 * ideal_bubble(row):.1f}%) | "
                         f"{100 * r.error_comm_hidden:+.1f}% | {_alt(r)} | estimated |")
        else:
            reason = r.reason.replace("|", "/")
            what = {"failed": "Flint fails", "skipped": "not run (time budget)"}.get(r.status, "not expressible yet")
            lines.append(head + f"n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | {what}: {reason} |")
    lines += ["", "![throughput error per row](accuracy.png)", ""]
    lines += _fit_section(loo, fits)
    lines += _breakdown_table([r for r in est if r.breakdown])
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    ids = [r.row["id"] for r in est]
    x = range(len(est))
    ax.axhspan(-10, 10, color="0.92", label="target max +/-10%")
    ax.axhspan(-5, 5, color="0.85", label="+/-5%")
    ax.bar([i - 0.2 for i in x], [100 * r.error for r in est], 0.4, label="Flint, sourced calibration")
    ax.bar([i + 0.2 for i in x], [100 * r.error_comm_hidden for r in est], 0.4, color="0.6",
           label="Flint, exposed comm hidden (sensitivity)")
    if alts:
        ax.scatter([i - 0.2 for i, r in zip(x, est) if r.alt_error == r.alt_error],
                   [100 * r.alt_error for r in est if r.alt_error == r.alt_error], marker="_", s=120, color="C3",
                   zorder=3, label="Flint, the other reading of an unstated micro-batch")
    if loo:
        ax.scatter([i for i, r in zip(x, est) if r.loo_error == r.loo_error],
                   [100 * r.loo_error for r in est if r.loo_error == r.loo_error], marker="x", s=30, color="C2",
                   zorder=3, label="Flint, per-device factor fitted without the row (leave-one-out)")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(list(x), ids, rotation=45, ha="right")
    ax.set_ylabel("throughput error, %")
    ax.set_title("Flint vs published training throughput")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, hiding none
    fig.tight_layout()
    png = out / "accuracy.png"
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120, metadata={"Software": None})
    tmp.replace(png)
    write_text_atomic(out / "accuracy.md", "\n".join(lines) + "\n")


def _stats(xs: list[float]) -> str:
    xs = [abs(x) for x in xs]
    return f"{100 * sum(xs) / len(xs):.1f}% / {100 * max(xs):.1f}%"


def _fit_section(loo: list[Result], fits: list[DeviceFit]) -> list[str]:
    """The per-device fitted factor: each row left out of its own fit, and the fits on every row."""
    if not loo:
        return []
    lines = ["## A fitted factor per device, tested leave-one-out", "",
             "The one fitted parameter: the calibration's `sustained_fraction` (`flint/cost/calibration.py`), the "
             "share of the calibrated kernel rates a long training run sustains: every compute kernel's time is "
             "divided by it. The sourced calibrations leave it at 1, as no public measurement gives it (the GEMM and "
             "attention rates come from short microbenchmarks; sustained clocks under the power limit, host gaps "
             "and kernel interference in a training run are not in them). Here it is fitted per device to that "
             "device's published rows (the value minimising their mean absolute throughput error, in steps of "
             f"{FIT_STEP} from 1 down to {min(SUSTAINED_GRID)}; each row is simulated at "
             f"{', '.join(str(f) for f in SUSTAINED_GRID)} and interpolated between, then simulated again at the "
             "fitted value). Leave-one-configuration-out: each row is estimated at the factor fitted on the "
             "*other* configurations of its device (both rows of one Korthikanti model, full and sel+SP, are "
             "held out together). A single factor moves every row of a device the same way: it cannot fix rows "
             "that err in opposite directions.", "",
             "| row | device | factor fitted without the row | error, sourced calibration | error, leave-one-out |",
             "|---|---|---|---|---|"]
    for r in loo:
        lines.append(f"| {r.row['id']} | {r.row['device']} | {r.loo_fraction:g} | {100 * r.error:+.1f}% | "
                     f"{100 * r.loo_error:+.1f}% |")
    lines += ["", "Fitted on every row of the device (the file `flint estimate --calibration` takes; in-sample, "
              "so not an accuracy figure):", "",
              "| device | rows | sustained_fraction | mean / max error, sourced | in sample | leave-one-out | file |",
              "|---|---|---|---|---|---|---|"]
    for fit in fits:
        held = [r.loo_error for r in fit.rows if r.loo_error == r.loo_error]
        lines.append(f"| {fit.device} | {len(fit.rows)} | {fit.fraction:g} | {_stats([r.error for r in fit.rows])} | "
                     f"{_stats(list(fit.errors.values()))} | {_stats(held) if held else 'n/a'} | "
                     f"`flint/devices/calibration/fitted/{fit.device}.toml` |")
    return lines + [""]


def _breakdown_table(rows: list[Result]) -> list[str]:
    """Where each row's compute goes in Flint: its kernels as priced, by op class (flint.sim.breakdown)."""
    if not rows:
        return []
    from flint.sim.breakdown import ORDER

    classes = [c for c in ORDER if any(c in r.breakdown["classes"] for r in rows)]
    lines = ["## Where Flint's compute goes", "",
             "Per rank (the busiest pipeline rank), the step's kernels as Flint prices them, by op class: share of "
             "the kernel time and, for GEMMs and attention, the achieved TFLOP/s (FLOPs as PyTorch counts them: "
             "a causal attention kernel's masked half included, so its rate reads about twice what it "
             "computes). `kernels s` is their sum, before SM sharing slows "
             "them under collectives (the `compute s` above includes that). Megatron's hand-fused layers run "
             "as `fused pointwise`; the embedding and loss run one kernel per op.", "",
             "| row | kernels s | " + " | ".join(classes) + " |",
             "|---|---|" + "---|" * len(classes)]
    for r in rows:
        b = r.breakdown
        cells = []
        for c in classes:
            v = b["classes"].get(c)
            if v is None:
                cells.append("")
                continue
            share = f"{100 * v['time_us'] / b['total_us']:.1f}%"
            if c in ("gemm", "attention") and v["time_us"] > 0:
                share += f" ({v['flops'] / v['time_us'] / 1e6:,.0f})"
            cells.append(share)
        lines.append(f"| {r.row['id']} | {b['total_us'] * 1e-6:.3f} | " + " | ".join(cells) + " |")
    return lines + [""]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row ids (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs"), help="directory for accuracy.md and accuracy.png")
    from flint.cost.calibration import FITTED_DIR

    ap.add_argument("--fitted-out", default=str(FITTED_DIR),
                    help="directory for the per-device fitted calibrations <device>.toml (written only when "
                         "every row ran, i.e. without --rows)")
    ap.add_argument("--max-stage-passes", type=int, default=40000,
                    help="skip pipelined rows with more stage x virtual-stage x microbatch passes than this "
                         "(their lowering and simulation grow with it; 0: run every row)")
    return ap


def command_line(args: argparse.Namespace) -> str:
    """The command that regenerates the report, as its header names it: flags only where they differ from
    the defaults (``--out`` never: it names where the report went, not what is in it)."""
    default = _parser().get_default("max_stage_passes")
    return ".venv/bin/python bench/accuracy.py" + (f" --rows {args.rows}" if args.rows else "") \
        + (f" --max-stage-passes {args.max_stage_passes}" if args.max_stage_passes != default else "")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with open(ROWS, "rb") as f:
        rows = tomllib.load(f)["rows"]
    if args.rows:
        want = set(args.rows.split(","))
        rows = [r for r in rows if r["id"] in want]
    results = []
    print(f"{'row':<10} {'published':>10} {'Flint':>10} {'error':>8} {'wall s':>7}  status")
    for row in rows:
        t0 = time.perf_counter()
        dp = row["gpus"] // (row["tp"] * row["pp"])
        work = row["pp"] * row.get("interleave", 1) * max(1, row["global_batch"] // dp // row.get("microbatch", 1))
        if row["pp"] > 1 and args.max_stage_passes and work > args.max_stage_passes:
            r = Result(row, "skipped", f"pp {row['pp']} x {row.get('interleave', 1)} virtual x "
                       f"{work // (row['pp'] * row.get('interleave', 1))} microbatches = {work} stage passes "
                       f"> --max-stage-passes {args.max_stage_passes} (S3's 29400 and S4's 32768 take 1.5-2.5 "
                       "CPU minutes each; run with --max-stage-passes 0 to include it)")
            results.append(r)
            print(f"{row['id']:<10} {r.published:>10.4g} {'n/a':>10} {'n/a':>7}% {0.0:>7.1f}  skipped", flush=True)
            continue
        try:
            r = estimate(row)
        except Exception as e:  # a row Flint fails on is reported with its error, not hidden
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            r = Result(row, "failed", f"{type(e).__name__}: {msg}", wall_s=time.perf_counter() - t0)
        if r.status == "estimated":  # the row at each grid fraction, for the fits (fit_sustained)
            t1 = time.perf_counter()
            r.iteration_at = {f: r.iteration_s if f == 1.0 else r.resimulate(f) for f in SUSTAINED_GRID}
            r.wall_s += time.perf_counter() - t1
        results.append(r)
        print(f"{row['id']:<10} {r.published:>10.4g} {_fmt(r.estimate, '10.4g'):>10} "
              f"{_fmt(100 * r.error, '+7.1f'):>7}% {r.wall_s:>7.1f}  {r.status} {r.reason[:90]}"
              + (f"(other micro-batch: {_alt(r)})" if r.status == "estimated" and _alt(r) else ""), flush=True)
    t1 = time.perf_counter()
    leave_one_out(results)
    fits = device_fits(results)
    for r in results:
        r.resimulate = None  # frees the traces
    command = command_line(args)
    write_report(results, Path(args.out), command, fits)
    est = [abs(r.error) for r in results if r.status == "estimated"]
    if est:
        print(f"mean |error| {100 * sum(est) / len(est):.1f}%, max {100 * max(est):.1f}% over {len(est)} rows")
    loo = [abs(r.loo_error) for r in results if r.loo_error == r.loo_error]
    if loo:
        print(f"with a sustained fraction fitted per device, leave-one-configuration-out: mean |error| "
              f"{100 * sum(loo) / len(loo):.1f}%, max {100 * max(loo):.1f}% over {len(loo)} rows "
              f"({time.perf_counter() - t1:.0f} s of fits)")
    if not args.rows:  # every row ran: the device fits are the ones to ship
        from flint.fileio import write_text_atomic

        for fit in fits:
            path = Path(args.fitted_out) / f"{fit.device}.toml"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, fitted_toml(fit, command))
            print(f"{fit.device}: sustained_fraction = {fit.fraction} (fitted on {len(fit.rows)} rows) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
