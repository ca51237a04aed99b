"""Where every pass `flint-opt` knows is registered: the one place.

Flint's own passes are listed in ``FLINT_PASSES`` (imported lazily, so the
driver starts fast). Out-of-tree passes join through the Python entry-point
group ``flint.passes``: a package declares, in its ``pyproject.toml``,

    [project.entry-points."flint.passes"]
    my-reorder = "my_pkg.reorder:MyReorderPass"

and, once installed, ``flint-opt -p my-reorder`` runs it. An entry point
names a ``ModulePass`` subclass whose ``name`` must equal the entry's name.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Callable

from xdsl.passes import ModulePass

from flint.errors import FlintError

ENTRY_POINT_GROUP = "flint.passes"

# pass name -> "module:Class", resolved on first use.
FLINT_PASSES: dict[str, str] = {
    "canonicalize-dist": "flint.passes.canonicalize_dist:CanonicalizeDistPass",
    "verify-dist": "flint.passes.verify_dist:VerifyDistPass",
    "annotate-cost": "flint.passes.annotate_cost:AnnotateCostPass",
    "fuse-pointwise": "flint.passes.fuse_pointwise:FusePointwisePass",
    "attention-kernel": "flint.passes.attention_kernel:AttentionKernelPass",
    "pipeline-split": "flint.passes.pipeline_split:PipelineSplitPass",
    "lower-to-chakra": "flint.passes.lower_to_chakra:LowerToChakraPass",
    "decompose-collectives": "flint.passes.decompose_collectives:DecomposeCollectivesPass",
    "verify-p2p": "flint.passes.verify_p2p:VerifyP2PPass",
    "shard-annotate": "flint.passes.shard_annotate:ShardAnnotatePass",
    "shard-expand": "flint.passes.shard_expand:ShardExpandPass",
    "reorder-all-gather": "flint.passes.reorder_all_gather:ReorderAllGatherPass",
    "sink-waits": "flint.passes.sink_waits:SinkWaitsPass",
    "hoist-starts": "flint.passes.hoist_starts:HoistStartsPass",
    "assign-streams": "flint.passes.assign_streams:AssignStreamsPass",
    "bucket-collectives": "flint.passes.bucket_collectives:BucketCollectivesPass",
    "split-collectives": "flint.passes.split_collectives:SplitCollectivesPass",
    "overlap-report": "flint.passes.overlap_report:OverlapReportPass",
    "micro-pipeline-tp": "flint.passes.micro_pipeline_tp:MicroPipelineTPPass",
}


def _loader(ref: str) -> Callable[[], type[ModulePass]]:
    def load() -> type[ModulePass]:
        module, _, cls = ref.partition(":")
        return getattr(importlib.import_module(module), cls)

    return load


def _entry_point_loader(ep, name: str) -> Callable[[], type[ModulePass]]:
    def load() -> type[ModulePass]:
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, ModulePass)):
            raise FlintError(f"entry point '{name}' in group '{ENTRY_POINT_GROUP}' ({ep.value}) is not a ModulePass class")
        if cls.name != name:
            raise FlintError(
                f"entry point '{name}' in group '{ENTRY_POINT_GROUP}' names pass class {cls.__name__} "
                f"whose name is '{cls.name}'; the two must match"
            )
        return cls

    return load


def all_passes() -> dict[str, Callable[[], type[ModulePass]]]:
    """Flint's passes plus every installed ``flint.passes`` entry point.

    A plug-in cannot shadow a built-in pass: built-ins win.
    """
    found: dict[str, Callable[[], type[ModulePass]]] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        found[ep.name] = _entry_point_loader(ep, ep.name)
    found.update({name: _loader(ref) for name, ref in FLINT_PASSES.items()})
    return found


def summary(pass_cls: type[ModulePass]) -> str:
    """The first line of a pass's docstring."""
    doc = (pass_cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else "(no description)"
