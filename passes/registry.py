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

import dataclasses
import difflib
import importlib
import typing
from importlib.metadata import entry_points
from typing import Callable, Mapping

from xdsl.passes import ModulePass, PassPipeline

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


def options(pass_cls: type[ModulePass]) -> list[str]:
    """A pass's options as ``-p`` spells them, each with its default: ``["device=h100-sxm", ...]``."""
    out = []
    for f in dataclasses.fields(pass_cls):
        if f.name == "name" or not f.init:
            continue
        v = f.default
        default = "(required)" if v is dataclasses.MISSING else str(v).lower() if isinstance(v, bool) else str(v)
        out.append(f"{f.name.replace('_', '-')}={default}")
    return out


def _kind(hint: object) -> str:
    """What an option of this type takes, in words."""
    text = str(hint)
    for word, kind in (("tuple", "a comma-separated list"), ("bool", "true or false"), ("int", "an integer"),
                       ("float", "a number"), ("str", "a string")):
        if word in text:
            return kind
    return text


def parse_passes(available: Mapping[str, Callable[[], type[ModulePass]]], spec: str,
                 callback: Callable | None = None) -> PassPipeline:
    """xDSL's ``PassPipeline.parse_spec``, with errors that name the pass and the option at fault and list
    the valid ones (xDSL's own say only "Incompatible types: given ('maybe',), expected <class 'bool'>")."""
    from xdsl.utils.arg_spec import _convert_arg_to_type, parse_pipeline  # xdsl is pinned (0.75.0)

    passes = []
    for s in parse_pipeline(spec):
        if s.name not in available:
            close = difflib.get_close_matches(s.name, list(available), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise FlintError(f"unknown pass '{s.name}'{hint} (flint-opt --help lists the passes)")
        cls = available[s.name]()
        try:
            passes.append(cls.from_pass_spec(s))
            continue
        except ValueError as e:
            problem = str(e)
        fields = {f.name for f in dataclasses.fields(cls) if f.name != "name" and f.init}
        hints = typing.get_type_hints(cls)
        for key, value in s.normalize_parameter_names().parameters.items():
            shown = key.replace("_", "-")
            if key not in fields:
                problem = f"it has no option '{shown}'"
                break
            try:
                _convert_arg_to_type(value, hints[key])
            except ValueError:
                given = ",".join(str(v).lower() if isinstance(v, bool) else str(v) for v in value)
                kind = _kind(hints[key])
                problem = (f"option '{shown}' is {given!r}, which is not {kind}" if given else
                           f"option '{shown}' needs a value ({kind})")
                break
        raise FlintError(f"pass '{s.name}': {problem}; its options: {', '.join(options(cls)) or '(none)'}")
    return PassPipeline(tuple(passes), callback)
