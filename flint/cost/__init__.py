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
from flint.cost.flops import OpCost, op_bytes, op_cost, op_flops
from flint.cost.network import Network, NetworkDim, list_networks, load_network
from flint.cost.opclass import OpClass, classify_aten

__all__ = [
    "Algorithm", "Device", "Link", "Network", "NetworkDim", "OpClass", "OpCost", "Topology", "classify_aten",
    "coll_kind", "collective_time_us", "dtype_bytes", "list_devices", "list_networks", "load_device",
    "load_network", "op_bytes", "op_cost", "op_flops", "p2p_time_us", "tensor_bytes",
]
