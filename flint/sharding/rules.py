"""Sharding rules as data (``rules.toml``): which parameters ``tp`` splits, which
rule kind each ATen op follows, and the shardings a plan gives a step's
arguments (parameters, batch inputs, the activation between blocks)."""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from flint.errors import FlintError
from flint.tomlio import parse_toml
from flint.plan import Plan
from flint.sharding.spec import Sharding

RULES_PATH = Path(__file__).with_name("rules.toml")


class RulesError(FlintError):
    """A rules file is malformed; the message names the file and the entry."""


@lru_cache(maxsize=None)
def _tagged_pointwise(target: str) -> bool:
    from flint.cost.opclass import ELEMENTWISE, classify_target

    return target.startswith("aten.") and classify_target(target) == ELEMENTWISE


@dataclass(frozen=True)
class Rules:
    """Parameter patterns (pattern, split dim) and op name -> rule kind."""

    tp_params: tuple[tuple[str, int], ...]
    op_kinds: dict
    linear_all: frozenset
    linear_first: frozenset
    source: str
    expert_params: tuple[str, ...] = ()  # fnmatch patterns of stacked MoE expert weights (dim 0: experts)
    expert_tp: tuple[tuple[str, int], ...] = ()  # (pattern, dim tp splits under expert tensor parallelism)
    tp_refused: str = ""  # why tp cannot split this program's model (flint.tp_refused on the module)

    @property
    def tp_capturable(self) -> bool:
        """Whether the captured path can run the tp plan shard-expand refuses (not for MoE layers)."""
        return MOE_TP_REFUSED not in self.tp_refused

    def op_kind(self, target: str) -> str | None:
        """The rule kind of an ATen overload name (``aten.mm.default`` -> ``matmul``), None if unknown. An op
        the rules do not list that ATen tags pointwise (``torch.Tag.pointwise``, the capture's elementwise
        class: ``logical_and``, ``bitwise_and``, ...) is ``pointwise``, not linear in its operands."""
        parts = target.split(".")
        name = parts[1] if len(parts) >= 2 else target
        kind = self.op_kinds.get(name)
        return kind if kind is not None or not _tagged_pointwise(target) else "pointwise"

    def linearity(self, target: str) -> str:
        parts = target.split(".")
        name = parts[1] if len(parts) >= 2 else target
        return "all" if name in self.linear_all else "first" if name in self.linear_first else "none"

    def is_expert(self, param: str | None) -> bool:
        """Whether ``param`` is a stacked expert weight (``[[experts]]`` in the rules)."""
        return param is not None and any(fnmatch.fnmatchcase(param, p) for p in self.expert_params)

    def expert_tp_dim(self, param: str) -> int | None:
        """The dim of expert weight ``param`` that ``tp`` splits (``tp_dim`` of its ``[[experts]]`` entry)."""
        for pattern, dim in self.expert_tp:
            if fnmatch.fnmatchcase(param, pattern):
                return dim
        return None

    def tp_dim(self, param: str) -> int | None:
        """The dim ``tp`` splits in parameter ``param`` (None: replicated over tp)."""
        for pattern, dim in self.tp_params:
            if fnmatch.fnmatchcase(param, pattern):
                return dim
        return None


@lru_cache(maxsize=8)
def load_rules(path: str | None = None) -> Rules:
    """Rules from a TOML file (default: the built-in ``rules.toml``)."""
    p = Path(path) if path else RULES_PATH
    try:
        data = parse_toml(p.read_bytes())
    except FileNotFoundError:
        raise RulesError(f"{p}: no such rules file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RulesError(f"{p}: not valid TOML: {e}") from None
    tp = []
    for i, entry in enumerate(data.get("tp", [])):
        if not isinstance(entry.get("pattern"), str) or not isinstance(entry.get("shard_dim"), int):
            raise RulesError(f"{p}: [[tp]] entry {i} needs pattern (string) and shard_dim (integer)")
        tp.append((entry["pattern"], entry["shard_dim"]))
    kinds: dict[str, str] = {}
    for kind, names in data.get("ops", {}).items():
        for n in names:
            if n in kinds:
                raise RulesError(f"{p}: op '{n}' is listed under both '{kinds[n]}' and '{kind}'")
            kinds[n] = kind
    experts, expert_tp = [], []
    for i, entry in enumerate(data.get("experts", [])):
        if not isinstance(entry.get("pattern"), str) or not isinstance(entry.get("tp_dim", 0), int):
            raise RulesError(f"{p}: [[experts]] entry {i} needs pattern (string) and optionally tp_dim (integer)")
        experts.append(entry["pattern"])
        if "tp_dim" in entry:
            expert_tp.append((entry["pattern"], entry["tp_dim"]))
    lin = data.get("linear", {})
    return Rules(tuple(tp), kinds, frozenset(lin.get("all", ())), frozenset(lin.get("first", ())), str(p),
                 tuple(experts), tuple(expert_tp))


# A program captured without tp records its model's own tensor-parallel plan (a Hugging Face model no TP
# preset names: flint.capture.byom.planned_tp_rules) as [[tp]] patterns, or why shard-expand cannot
# reproduce it, so that its expansion splits what the captured path splits.
TP_RULES_ATTR = "flint.tp_rules"
TP_REFUSED_ATTR = "flint.tp_refused"
# the stack of layers (a model file's, flint.capture.byom.find_layers) whose layers the captured path's preset wraps
# each as an FSDP / DDP unit: the planned path's units (flint.passes.shard_annotate.dp_units)
LAYERS_ATTR = "flint.layers"
# a model whose mixture-of-experts layers neither path splits over tp (its refusal reason says so)
MOE_TP_REFUSED = "mixture-of-experts layers are split over tp on neither path"


def record_tp_rules(module, rules: Sequence[tuple[str, int]] | None, refused: str = "") -> None:
    """Record a model's own ``[[tp]]`` patterns (or why they cannot be had) on a program's module."""
    from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, StringAttr, i64

    if rules is not None:
        module.attributes[TP_RULES_ATTR] = ArrayAttr([ArrayAttr([StringAttr(p), IntegerAttr(d, i64)])
                                                      for p, d in rules])
    if refused:
        module.attributes[TP_REFUSED_ATTR] = StringAttr(refused)


def rules_for(module, path: str | None = None) -> Rules:
    """The rules to expand ``module`` with: a rules file given by ``path`` as it is; else the built-in
    rules, with the ``[[tp]]`` patterns of the model's own plan in place of the built-in ones where the
    module records them (:func:`record_tp_rules`), and its reason where tp cannot split it."""
    from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, StringAttr

    rules = load_rules(path)
    if path:
        return rules
    attr = module.attributes.get(TP_RULES_ATTR)
    if isinstance(attr, ArrayAttr):
        tp = []
        for i, entry in enumerate(attr.data):
            if not (isinstance(entry, ArrayAttr) and len(entry.data) == 2 and isinstance(entry.data[0], StringAttr)
                    and isinstance(entry.data[1], IntegerAttr)):
                raise RulesError(f"module attribute {TP_RULES_ATTR}: entry {i} is not [pattern, dim]")
            tp.append((entry.data[0].data, entry.data[1].value.data))
        rules = replace(rules, tp_params=tuple(tp),
                        source="the tensor-parallel plan the model declares (its Hugging Face "
                               f"config; module attribute {TP_RULES_ATTR})")
    refused = module.attributes.get(TP_REFUSED_ATTR)
    if isinstance(refused, StringAttr):
        rules = replace(rules, tp_refused=refused.data)
    return rules


# ------------------------------------------------------------- plan -> shardings


def batch_sharding(plan: Plan, rank: int, seq_axes: tuple[str, ...] = ()) -> Sharding:
    """Batch data and activations: dim 0 split over the data-parallel axes, dim 1 (the sequence) over
    ``cp`` (context parallelism, outermost) and ``seq_axes``."""
    splits = {0: plan.axes("dp")} if rank >= 1 else {}
    seq_axes = tuple(plan.axes("cp")) + tuple(seq_axes)
    if rank >= 2 and seq_axes:
        splits[1] = seq_axes
    return Sharding.split(rank, splits)


def activation_sharding(plan: Plan, rank: int) -> Sharding:
    """The hidden state between parts: batch over dp, sequence over tp with sequence parallelism."""
    return batch_sharding(plan, rank, plan.axes("tp") if plan.sp else ())


def param_compute_sharding(plan: Plan, rules: Rules, param: str, rank: int) -> Sharding:
    """How a parameter is used in compute: split on ``tp`` by the rules (replicated otherwise)."""
    if rules.is_expert(param) and (plan.ep > 1 or plan.tp > 1):
        from flint.sharding.moe import expert_compute_sharding

        return expert_compute_sharding(plan, rank, rules.expert_tp_dim(param))
    dim = rules.tp_dim(param) if plan.tp > 1 else None
    if dim is None or dim >= rank:
        return Sharding.replicated(rank)
    return Sharding.split(rank, {dim: plan.axes("tp")})


def param_storage_sharding(plan: Plan, rules: Rules, param: str, rank: int, shape=None) -> Sharding:
    """How a parameter (and its gradient and optimizer state) is stored: compute sharding, then
    dim 0 split over the FSDP axes (ZeRO-3; rows padded to a multiple of the FSDP degree)."""
    s = param_compute_sharding(plan, rules, param, rank)
    if plan.ep > 1 and rules.is_expert(param):
        from flint.sharding.moe import expert_storage_sharding

        return expert_storage_sharding(plan, rank, shape, rules.expert_tp_dim(param))
    fsdp = fsdp_axes(plan)
    if fsdp and rank >= 1:
        s = s.with_dim(0, tuple(fsdp) + s.dims[0])
    return s



def fsdp_axes(plan: Plan) -> tuple[str, ...]:
    """The axes FSDP shards parameters over: ``dp_shard`` and ``cp`` (torchtitan's ``dp_shard_cp``: with
    context parallelism FSDP runs even at ``dp_shard = 1``, and gradients are reduced over ``cp`` too)."""
    return tuple(plan.axes("fsdp")) if plan.dp_shard > 1 or plan.cp > 1 else ()


def zero_storage_sharding(plan: Plan, rules: Rules, param: str, rank: int, role: str, phase: str,
                          shape=None) -> Sharding:
    """How a parameter's state is stored under the plan's ZeRO stage (``zero``, of the FSDP axes):

    - ZeRO-3 (FSDP2 ``fully_shard``): parameters, gradients and optimizer state sharded.
    - ZeRO-2 (FSDP2 ``reshard_after_forward=False``): parameters sharded between steps and gathered once
      in forward, then kept whole through backward (no re-gather); gradients reduce-scattered; optimizer
      state sharded.
    - ZeRO-1 (DDP + ``ZeroRedundancyOptimizer``): parameters and gradients whole (DDP all-reduces
      gradients); optimizer state sharded: each rank steps its shard, then the updated shards are
      gathered back into every rank's parameters.
    """
    sharded = param_storage_sharding(plan, rules, param, rank, shape)
    if plan.zero == 3 or not fsdp_axes(plan) or role in ("master", "exp_avg", "exp_avg_sq") or \
            plan.ep > 1 and rules.is_expert(param):
        return sharded
    full = param_compute_sharding(plan, rules, param, rank)
    if role == "gradient":
        return sharded if plan.zero == 2 else full
    return sharded if plan.zero == 2 and phase != "bwd" else full
