"""Captured steps shared by every test module in one pytest run (each capture
compiles with dynamo/AOTAutograd, 5-60 s on 2 cores: capture each config once)."""

from __future__ import annotations

from functools import cache

from flint.capture import capture_step
from flint.models import factory

SEQ = 64


@cache
def captured(model: str, plan: str, world: int, mesh: tuple[int, ...], axes: tuple[str, ...], repeat: bool = True):
    """Two sequences of SEQ tokens per data-parallel rank."""
    dp = mesh[axes.index("dp")] if "dp" in axes else 1
    batch = (2 * dp, SEQ)
    return capture_step(factory(model), {"tokens": batch, "labels": batch}, world_size=world,
                        mesh_shape=mesh, mesh_axis_names=axes, plan=plan, repeat=repeat)


@cache
def imported(model: str, plan: str, world: int, mesh: tuple[int, ...], axes: tuple[str, ...]):
    """(captured step, its IR module). Tests must not mutate the module."""
    from flint.importer import import_step

    step = captured(model, plan, world, mesh, axes)
    return step, import_step(step)
