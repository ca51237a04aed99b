"""Run ASTRA-sim (analytical backend) on a Chakra trace.

:class:`AstraSimConfig` holds the parameters that matter (per-dimension
topology, NPU count, bandwidth and latency; collective algorithms; roofline,
peak TFLOP/s and local memory bandwidth) *in Flint's units*, and renders the
files ASTRA-sim wants: the network YAML, the system JSON, the remote-memory
JSON (``../shared/CHAKRA.md`` lists the keys) and a logging configuration.
:func:`run_astra_sim` writes them, runs the binary (``binary=`` argument, else
``$FLINT_ASTRA_SIM``, else ``AstraSim_Analytical_Congestion_Unaware`` on
``PATH``) and parses its output with :func:`parse_output`.

The rendered configs make ASTRA-sim price what Flint's network model prices
(``../shared/tools/astra-sim/README.md`` lists what was measured; each item
below is held by a test against the real binary):

- bandwidth: Flint's ``bandwidth_gbytes_per_s`` is 1e9 bytes/s, ASTRA-sim
  reads GiB/s (2^30), so the YAML holds ``GB/s * 1e9 / 2^30``;
- latency: Flint charges a message's latency once per network hop it counts
  (one for a switch); ASTRA-sim's ``Switch`` costs two hops (source, switch,
  destination), so a switch dimension gets half the latency per hop;
- ``preferred-dataset-splits`` 1 (ASTRA-sim's usual 4 splits every collective
  into chunks that each pay every step's latency; Flint does not split);
- ``endpoint-delay`` 1 ns (0 trips an assertion in ASTRA-sim's event queue);
- ``local-mem-bw``: reductions in ASTRA-sim pay local memory time, which
  Flint does not model, so it is 10^7 GB/s (negligible) unless the roofline
  is on; then it is the roofline's memory bandwidth (the device's HBM
  bandwidth × efficiency), because ASTRA-sim's roofline uses this one number.

With these, single ring all-reduce, all-gather and reduce-scatter times agree
with :func:`flint.cost.collective_time_us` to 0.02% on ring, switch and
fully-connected networks. All-to-all does not: ASTRA-sim's ``ring``
all-to-all relays chunks around the ring ((n-1)/2 of the buffer per rank),
Flint's is a pairwise exchange ((n-1)/n).

Robustness (each a behaviour of the real binary):

- every path on ASTRA-sim's command line is either absolute (the workload
  prefix, the binary) or a fixed name inside the work directory, where the
  process runs: ASTRA-sim opens config paths relative to its working
  directory, and silently ignores a comm-group file whose path contains the
  word "empty", so the group file is copied to ``comm_groups.json`` there;
- the ``workload`` logger is configured synchronous (``logging.toml``): the
  default one is asynchronous and loses finish lines when the process
  crashes;
- ASTRA-sim exits 0 even when a run deadlocks (it prints "unreleased nodes"
  instead of every rank's finish line), and a sub-group collective on a
  one-dimensional network finishes every rank and then crashes in teardown
  (status 134 / signal 6 or 11). Success here means *every* rank printed
  ``sys[i] finished, <T> cycles, exposed communication <E> cycles.`` and none
  reported unreleased nodes, whatever the exit status;
  :attr:`AstraSimResult.teardown_status` records such a crash.
- :func:`roofline_safe` makes compute nodes ASTRA-sim's roofline can price
  (``num_ops`` 0 with ``tensor_size`` > 0 is a 0/0 runtime that deadlocks it).

Cycles are nanoseconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from flint.chakra.reader import find_comm_groups, find_rank_files
from flint.errors import FlintError

BINARY_ENV = "FLINT_ASTRA_SIM"
DEFAULT_BINARY = "AstraSim_Analytical_Congestion_Unaware"
TOPOLOGIES = ("Ring", "Switch", "FullyConnected")
#: ASTRA-sim reads bandwidth as GiB/s; Flint's GB/s are 1e9 bytes/s.
GIB_PER_GB = 1e9 / 2**30
#: Hops a message takes on one dimension of each topology in ASTRA-sim (a switch is source -> switch -> destination).
HOPS = {"Ring": 1, "Switch": 2, "FullyConnected": 1}
#: local-mem-bw (GB/s) that makes ASTRA-sim's local memory time of reductions negligible.
NEGLIGIBLE_MEM_BW_GBPS = 1e7
#: Exit statuses of ASTRA-sim's documented teardown crash (abort / segfault, as a shell or as Python reports them).
TEARDOWN_STATUSES = frozenset({134, 139, -6, -11})

_FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")

# Files inside the work directory (fixed names: no "empty", no path the user chose).
NETWORK_FILE = "network.yml"
SYSTEM_FILE = "system.json"
MEMORY_FILE = "memory.json"
LOGGING_FILE = "logging.toml"
GROUPS_FILE = "comm_groups.json"
LOG_DIR = "log"


class AstraSimError(FlintError):
    """ASTRA-sim could not be run, or a run did not finish on every rank."""


@dataclass(frozen=True)
class NetworkDim:
    """One network dimension: ``npus`` ranks connected by ``topology``.

    ``bandwidth_gbps`` is Flint's per-rank one-direction bandwidth in GB/s
    (1e9 bytes/s); ``latency_ns`` what Flint charges one message on this
    dimension (one hop). :func:`network_yaml` converts both to ASTRA-sim's
    conventions.
    """

    topology: str
    npus: int
    bandwidth_gbps: float
    latency_ns: float

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise FlintError(f"network topology '{self.topology}' is not one of {', '.join(TOPOLOGIES)}")
        if self.npus < 2:
            raise FlintError(f"network dimension of {self.npus} NPUs: ASTRA-sim needs at least 2 per dimension")
        if not (self.bandwidth_gbps > 0 and self.latency_ns >= 0) or not np.isfinite([self.bandwidth_gbps, self.latency_ns]).all():
            raise FlintError(f"network dimension needs a positive bandwidth and non-negative latency (got {self.bandwidth_gbps} GB/s, {self.latency_ns} ns)")


@dataclass(frozen=True)
class AstraSimConfig:
    """Network + system parameters for one ASTRA-sim run (Flint's units; module docstring).

    Collective algorithm fields take one name per network dimension, or a
    single name used for every dimension ("ring", "direct", "halvingDoubling",
    "doubleBinaryTree", ...). ``local_mem_bw_gbps`` ``None`` means: the
    roofline's ``roofline_mem_bw_gbps`` when the roofline is on, else
    negligible local memory time.
    """

    dims: tuple[NetworkDim, ...]
    all_reduce: tuple[str, ...] = ("ring",)
    all_gather: tuple[str, ...] = ("ring",)
    reduce_scatter: tuple[str, ...] = ("ring",)
    all_to_all: tuple[str, ...] = ("ring",)
    scheduling_policy: str = "LIFO"
    endpoint_delay: int = 1
    active_chunks_per_dimension: int = 1
    preferred_dataset_splits: int = 1
    collective_optimization: str = "localBWAware"
    local_mem_bw_gbps: float | None = None
    boost_mode: int = 0
    roofline: bool = False
    peak_tflops: float | None = None
    roofline_mem_bw_gbps: float | None = None

    def __post_init__(self) -> None:
        if not self.dims:
            raise FlintError("ASTRA-sim network needs at least one dimension")
        if self.roofline and not (self.peak_tflops and self.roofline_mem_bw_gbps):
            raise FlintError("roofline=True needs peak_tflops and roofline_mem_bw_gbps (the device's compute and memory roofs)")
        if self.scheduling_policy not in ("LIFO", "FIFO"):
            raise FlintError(f"scheduling_policy '{self.scheduling_policy}' must be LIFO or FIFO")
        if self.endpoint_delay < 1:
            raise FlintError(f"endpoint_delay {self.endpoint_delay}: ASTRA-sim needs at least 1 ns (0 trips an assertion in its event queue)")
        if self.preferred_dataset_splits < 1:
            raise FlintError(f"preferred_dataset_splits {self.preferred_dataset_splits} must be at least 1")
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

    @property
    def local_mem_bw(self) -> float:
        """The ``local-mem-bw`` ASTRA-sim gets (GB/s)."""
        if self.local_mem_bw_gbps is not None:
            return self.local_mem_bw_gbps
        return self.roofline_mem_bw_gbps if self.roofline else NEGLIGIBLE_MEM_BW_GBPS

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
    """ASTRA-sim's network YAML: bandwidth in GiB/s, latency per hop (module docstring)."""
    def row(vals):
        return "[ " + ", ".join(vals) + " ]"
    return (
        "# written by Flint: bandwidth = Flint's GB/s in GiB/s (ASTRA-sim's unit); latency = Flint's per-message\n"
        "# latency in ns divided by the hops ASTRA-sim counts per message (Switch: 2)\n"
        f"topology: {row(d.topology for d in cfg.dims)}\n"
        f"npus_count: {row(str(d.npus) for d in cfg.dims)}\n"
        f"bandwidth: {row(repr(float(d.bandwidth_gbps) * GIB_PER_GB) for d in cfg.dims)}\n"
        f"latency: {row(repr(float(d.latency_ns) / HOPS[d.topology]) for d in cfg.dims)}\n"
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
        "local-mem-bw": cfg.local_mem_bw,
        "boost-mode": cfg.boost_mode,
        "roofline-enabled": 1 if cfg.roofline else 0,
    }
    if cfg.peak_tflops:
        sysd["peak-perf"] = cfg.peak_tflops
    return json.dumps(sysd, indent=2) + "\n"


def memory_json() -> str:
    return json.dumps({"memory-type": "NO_MEMORY_EXPANSION"}, indent=2) + "\n"


def logging_toml() -> str:
    """spdlog_setup configuration: a synchronous ``workload`` logger, so finish lines survive a crash."""
    return ('# written by Flint: the finish lines ("sys[i] finished, ...") go through a synchronous logger\n'
            '[[sink]]\nname = "flint_stdout"\ntype = "stdout_sink_mt"\n\n'
            '[[logger]]\nname = "workload"\nsinks = ["flint_stdout"]\nlevel = "info"\n')


@dataclass(frozen=True)
class ConfigFiles:
    """The files of one run, inside ``dir`` (names relative to it)."""

    dir: Path
    network: str = NETWORK_FILE
    system: str = SYSTEM_FILE
    memory: str = MEMORY_FILE
    logging: str = LOGGING_FILE
    groups: str = GROUPS_FILE


def write_configs(cfg: AstraSimConfig, out_dir: str | Path, comm_groups: str | Path | None = None) -> ConfigFiles:
    """Write the configs (and a copy of ``comm_groups``, or ``{}``) into ``out_dir`` under fixed names."""
    out = Path(out_dir).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        files = ConfigFiles(out)
        (out / files.network).write_text(network_yaml(cfg))
        (out / files.system).write_text(system_json(cfg))
        (out / files.memory).write_text(memory_json())
        (out / files.logging).write_text(logging_toml())
        if comm_groups is not None:
            shutil.copyfile(comm_groups, out / files.groups)
        else:  # foreign traces without a group file: every collective is over all ranks
            (out / files.groups).write_text("{}\n")
    except OSError as e:
        raise AstraSimError(f"cannot write ASTRA-sim configs into {out}: {e.strerror or e}") from None
    return files


@dataclass(frozen=True)
class AstraSimResult:
    """Per-rank finish time and exposed communication, in cycles (ns)."""

    cycles: dict[int, int]
    exposed_comm_cycles: dict[int, int]
    output: str = field(repr=False, default="")
    #: ASTRA-sim's exit status when it crashed in teardown after every rank finished, else ``None``.
    teardown_status: int | None = None

    @property
    def iteration_cycles(self) -> int:
        """The step time: the last rank's finish time."""
        return max(self.cycles.values())


def parse_output(text: str, world_size: int, returncode: int = 0) -> AstraSimResult:
    """Parse ASTRA-sim's output; raise :class:`AstraSimError` unless all ``world_size`` ranks finished."""
    cycles: dict[int, int] = {}
    exposed: dict[int, int] = {}
    for m in _FINISHED.finditer(text):
        r = int(m.group(1))
        cycles[r] = int(m.group(2))
        exposed[r] = int(m.group(3))
    missing = [r for r in range(world_size) if r not in cycles]
    deadlock = "unreleased nodes" in text
    if missing or deadlock:
        if deadlock:
            why = "it reports unreleased nodes: the trace deadlocked (check collective order and send/recv matching with `flint inspect`)"
        elif returncode != 0:
            tail = "\n".join(text.strip().splitlines()[-5:])
            why = f"it exited with status {returncode}:\n{tail}"
        else:
            why = "its output has no finish line for them"
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        head = f"ASTRA-sim did not finish {len(missing)} of {world_size} ranks ({shown})" if missing else \
            f"ASTRA-sim finished every rank of {world_size} but"
        raise AstraSimError(f"{head}; {why}")
    extra = [r for r in cycles if r >= world_size]
    if extra:
        raise AstraSimError(f"ASTRA-sim reported rank {extra[0]} but the trace has {world_size} ranks")
    return AstraSimResult(cycles, exposed, text, returncode if returncode != 0 else None)


def find_binary(binary: str | Path | None = None) -> str:
    """The ASTRA-sim binary (absolute path): the argument, else ``$FLINT_ASTRA_SIM``, else on PATH."""
    cand = binary or os.environ.get(BINARY_ENV) or shutil.which(DEFAULT_BINARY)
    if not cand:
        raise AstraSimError(f"ASTRA-sim binary not found: pass its path or set {BINARY_ENV} (looked for {DEFAULT_BINARY} on PATH)")
    p = Path(cand)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise AstraSimError(f"ASTRA-sim binary {p} does not exist or is not executable")
    return str(p.resolve())


def command(binary: str, prefix: Path, files: ConfigFiles) -> list[str]:
    """The command line: the workload prefix absolute, every config a fixed name in the work directory."""
    return [
        binary,
        f"--workload-configuration={prefix}",
        f"--comm-group-configuration={files.groups}",
        f"--system-configuration={files.system}",
        f"--remote-memory-configuration={files.memory}",
        f"--network-configuration={files.network}",
        f"--logging-configuration={files.logging}",
        f"--logging-folder={LOG_DIR}",
    ]


def roofline_safe(trace):
    """A copy of ``trace`` whose compute nodes ASTRA-sim's roofline can price, or ``None`` if it already is.

    ASTRA-sim prices a compute node as ``num_ops / min(peak, mem_bw *
    num_ops / tensor_size)``: ``num_ops`` 0 with ``tensor_size`` > 0 is 0/0
    (the run deadlocks), and ``tensor_size`` 0 skips the node. Setting the
    zero one to 1 gives the intended time: ``tensor_size / mem_bw`` for a
    memory-only node, ``num_ops / peak`` for a compute-only one.
    """
    from flint.trace import NodeKind, RankProgram, Trace

    patched: dict[int, object] = {}
    for prog in trace.ranks:
        t = prog.table
        if id(t) in patched:
            continue
        comp = (t.kind == NodeKind.COMP) & np.isnan(t.duration_us)
        fix_ops = comp & (t.flops <= 0) & (t.tensor_bytes > 0)
        fix_bytes = comp & (t.flops > 0) & (t.tensor_bytes <= 0)
        if not (fix_ops.any() or fix_bytes.any()):
            patched[id(t)] = t
            continue
        patched[id(t)] = replace(t, flops=np.where(fix_ops, 1, t.flops), tensor_bytes=np.where(fix_bytes, 1, t.tensor_bytes))
    if all(patched[id(p.table)] is p.table for p in trace.ranks):
        return None
    ranks = [RankProgram(patched[id(p.table)], p.group_ids, p.peer_ranks) for p in trace.ranks]
    return Trace(trace.world_size, ranks, trace.comm_groups)


def run_astra_sim(trace: str | Path, cfg: AstraSimConfig, *, binary: str | Path | None = None,
                  work_dir: str | Path | None = None, timeout_s: float | None = None,
                  comm_groups: str | Path | None = None) -> AstraSimResult:
    """Run ASTRA-sim on a trace directory (or ``DIR/PREFIX``) on disk.

    ``comm_groups`` overrides the trace's comm-group file (found by
    :func:`flint.chakra.reader.find_comm_groups`). The configs go into
    ``work_dir`` (kept) or a temporary directory (removed).
    """
    exe = find_binary(binary)
    directory, prefix, rank_files = find_rank_files(trace)
    world = len(rank_files)
    if cfg.npus_count != world:
        raise AstraSimError(f"network has {cfg.npus_count} NPUs ({' x '.join(str(d.npus) for d in cfg.dims)}) but the trace has {world} ranks")
    groups = Path(comm_groups) if comm_groups is not None else find_comm_groups(directory, prefix)
    tmp = None
    if work_dir is None:
        tmp = tempfile.mkdtemp(prefix="flint-astra-")
        work_dir = tmp
    try:
        files = write_configs(cfg, work_dir, groups)
        cmd = command(exe, (directory / prefix).resolve(), files)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s, cwd=files.dir)
        except subprocess.TimeoutExpired:
            raise AstraSimError(f"ASTRA-sim did not finish within {timeout_s} s") from None
        except OSError as e:
            raise AstraSimError(f"cannot run ASTRA-sim {exe}: {e.strerror or e}") from None
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 and proc.returncode not in TEARDOWN_STATUSES:
            tail = "\n".join(out.strip().splitlines()[-5:])
            raise AstraSimError(f"ASTRA-sim exited with status {proc.returncode}:\n{tail}")
        return parse_output(out, world, proc.returncode)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
