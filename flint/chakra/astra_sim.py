"""Run ASTRA-sim (analytical backend) on a Chakra trace Flint wrote.

:class:`AstraSimConfig` holds the few parameters that matter (per-dimension
topology, NPU count, bandwidth and latency; collective algorithms; roofline
and peak TFLOP/s) and renders the three input files ASTRA-sim wants: the
network YAML, the system JSON and the remote-memory JSON
(``../shared/CHAKRA.md`` lists the keys). :func:`run_astra_sim` writes them,
runs the binary (``binary=`` argument, else ``$FLINT_ASTRA_SIM``, else
``AstraSim_Analytical_Congestion_Unaware`` on ``PATH``) and parses its
output with :func:`parse_output`.

ASTRA-sim exits 0 even when a run deadlocks (it then prints "unreleased
nodes" instead of every rank's finish line), so success here means *every*
rank printed ``sys[i] finished, <T> cycles, exposed communication <E>
cycles.``; anything else raises :class:`AstraSimError` naming the ranks that
did not finish. Cycles are nanoseconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from flint.chakra.reader import find_rank_files
from flint.errors import FlintError

BINARY_ENV = "FLINT_ASTRA_SIM"
DEFAULT_BINARY = "AstraSim_Analytical_Congestion_Unaware"
TOPOLOGIES = ("Ring", "Switch", "FullyConnected")

_FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")


class AstraSimError(FlintError):
    """ASTRA-sim could not be run, or a run did not finish on every rank."""


@dataclass(frozen=True)
class NetworkDim:
    """One network dimension: ``npus`` ranks connected by ``topology``."""

    topology: str
    npus: int
    bandwidth_gbps: float
    latency_ns: float

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise FlintError(f"network topology '{self.topology}' is not one of {', '.join(TOPOLOGIES)}")
        if self.npus < 2:
            raise FlintError(f"network dimension of {self.npus} NPUs: ASTRA-sim needs at least 2 per dimension")
        if self.bandwidth_gbps <= 0 or self.latency_ns < 0:
            raise FlintError(f"network dimension needs a positive bandwidth and non-negative latency (got {self.bandwidth_gbps} GB/s, {self.latency_ns} ns)")


@dataclass(frozen=True)
class AstraSimConfig:
    """Network + system parameters for one ASTRA-sim run.

    Collective algorithm fields take one name per network dimension, or a
    single name used for every dimension ("ring", "direct", "halvingDoubling",
    "doubleBinaryTree", ...).
    """

    dims: tuple[NetworkDim, ...]
    all_reduce: tuple[str, ...] = ("ring",)
    all_gather: tuple[str, ...] = ("ring",)
    reduce_scatter: tuple[str, ...] = ("ring",)
    all_to_all: tuple[str, ...] = ("ring",)
    scheduling_policy: str = "LIFO"
    endpoint_delay: int = 10
    active_chunks_per_dimension: int = 1
    preferred_dataset_splits: int = 4
    collective_optimization: str = "localBWAware"
    local_mem_bw_gbps: float = 1600.0
    boost_mode: int = 0
    roofline: bool = False
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if not self.dims:
            raise FlintError("ASTRA-sim network needs at least one dimension")
        if self.roofline and not self.peak_tflops:
            raise FlintError("roofline=True needs peak_tflops (the device's peak TFLOP/s)")
        if self.scheduling_policy not in ("LIFO", "FIFO"):
            raise FlintError(f"scheduling_policy '{self.scheduling_policy}' must be LIFO or FIFO")
        for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            algos = getattr(self, name)
            if isinstance(algos, str):
                algos = (algos,)
            if len(algos) == 1:
                algos = tuple(algos) * len(self.dims)
            if len(algos) != len(self.dims):
                raise FlintError(f"{name} names {len(algos)} algorithms for a {len(self.dims)}-dimension network")
            object.__setattr__(self, name, tuple(algos))

    @property
    def npus_count(self) -> int:
        n = 1
        for d in self.dims:
            n *= d.npus
        return n

    @classmethod
    def simple(cls, topology: str | Sequence[str], npus: int | Sequence[int], bandwidth_gbps: float | Sequence[float],
               latency_ns: float | Sequence[float], **kw) -> "AstraSimConfig":
        """Build from per-dimension lists (or scalars for a one-dimension network)."""
        def as_list(v):
            return list(v) if isinstance(v, (list, tuple)) else [v]
        tops, ns, bws, lats = as_list(topology), as_list(npus), as_list(bandwidth_gbps), as_list(latency_ns)
        if not len(tops) == len(ns) == len(bws) == len(lats):
            raise FlintError(f"per-dimension lists differ in length: topology {tops}, npus {ns}, bandwidth {bws}, latency {lats}")
        return cls(dims=tuple(NetworkDim(t, int(n), float(b), float(l)) for t, n, b, l in zip(tops, ns, bws, lats)), **kw)


def network_yaml(cfg: AstraSimConfig) -> str:
    def row(vals):
        return "[ " + ", ".join(vals) + " ]"
    return (
        f"topology: {row(d.topology for d in cfg.dims)}\n"
        f"npus_count: {row(str(d.npus) for d in cfg.dims)}\n"
        f"bandwidth: {row(repr(float(d.bandwidth_gbps)) for d in cfg.dims)}  # GB/s\n"
        f"latency: {row(repr(float(d.latency_ns)) for d in cfg.dims)}  # ns\n"
    )


def system_json(cfg: AstraSimConfig) -> str:
    sysd = {
        "scheduling-policy": cfg.scheduling_policy,
        "endpoint-delay": cfg.endpoint_delay,
        "active-chunks-per-dimension": cfg.active_chunks_per_dimension,
        "preferred-dataset-splits": cfg.preferred_dataset_splits,
        "all-reduce-implementation": list(cfg.all_reduce),
        "all-gather-implementation": list(cfg.all_gather),
        "reduce-scatter-implementation": list(cfg.reduce_scatter),
        "all-to-all-implementation": list(cfg.all_to_all),
        "collective-optimization": cfg.collective_optimization,
        "local-mem-bw": cfg.local_mem_bw_gbps,
        "boost-mode": cfg.boost_mode,
        "roofline-enabled": 1 if cfg.roofline else 0,
    }
    if cfg.peak_tflops:
        sysd["peak-perf"] = cfg.peak_tflops
    return json.dumps(sysd, indent=2) + "\n"


def memory_json() -> str:
    return json.dumps({"memory-type": "NO_MEMORY_EXPANSION"}, indent=2) + "\n"


@dataclass(frozen=True)
class ConfigFiles:
    network: Path
    system: Path
    memory: Path


def write_configs(cfg: AstraSimConfig, out_dir: str | Path) -> ConfigFiles:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = ConfigFiles(out / "network.yml", out / "system.json", out / "memory.json")
    files.network.write_text(network_yaml(cfg))
    files.system.write_text(system_json(cfg))
    files.memory.write_text(memory_json())
    return files


@dataclass(frozen=True)
class AstraSimResult:
    """Per-rank finish time and exposed communication, in cycles (ns)."""

    cycles: dict[int, int]
    exposed_comm_cycles: dict[int, int]
    output: str = field(repr=False, default="")

    @property
    def iteration_cycles(self) -> int:
        """The step time: the last rank's finish time."""
        return max(self.cycles.values())


def parse_output(text: str, world_size: int) -> AstraSimResult:
    """Parse ASTRA-sim's stdout; raise :class:`AstraSimError` unless all ``world_size`` ranks finished."""
    cycles: dict[int, int] = {}
    exposed: dict[int, int] = {}
    for m in _FINISHED.finditer(text):
        r = int(m.group(1))
        cycles[r] = int(m.group(2))
        exposed[r] = int(m.group(3))
    missing = [r for r in range(world_size) if r not in cycles]
    if missing:
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        why = ("it reports unreleased nodes: the trace deadlocked (check collective order and send/recv matching with `flint inspect`)"
               if "unreleased nodes" in text else "its output has no finish line for them")
        raise AstraSimError(f"ASTRA-sim did not finish {len(missing)} of {world_size} ranks ({shown}); {why}")
    extra = [r for r in cycles if r >= world_size]
    if extra:
        raise AstraSimError(f"ASTRA-sim reported rank {extra[0]} but the trace has {world_size} ranks")
    return AstraSimResult(cycles, exposed, text)


def find_binary(binary: str | Path | None = None) -> str:
    """The ASTRA-sim binary: the argument, else ``$FLINT_ASTRA_SIM``, else on PATH."""
    cand = binary or os.environ.get(BINARY_ENV) or shutil.which(DEFAULT_BINARY)
    if not cand:
        raise AstraSimError(f"ASTRA-sim binary not found: pass its path or set {BINARY_ENV} (looked for {DEFAULT_BINARY} on PATH)")
    p = Path(cand)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise AstraSimError(f"ASTRA-sim binary {p} does not exist or is not executable")
    return str(p)


def command(binary: str, prefix: Path, comm_groups: Path, files: ConfigFiles) -> list[str]:
    return [
        binary,
        f"--workload-configuration={prefix}",
        f"--comm-group-configuration={comm_groups}",
        f"--system-configuration={files.system}",
        f"--remote-memory-configuration={files.memory}",
        f"--network-configuration={files.network}",
    ]


def run_astra_sim(trace: str | Path, cfg: AstraSimConfig, *, binary: str | Path | None = None,
                  work_dir: str | Path | None = None, timeout_s: float | None = None) -> AstraSimResult:
    """Run ASTRA-sim on a trace directory (or ``DIR/PREFIX``) written by :func:`flint.chakra.write_trace`."""
    exe = find_binary(binary)
    directory, prefix, rank_files = find_rank_files(trace)
    world = len(rank_files)
    if cfg.npus_count != world:
        raise AstraSimError(f"network has {cfg.npus_count} NPUs ({' x '.join(str(d.npus) for d in cfg.dims)}) but the trace has {world} ranks")
    groups = directory / f"{prefix}.comm_groups.json"
    tmp = None
    if work_dir is None:
        tmp = tempfile.mkdtemp(prefix="flint-astra-")
        work_dir = tmp
    try:
        files = write_configs(cfg, work_dir)
        if not groups.exists():  # foreign traces: every collective is over all ranks
            groups = Path(work_dir) / "comm_groups.json"
            groups.write_text("{}\n")
        cmd = command(exe, (directory / prefix).resolve(), groups.resolve(), files)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=work_dir)
        except subprocess.TimeoutExpired:
            raise AstraSimError(f"ASTRA-sim did not finish within {timeout_s} s") from None
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            tail = "\n".join(out.strip().splitlines()[-5:])
            raise AstraSimError(f"ASTRA-sim exited with status {proc.returncode}:\n{tail}")
        return parse_output(out, world)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
