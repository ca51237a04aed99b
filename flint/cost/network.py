"""Network models: dimensions of links, loaded from TOML data.

A network is a list of *dimensions*, innermost first, like ASTRA-sim's
network config: each has a size (ranks along it), a topology (``switch``,
``fully-connected``, ``ring``, ``mesh``), a per-rank one-direction bandwidth
and a per-hop latency. The common shapes are presets in ``flint/networks``:

- switch:     one ``switch`` dimension (e.g. a flat InfiniBand fabric);
- ring:       one ``ring`` dimension;
- 2D mesh:    two ``mesh`` dimensions (wafer-scale: a grid without wraparound);
- two-level:  an NVLink ``switch`` island inside a scale-out ``switch``.

Rank placement: rank ``r`` sits at network coordinate ``c_d = (r // prod(size[:d]))
% size[d]`` (innermost fastest), i.e. consecutive ranks fill a node first,
which is how ``torch.distributed`` launches ranks. The outermost size may be
``0`` ("as many as needed"); :meth:`Network.for_world` fills it in.

A group is priced on the dimensions along which its members differ
(:meth:`Network.group_levels`); if the members do not form a full product of
those dimensions (an irregular group), the whole group is priced on the
slowest of them. A send/recv between two ranks pays the latency × hops of
every dimension they differ in and the bandwidth of the slowest one.

TOML::

    name = "dgx-h100"
    [[dims]]
    name = "nvlink"; topology = "switch"; size = 8
    bandwidth_gbytes_per_s = 450.0; latency_us = 1.0
    [[dims]]
    name = "ib"; topology = "switch"; size = 0
    bandwidth_gbits_per_s = 400.0; latency_us = 3.0   # gbits is accepted and divided by 8
    base_latency_us = 8.0                             # per collective (optional)
    bus_efficiency = [[1048576, 0.3], [1073741824, 0.9]]   # (buffer bytes, fraction) (optional)

``base_latency_us`` and ``bus_efficiency`` are the NCCL-like terms of
:func:`flint.cost.collective_time_us` (see its module docstring).

Sweeps change a network without a new file: :meth:`Network.with_link`
replaces one dimension's bandwidth or latency, :meth:`Network.with_nics`
degrades the NIC of some ranks on one dimension (a group through such a
rank runs that level at its speed; there is no contention model, so other
transfers are unaffected).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from flint.cost.collective import Link, Topology, p2p_time_us, parse_topology
from flint.errors import FlintError
from flint.limits import MAX_WORLD_SIZE

NETWORKS_DIR = Path(__file__).resolve().parent.parent / "networks"
_DIM_KEYS = {"name", "topology", "size", "bandwidth_gbytes_per_s", "bandwidth_gbits_per_s", "latency_us",
             "base_latency_us", "bus_efficiency"}


@dataclass(frozen=True)
class NetworkDim:
    """One network dimension: ``size`` ranks wired by ``link`` (size 0: fill to the world size)."""

    name: str
    size: int
    link: Link


@dataclass(frozen=True)
class Network:
    """A network of dimensions, innermost first (module docstring)."""

    name: str
    dims: tuple[NetworkDim, ...]
    description: str = ""
    # Degraded NICs: (rank, dimension name, bandwidth_gbytes_per_s) below the dimension's link.
    nics: tuple[tuple[int, str, float], ...] = ()
    source: str = field(default="", compare=False)  # the file it was read from, when the user gave one

    @property
    def label(self) -> str:
        """How messages name it: ``network 'NAME'``, and the file it came from when the user gave one."""
        return f"network '{self.name}'" + (f" ({self.source})" if self.source else "")

    def with_link(self, dim: str, *, bandwidth_gbytes_per_s: float | None = None,
                  latency_us: float | None = None) -> "Network":
        """This network with dimension ``dim``'s link bandwidth and/or latency replaced (for sweeps)."""
        names = [d.name for d in self.dims]
        if dim not in names:
            raise FlintError(f"network '{self.name}' has no dimension '{dim}' (its dimensions: {', '.join(names)})")
        out = []
        for d in self.dims:
            if d.name == dim:
                link = d.link
                if bandwidth_gbytes_per_s is not None:
                    link = replace(link, bandwidth_gbytes_per_s=float(bandwidth_gbytes_per_s))
                if latency_us is not None:
                    link = replace(link, latency_us=float(latency_us))
                d = replace(d, link=link)
            out.append(d)
        return replace(self, dims=tuple(out))

    def with_nics(self, ranks: Sequence[int], dim: str, bandwidth_gbytes_per_s: float) -> "Network":
        """This network with the NICs of ``ranks`` on dimension ``dim`` degraded to ``bandwidth_gbytes_per_s``.

        A degraded NIC slows every transfer through it: a collective whose
        group spans ``dim`` and contains one of ``ranks`` runs that level at
        the slowest member's bandwidth (ring and tree steps are synchronous,
        so the slowest link paces every step), and a send/recv from or to such
        a rank across ``dim`` uses it. There is no contention model: other
        transfers are unaffected.
        """
        if dim not in {d.name for d in self.dims}:
            raise FlintError(f"network '{self.name}' has no dimension '{dim}' (its dimensions: "
                             f"{', '.join(d.name for d in self.dims)})")
        if bandwidth_gbytes_per_s <= 0:
            raise FlintError(f"degraded NIC bandwidth must be positive, got {bandwidth_gbytes_per_s}")
        return replace(self, nics=self.nics + tuple((int(r), dim, float(bandwidth_gbytes_per_s)) for r in ranks))

    def _nic_link(self, link: Link, dim: str, ranks) -> Link:
        """``link`` at the slowest degraded NIC among ``ranks`` on ``dim`` (itself when none is degraded)."""
        slow = [bw for r, d, bw in self.nics if d == dim and r in ranks]
        if not slow or min(slow) >= link.bandwidth_gbytes_per_s:
            return link
        return replace(link, bandwidth_gbytes_per_s=min(slow))

    def for_world(self, world_size: int) -> "Network":
        """This network with its outermost ``size = 0`` filled in for ``world_size`` ranks.

        Raises ``FlintError`` when the fixed sizes do not divide ``world_size``.
        A world smaller than the inner dimension shrinks that dimension.
        """
        sizes = [d.size for d in self.dims]
        if any(s == 0 for s in sizes[:-1]):
            raise FlintError(f"{self.label}: only the outermost dimension may have size 0")
        if sizes[-1] == 0:
            inner = math.prod(sizes[:-1])
            if world_size <= inner and len(sizes) == 2:
                sizes = [world_size, 1]
            elif world_size % inner:
                inner_dims = ", ".join(f"{d.name} size {d.size}" for d in self.dims[:-1])
                raise FlintError(f"{self.label}: world size {world_size} is not a multiple of the inner "
                                 f"dimensions' {inner} ranks ({inner_dims})")
            else:
                sizes[-1] = world_size // inner
        if math.prod(sizes) < world_size:
            raise FlintError(f"{self.label} has {math.prod(sizes)} ranks {sizes}, fewer than the world size "
                             f"{world_size}")
        return replace(self, dims=tuple(replace(d, size=s) for d, s in zip(self.dims, sizes)))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    def coords(self, ranks: Sequence[int] | np.ndarray) -> np.ndarray:
        """Network coordinates ``[len(ranks), ndims]`` (innermost dimension first)."""
        r = np.asarray(ranks, dtype=np.int64)
        out = np.empty((r.size, len(self.dims)), dtype=np.int64)
        stride = 1
        for i, d in enumerate(self.dims):
            size = d.size if d.size > 0 else np.iinfo(np.int64).max
            out[:, i] = (r // stride) % size
            stride *= max(d.size, 1)
        return out

    def spans(self, members: Sequence[int]) -> list[tuple[int, int]]:
        """``[(dimension index, distinct coordinates), ...]`` inner first, for the dimensions along which
        ``members`` differ."""
        c = self.coords(members)
        return [(i, k) for i in range(len(self.dims)) if (k := len(np.unique(c[:, i]))) > 1]

    def group_levels(self, members: Sequence[int]) -> list[tuple[Link, int]]:
        """``[(link, ranks along it), ...]`` inner first for a group, as :func:`collective_time_us` takes.

        Only dimensions along which members differ appear. An irregular group
        (not a full product of its per-dimension counts) becomes one level on
        the slowest spanned link with the whole group size.
        """
        levels = []
        member_set = set(int(m) for m in members) if self.nics else ()
        for i, k in self.spans(members):
            d = self.dims[i]
            levels.append((self._nic_link(d.link, d.name, member_set) if self.nics else d.link, k))
        if math.prod(k for _, k in levels) != len(set(int(m) for m in members)):
            slowest = min((lk for lk, _ in levels), key=lambda lk: lk.bandwidth_gbytes_per_s)
            return [(slowest, len(members))]
        return levels

    def p2p_time_us(self, src: int, dst: int, nbytes: float) -> float:
        """A send/recv transfer from ``src`` to ``dst`` (module docstring)."""
        c = self.coords([src, dst])
        latency, bw_link = 0.0, None
        for i, d in enumerate(self.dims):
            a, b = int(c[0, i]), int(c[1, i])
            if a == b:
                continue
            dist = abs(a - b)
            if d.link.topology is Topology.RING:
                dist = min(dist, d.size - dist)
            elif d.link.topology in (Topology.SWITCH, Topology.FULLY_CONNECTED):
                dist = 1
            latency += d.link.latency_us * dist
            link = self._nic_link(d.link, d.name, (src, dst)) if self.nics else d.link
            if bw_link is None or link.bandwidth_gbytes_per_s < bw_link.bandwidth_gbytes_per_s:
                bw_link = link
        if bw_link is None:
            return 0.0
        return latency + p2p_time_us(nbytes, replace(bw_link, latency_us=0.0))


def list_networks() -> list[str]:
    """Names of the network presets shipped in ``flint/networks``."""
    return sorted(p.stem for p in NETWORKS_DIR.glob("*.toml"))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(d: Mapping[str, Any], key: str, at: str, *, positive: bool = False, default: float | None = None) -> float:
    """A finite number (``> 0`` with ``positive``, else ``>= 0``), or a :class:`FlintError` naming the key."""
    v = d.get(key, default)
    if not _is_number(v) or (v <= 0 if positive else v < 0):
        raise FlintError(f"{at} {key} = {v!r} must be a {'positive' if positive else 'non-negative'} finite number")
    return float(v)


def network_from_dict(d: Mapping[str, Any], where: str = "network") -> Network:
    """Build a :class:`Network` from a parsed network TOML (validating every key)."""
    unknown = set(d) - {"name", "description", "dims"}
    if unknown:
        raise FlintError(f"{where}: unknown keys {sorted(unknown)} (allowed: name, description, dims)")
    if not d.get("dims") or not isinstance(d["dims"], list) or not all(isinstance(x, dict) for x in d["dims"]):
        raise FlintError(f"{where}: needs at least one [[dims]] table")
    dims = []
    for i, dd in enumerate(d["dims"]):
        bad = set(dd) - _DIM_KEYS
        if bad:
            raise FlintError(f"{where}: dims[{i}] has unknown keys {sorted(bad)} (allowed: {', '.join(sorted(_DIM_KEYS))})")
        at = f"{where}: dims[{i}]"
        if "bandwidth_gbytes_per_s" in dd:
            bw = _number(dd, "bandwidth_gbytes_per_s", at, positive=True)
        elif "bandwidth_gbits_per_s" in dd:
            bw = _number(dd, "bandwidth_gbits_per_s", at, positive=True) / 8.0
        else:
            raise FlintError(f"{at} needs bandwidth_gbytes_per_s or bandwidth_gbits_per_s")
        name = dd.get("name", f"d{i}")
        if not isinstance(name, str):
            raise FlintError(f"{at} name = {name!r} must be a string")
        size = dd.get("size", 0)
        if isinstance(size, bool) or not isinstance(size, int):
            raise FlintError(f"{at} size = {size!r} must be a whole number of ranks (0: as many as needed)")
        if not 0 <= size <= MAX_WORLD_SIZE:
            raise FlintError(f"{at} size = {size} must be between 0 (as many as needed) and {MAX_WORLD_SIZE:,}")
        topo_name = dd.get("topology", "switch")
        if not isinstance(topo_name, str):
            raise FlintError(f"{at} topology = {topo_name!r} must be a string (switch, fully-connected, ring, mesh)")
        try:
            topo = parse_topology(topo_name)
        except FlintError as e:
            raise FlintError(f"{at}: {e}") from None
        curve = dd.get("bus_efficiency", [])
        if not isinstance(curve, list) or not all(
                isinstance(pt, list) and len(pt) == 2 and all(_is_number(x) for x in pt) for pt in curve):
            raise FlintError(f"{at} bus_efficiency must be a list of [bytes, fraction] pairs of finite numbers")
        latency = _number(dd, "latency_us", at, default=0.0)
        base = _number(dd, "base_latency_us", at, default=0.0)
        try:
            link = Link(bw, latency, topo, name, base, tuple((pt[0], pt[1]) for pt in curve))
        except FlintError as e:
            raise FlintError(f"{at}: {e}") from None
        dims.append(NetworkDim(name, size, link))
    inner_open = next((i for i, dim in enumerate(dims[:-1]) if dim.size == 0), None)
    if inner_open is not None:
        raise FlintError(f"{where}: dims[{inner_open}] size = 0 (or no size): only the outermost dimension, the "
                         f"last [[dims]] table (dims[{len(dims) - 1}]), may have size 0 (as many as the world needs)")
    return Network(str(d.get("name", where)), tuple(dims), str(d.get("description", "")))


def load_network(name_or_path: str | Path, sizes: Sequence[int] | None = None) -> Network:
    """Load a network preset by name (``"dgx-h100"``) or from a TOML file path.

    ``sizes`` overrides the dimensions' sizes (inner first) for a sweep.
    An unknown name raises ``FlintError`` listing the valid names.
    """
    s = str(name_or_path)
    p = Path(s)
    if not (s.endswith(".toml") or p.is_file()):
        p = NETWORKS_DIR / f"{s}.toml"
        if not p.is_file():
            raise FlintError(f"unknown network '{s}' (valid: {', '.join(list_networks())}; or give a .toml path)")
    from flint.cost.calibration import read_toml

    net = network_from_dict(read_toml(p, "network"), where=str(p))
    if p.parent != NETWORKS_DIR:
        net = replace(net, source=str(p))
    if sizes is not None:
        if len(sizes) != len(net.dims):
            raise FlintError(f"network '{net.name}' has {len(net.dims)} dimensions, got {len(sizes)} sizes")
        net = replace(net, dims=tuple(replace(d, size=int(z)) for d, z in zip(net.dims, sizes)))
    return net
