"""Import a converted real trace into Flint's trace form, collectives as collectives.

``chakra_converter PyTorch`` on a CPU/gloo run writes every host operator as
a COMP_NODE, the c10d collectives included (CHAKRA.md). :func:`read_trace`
reads that as is; :func:`import_executed_trace` then turns each counted
collective (:class:`flint.validate.executed.ExecutedCollective`) into a
COMM_COLL node with its kind, input bytes and communicator group, and zeroes
the measured host duration of the records nested inside it (gloo's own
``gloo:*`` records, buffer views), whose time is the collective's. Every other
node gets its measured exclusive host time from the profiler trace
(:attr:`RankCounts.durations_us`; the converter's ``duration_micros`` is 0
without Kineto linking), so
:func:`flint.sim.simulate` replays the measured compute and prices the
communication with the network model, exactly as for Flint's own traces.

Communicator groups come from the mesh of the recipe (row-major rank layout,
as ``init_device_mesh``): on a 1-D mesh every collective spans all ranks; on
a 2-D ``dp x tp`` mesh a collective issued under an FSDP / replicate profiler
label spans the rank's ``dp`` group, any other (DTensor's) its ``tp`` group.
The execution trace does not name the process group of a gloo collective, so
this is an inference; :func:`flint.chakra.check_trace` then verifies that all
members of every group issue the same collectives in the same order.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from flint.capture import opclass
from flint.chakra import read_trace
from flint.mesh import Mesh, assign_group_ids
from flint.trace import CollKind, NodeKind, RankProgram, Trace
from flint.validate.executed import RankCounts

_KIND = {opclass.ALL_REDUCE: CollKind.ALL_REDUCE, opclass.ALL_GATHER: CollKind.ALL_GATHER,
         opclass.REDUCE_SCATTER: CollKind.REDUCE_SCATTER, opclass.ALL_TO_ALL: CollKind.ALL_TO_ALL,
         opclass.BROADCAST: CollKind.BROADCAST}


def import_executed_trace(chakra_dir: str | Path, counts: list[RankCounts], mesh: Mesh) -> Trace:
    """The converted real trace in ``chakra_dir`` with its collectives as COMM_COLL nodes."""
    trace = read_trace(chakra_dir)
    axes_sets = [(a,) for a in range(mesh.ndim)]
    groups, lookup = assign_group_ids(mesh, axes_sets)
    data = [a for a in ("dp_shard", "dp_replicate") if a in mesh.axis_names]
    dp_axis = mesh.axis_names.index(data[0]) if data else 0
    tp_axis = mesh.axis_names.index("tp") if "tp" in mesh.axis_names else dp_axis
    ranks = []
    for rank, (prog, rc) in enumerate(zip(trace.ranks, counts)):
        t = prog.table
        row_of = {int(nid): i for i, nid in enumerate(t.node_ids.tolist())}
        kind, comm_type = t.kind.copy(), t.comm_type.copy()
        comm_bytes, comm_group = t.comm_bytes.copy(), t.comm_group.copy()
        duration = t.duration_us.copy()
        if rc.durations_us:
            ids = t.node_ids.tolist()
            duration = np.array([rc.durations_us.get(int(nid), 0.0) for nid in ids], dtype=np.float64)
        for c in rc.collective_ops:
            if c.kind not in _KIND:
                continue
            i = row_of[c.node_id]
            axis = dp_axis if (c.data_parallel or mesh.ndim == 1) else tp_axis
            kind[i], comm_type[i], comm_bytes[i] = NodeKind.COLL, _KIND[c.kind], c.input_bytes
            comm_group[i] = lookup[(axis,)][rank]
            duration[i] = np.nan
        for nid in rc.inside_collectives:
            if nid in row_of:
                duration[row_of[nid]] = 0.0
        table = dataclasses.replace(t, kind=kind, comm_type=comm_type, comm_bytes=comm_bytes,
                                    comm_group=comm_group, duration_us=duration)
        ranks.append(RankProgram(table))
    return Trace(trace.world_size, ranks, groups)
