"""One rank of a real training step on CPU (gloo), recorded with PyTorch's execution trace.

Run by :mod:`flint.validate.realrun` as ``python -m flint.validate.worker SPEC.json RANK``;
never imported by the parent process for anything but :func:`parallelize` and :func:`case_plan`.

The step: build the model (seed 0, fp32, CPU), parallelize it with PyTorch's
own APIs exactly as the Flint recipe of the same name describes it, run one
untraced warm-up step (lazy FSDP init, AdamW state creation; forward and backward inside torch's
``loss_parallel`` context when the plan sets it, as torchtitan's train context does), then one step
under the CPU profiler with an ``ExecutionTraceObserver``: the host execution
trace goes to ``<dir>/host.<rank>.json``, the profiler's (Kineto) trace, which
has the operator durations (matched by record-function id), to
``<dir>/kineto.<rank>.json``, the step's wall time to ``<dir>/timing.<rank>.json``.
On any exception the traceback is written to ``<dir>/error.<rank>.txt`` and the
process exits with status 1. A rank whose parent dies exits at once.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flint.capture.recipes import ac_layers, ac_wrap, apply_tp, data_parallel_mode, loss_context
from flint.plan import Plan
from flint.validate.executed import CLIP_LABEL

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1  # flint.capture.step.adamw_step defaults


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Parallelize a StagedLM in place with PyTorch's APIs, following ``plan``.

    - TP part: :func:`flint.capture.recipes.apply_tp` itself (``parallelize_module``
      with the recipe's plans), on mesh axis ``tp``.
    - ``dp_shard``: ``fully_shard`` on the embedding, every block, the head
      (``reshard_after_forward=False``, as torchtitan) and the root (FSDP2's parameter
      groups = the recipe's groups) on mesh axis ``dp_shard``.
    - both (HSDP): ``fully_shard`` on the 2-D ``(dp_replicate, dp_shard)`` mesh.
    - ``dp_replicate``: ``replicate`` (FSDP2-based,
      ``torch.distributed._composable.replicate_with_fsdp``) on the same groups, on
      mesh axis ``dp_replicate``: one gradient all-reduce per group.
    - ``activation_checkpoint``: the recipe's own ``checkpoint_wrapper`` per block
      (:func:`flint.capture.recipes.ac_wrap` on :func:`~flint.capture.recipes.ac_layers`),
      after TP and before data parallelism, as torchtitan applies it.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    if plan.tp > 1:
        apply_tp(model, mesh["tp"], plan.sp, loss_parallel=plan.loss_parallel)
    for i in ac_layers(plan, len(model.layers)):
        model.layers[i] = ac_wrap(model.layers[i], plan)
    mode = data_parallel_mode(plan)
    if mode is not None:
        wrap = fully_shard if mode == "fsdp" else replicate
        dp_mesh = mesh["dp_shard" if mode == "fsdp" else "dp_replicate"]
        if plan.dp_shard > 1 and plan.dp_replicate > 1:  # HSDP: FSDP2 on the 2-D (replicate, shard) mesh
            dp_mesh = mesh["dp_replicate", "dp_shard"]
        for module in (model.embed, *model.layers, model.head, model):
            # torchtitan keeps the head (final norm + output) unsharded from forward to backward
            kw = {"reshard_after_forward": False} if mode == "fsdp" and module is model.head else {}
            wrap(module, mesh=dp_mesh, **kw)


def case_plan(recipe: str, world_size: int, tp: int, ac: str = "none", loss_parallel: bool = False,
              max_norm: float = 0.0, optimizer_impl: str = "for-loop") -> Plan:
    """The plan of a validated case: the recipe's, with activation checkpointing ``ac`` (selective-layer: every
    second block), ``loss_parallel``, gradient-norm clipping at ``max_norm`` and AdamW's ``optimizer_impl``."""
    import dataclasses

    from flint.plan import from_recipe

    return dataclasses.replace(from_recipe(recipe, world_size, tp), activation_checkpoint=ac,
                               ac_every=2 if ac == "selective-layer" else 1, loss_parallel=loss_parallel,
                               max_norm=max_norm, optimizer_impl=optimizer_impl)


def clip_grad_norm(model: nn.Module, max_norm: float) -> None:
    """torchtitan's ``dist_utils.clip_grad_norm_`` without pipeline stages: ``get_total_norm`` of the gradients
    (``foreach=False``, as the optimizer here), the DTensor norm made whole with ``full_tensor``, then
    ``clip_grads_with_norm_``."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    with torch.profiler.record_function(CLIP_LABEL):
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=False)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)


def run(spec: dict, rank: int) -> None:
    """One rank of the real run described by ``spec`` (see :class:`flint.validate.realrun.RunSpec`)."""
    from flint.models import build

    out = spec["dir"]
    if rank in spec.get("fail_ranks", ()):
        raise RuntimeError(f"injected failure on rank {rank}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world_size"], timeout=timedelta(seconds=spec["timeout_s"]))
    try:
        plan = case_plan(spec["plan"], spec["world_size"], spec.get("tp", 1), spec.get("ac", "none"),
                         spec.get("loss_parallel", False), spec.get("max_norm", 0.0),
                         spec.get("optimizer_impl", "for-loop"))
        fmesh = plan.mesh()
        mesh = init_device_mesh("cpu", fmesh.shape, mesh_dim_names=fmesh.axis_names)
        torch.manual_seed(0)
        from flint.models.hf import build_hf, is_hf

        hf = is_hf(spec["model"])
        if hf:
            # a Hugging Face model, parallelized by the same preset function Flint captures it with
            # (flint.capture.byom.preset_parallelize), here calling the real fully_shard / replicate
            from flint.capture.byom import find_layers, preset_parallelize

            model = build_hf(spec["model"])
            model.config.use_cache = False  # training: no KV cache (as in Flint's capture)
            found = find_layers(model)
            preset_parallelize(plan, model, found.path if found else None)(model, mesh)
        else:
            model = build(spec["model"], **spec.get("overrides", {}))
            parallelize(model, plan, mesh)
        dp = plan.dp
        batch, seq = spec["batch"]
        data_axes = plan.axes("dp")
        dp_rank = mesh[data_axes[0]].get_local_rank() if data_axes else 0
        gen = torch.Generator().manual_seed(1 + dp_rank)
        vocab = model.config.vocab_size
        tokens = torch.randint(0, vocab, (batch // dp, seq), generator=gen)
        labels = torch.randint(0, vocab, (batch // dp, seq), generator=gen)
        # torch's AdamW in the plan's form (the for-loop one is what torch picks on CPU by itself)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                foreach=plan.optimizer_impl == "foreach", fused=plan.optimizer_impl == "fused")

        def step() -> None:
            # torchtitan's train context: forward and backward inside loss_parallel
            with loss_context(plan):
                loss = model(input_ids=tokens, labels=labels).loss if hf else model(tokens, labels)
                loss.backward()
            if plan.max_norm:
                clip_grad_norm(model, plan.max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up: lazy init, optimizer state
        dist.barrier()
        obs = torch.profiler.ExecutionTraceObserver().register_callback(os.path.join(out, f"host.{rank}.json"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    execution_trace_observer=obs) as prof:
            start = time.perf_counter()
            step()
            wall_us = (time.perf_counter() - start) * 1e6
        prof.export_chrome_trace(os.path.join(out, f"kineto.{rank}.json"))
        with open(os.path.join(out, f"timing.{rank}.json"), "w") as f:
            json.dump({"step_wall_us": wall_us}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    _exit_with_parent()
    spec_path, rank = argv[0], int(argv[1])
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        run(spec, rank)
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        with open(os.path.join(spec["dir"], f"error.{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
