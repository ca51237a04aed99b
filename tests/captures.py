"""Captured steps shared by every test module in one pytest run (each capture
compiles with dynamo/AOTAutograd, 5-60 s on 2 cores: capture each config once)."""

from __future__ import annotations

import sys
from functools import cache

from flint.capture import capture_step
from flint.models import factory
from flint.plan import from_recipe

SEQ = 64

# Test modules import this file as ``captures`` (pytest puts tests/ on the path) or as ``tests.captures``
# (the repo root is on the path): one module under both names, so each capture is made once per run.
for _name in ("captures", "tests.captures"):
    sys.modules.setdefault(_name, sys.modules[__name__])


@cache
def captured(model: str, plan: str, world: int, tp: int = 1, repeat: bool = True):
    """Recipe ``plan`` (TP degree ``tp`` for 2-D recipes); two sequences of SEQ tokens per data-parallel rank."""
    dp = from_recipe(plan, world, tp).dp
    batch = (2 * dp, SEQ)
    return capture_step(factory(model), {"tokens": batch, "labels": batch}, world_size=world, plan=plan, tp=tp,
                        repeat=repeat)


@cache
def imported(model: str, plan: str, world: int, tp: int = 1):
    """(captured step, its IR module). Tests must not mutate the module."""
    from flint.importer import import_step

    step = captured(model, plan, world, tp)
    return step, import_step(step)


@cache
def single_device(model: str, batch: int = 2):
    """(captured step, its IR module) of ``model`` on ONE device with a global batch of ``batch`` x SEQ
    tokens: the input of shard expansion. Tests must not mutate the module."""
    from flint.importer import import_step

    step = capture_step(factory(model), {"tokens": (batch, SEQ), "labels": (batch, SEQ)}, world_size=1, plan="dp")
    return step, import_step(step)


BYOM = "tests/data/byom/hf_models.py"


def _byom_factory(name: str):
    import os

    from flint.capture.byom import user_function

    path = os.path.join(os.path.dirname(__file__), "data", "byom", "hf_models.py")
    return user_function(f"{path}:{name}", "--model", "model_factory", "a model factory")[0]


@cache
def captured_byom(name: str, plan: str, world: int, tp: int = 1, inputs: str | None = None):
    """A model of tests/data/byom/hf_models.py under recipe ``plan``; causal LMs: 2 x 32 tokens per DP rank."""
    from flint.capture.byom import parse_inputs

    fn = _byom_factory(name)
    dp = from_recipe(plan, world, tp).dp
    shapes = parse_inputs(inputs) if inputs else {"input_ids": (2 * dp, 32), "labels": (2 * dp, 32)}
    return capture_step(fn, shapes, world_size=world, plan=plan, tp=tp)


@cache
def single_device_byom(name: str, batch: int):
    """(captured step, its IR module) of causal LM ``name`` of tests/data/byom/hf_models.py on ONE device,
    ``batch`` x 32 tokens: the input of shard expansion. Tests must not mutate the module."""
    from flint.importer import import_step

    step = capture_step(_byom_factory(name), {"input_ids": (batch, 32), "labels": (batch, 32)}, world_size=1,
                        plan="dp")
    return step, import_step(step)


@cache
def captured_ac(mode: str, every: int = 1, plan: str = "fsdp", world: int = 2, model: str = "llama-tiny",
                layers: int = 4, tp: int = 1):
    """(captured step, its IR module) of recipe ``plan`` with activation checkpointing ``mode``
    (``ac_every`` = ``every``), ``model`` with ``layers`` blocks; two sequences of SEQ tokens per
    data-parallel rank."""
    import dataclasses

    from flint.importer import import_step

    p = dataclasses.replace(from_recipe(plan, world, tp), activation_checkpoint=mode, ac_every=every)
    batch = (2 * p.dp, SEQ)
    step = capture_step(factory(model, n_layers=layers), {"tokens": batch, "labels": batch}, plan=p)
    return step, import_step(step)


@cache
def single_device_config(model: str, batch: int, overrides: tuple = ()):
    """:func:`single_device` of ``model`` with config ``overrides`` (``(("n_experts", 8),)``). Tests must not
    mutate the module."""
    from flint.importer import import_step

    step = capture_step(factory(model, **dict(overrides)), {"tokens": (batch, SEQ), "labels": (batch, SEQ)},
                        world_size=1, plan="dp")
    return step, import_step(step)


@cache
def captured_in(dtype: str, model: str, plan: str, world: int, tp: int, batch: int, seq: int):
    """(captured step, its IR module) of ``model`` in ``dtype`` (``"bfloat16"``) under recipe ``plan`` at
    ``world`` ranks (``plan`` ``"single"``: one device), a GLOBAL batch of ``batch`` x ``seq`` tokens.
    Tests must not mutate the module."""
    from flint.importer import import_step

    shapes = (batch, seq)
    kw = dict(world_size=1, plan="dp") if plan == "single" else dict(world_size=world, plan=plan, tp=tp)
    step = capture_step(factory(model), {"tokens": shapes, "labels": shapes}, dtype=dtype, **kw)
    return step, import_step(step)


@cache
def distributed_optimizer(reduce_dtype: str = "float32", microbatches: int = 2, pp: int = 1):
    """(captured step, its IR module) of gpt2-tiny on 2 data-parallel ranks (times ``pp`` pipeline stages) as
    Megatron's distributed optimizer / FSDP2 ``fully_shard(reshard_after_forward=False,
    mp_policy=MixedPrecisionPolicy(bfloat16, reduce_dtype))``: fp32 master parameters sharded over dp_shard
    (ZeRO-2), gathered in bf16, ``microbatches`` micro-batches of 2 sequences of SEQ tokens. Tests must not
    mutate the module."""
    from flint.importer import import_step
    from flint.plan import Plan

    plan = Plan.from_dict({"dp_shard": 2, "zero": 2, "param_dtype": "bfloat16", "reduce_dtype": reduce_dtype,
                           "microbatches": microbatches, **({"pp": pp} if pp > 1 else {})}, world_size=2 * pp)
    batch = (2 * 2 * microbatches, SEQ)
    step = capture_step(factory("gpt2-tiny"), {"tokens": batch, "labels": batch}, plan=plan, dtype="float32")
    return step, import_step(step)


@cache
def captured_partitioner(partitioner: str, plan: str = "fsdp", world: int = 8, model: str = "llama-tiny", tp: int = 1,
                         ac: str = "none"):
    """(captured step, its IR module) of :func:`captured`'s configuration with
    ``capture_step(partitioner=...)`` (flint.capture.partition) and activation checkpointing ``ac``;
    ``"min-cut"`` without AC is :func:`captured` itself. Tests must not mutate the module."""
    import dataclasses

    from flint.importer import import_step

    if partitioner == "min-cut" and ac == "none":
        return imported(model, plan, world, tp)
    p = dataclasses.replace(from_recipe(plan, world, tp), activation_checkpoint=ac)
    batch = (2 * p.dp, SEQ)
    step = capture_step(factory(model), {"tokens": batch, "labels": batch}, plan=p, partitioner=partitioner)
    return step, import_step(step)


@cache
def loss_parallel(on: bool, model: str = "llama-tiny"):
    """(step, IR module) of ``model`` under tp 2 with sequence parallelism, with or without torch's
    ``loss_parallel`` (two sequences of SEQ tokens)."""
    from flint.importer import import_step
    from flint.plan import Plan

    plan = Plan.from_dict({"tp": 2, "sp": True, "loss_parallel": on}, world_size=2)
    step = capture_step(factory(model), {"tokens": (2, SEQ), "labels": (2, SEQ)}, plan=plan)
    return step, import_step(step)
