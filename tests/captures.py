"""Captured steps shared by every test module in one pytest run (each capture
compiles with dynamo/AOTAutograd, 5-60 s on 2 cores: capture each config once)."""

from __future__ import annotations

from functools import cache

from flint.capture import capture_step
from flint.models import factory
from flint.plan import from_recipe

SEQ = 64


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
