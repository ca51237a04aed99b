"""A fake process group of any world size on one CPU, and the device mesh over it.

PyTorch's fake backend (``torch.testing._internal.distributed.fake_pg``)
accepts every collective and moves no data, so a single process can play
rank 0 of a 1,024-rank job. Collectives traced by ``torch.compile`` name their
process group by a string (``group_name``); :func:`group_axes` maps those names
back to the mesh axes they span.

One process may capture many plans (``flint explore``): each capture gets a
fresh fake world, and DTensor's caches are emptied between worlds (see
:func:`forget_dtensor_caches`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


def forget_dtensor_caches() -> None:
    """Empty DTensor's caches that hold device meshes of a process group world.

    DTensor caches sharding propagation (a C++ fast-path cache and a Python
    LRU cache, both keyed by the op's argument specs) and redistribution
    planners (keyed by a weak reference to the mesh). A ``DeviceMesh`` hashes
    and compares by value (rank map, layout, axis names), not by the process
    groups behind it, so a sub-mesh of a new world (``tp`` over ranks 0-1)
    equals one of an earlier, destroyed world, and a cache hit hands back an
    output spec on the earlier mesh object: its collectives then name the
    earlier world's process groups ("Could not resolve the process group
    registered under the name 3"). Clearing the caches between worlds is
    PyTorch's own recommended way (``torch.distributed.tensor.debug``).
    """
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialise the default process group as ``rank`` (default 0) of ``world_size`` fake ranks.

    DTensor's mesh-holding caches are emptied on entry and on exit
    (:func:`forget_dtensor_caches`), so a capture never sees another world's meshes.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_dtensor_caches()


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
