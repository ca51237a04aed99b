"""A fake process group of any world size on one CPU, and the device mesh over it.

PyTorch's fake backend (``torch.testing._internal.distributed.fake_pg``)
accepts every collective and moves no data, so a single process can play
rank 0 of a 1,024-rank job. Collectives traced by ``torch.compile`` name their
process group by a string (``group_name``); :func:`group_axes` maps those names
back to the mesh axes they span.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Initialise the default process group as rank 0 of ``world_size`` fake ranks."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def device_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...]) -> DeviceMesh:
    """A CPU ``DeviceMesh`` of ``shape`` over the (fake) default process group."""
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(axis_names))


def group_axes(mesh: DeviceMesh) -> dict[str, tuple[int, ...]]:
    """Process-group name -> the mesh axis indices the group spans (for this rank)."""
    out: dict[str, tuple[int, ...]] = {}
    for axis in range(mesh.ndim):
        out[mesh.get_group(axis).group_name] = (axis,)
    world = dist.group.WORLD
    if world is not None and world.size() == mesh.size():
        out.setdefault(world.group_name, tuple(range(mesh.ndim)))
    return out
