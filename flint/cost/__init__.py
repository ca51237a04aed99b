"""Flint's cost model: devices, op FLOPs / bytes, networks and collectives.

One place for each number: :func:`op_flops` / :func:`op_cost` for compute
work, :meth:`Device.compute_time_us` for the compute roofline,
:func:`collective_time_us` for every collective, :class:`Network` for which
links a group or a send/recv uses. Presets are TOML data in
``flint/devices`` and ``flint/networks``.
"""

from flint.cost.collective import Algorithm, Link, Topology, coll_kind, collective_time_us, p2p_time_us
from flint.cost.device import Device, list_devices, load_device
from flint.cost.dtypes import dtype_bytes, tensor_bytes
from flint.cost.network import Network, NetworkDim, list_networks, load_network
from flint.cost.opclass import COST_CLASSES, classify_target

_LAZY = {"OpCost", "op_bytes", "op_cost", "op_flops"}  # need torch: imported on first use


def __getattr__(name: str):
    if name in _LAZY:
        from flint.cost import flops

        return getattr(flops, name)
    raise AttributeError(f"module 'flint.cost' has no attribute '{name}'")


__all__ = [
    "COST_CLASSES", "Algorithm", "Device", "Link", "Network", "NetworkDim", "OpCost", "Topology", "classify_target",
    "coll_kind", "collective_time_us", "dtype_bytes", "list_devices", "list_networks", "load_device",
    "load_network", "op_bytes", "op_cost", "op_flops", "p2p_time_us", "tensor_bytes",
]
