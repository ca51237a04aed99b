"""The parallelism plan: one object shared by capture recipes, `shard-expand`,
`pipeline-split` and `flint explore`.

A plan names degrees over a device mesh with the names torchtitan users know
(``torchtitan.distributed.ParallelDims``)::

    dp_replicate  DDP / HSDP replicate degree
    dp_shard      FSDP degree (-1: whatever the world size leaves), with a ZeRO stage
    cp            context parallel (sequence split across ranks in attention)
    tp            tensor parallel, with or without sequence parallel (``sp``)
    pp            pipeline parallel, with a schedule and microbatches
    ep, etp       expert parallel and expert tensor parallel (MoE)
    capacity_factor  expert-parallel dispatch buffers: rows per expert and source
                  rank = capacity_factor x the balanced share (default 1.0, >= 1)

``dp_replicate * dp_shard * cp * tp * pp`` is the world size. ``ep`` does
not multiply it: as in torchtitan, experts borrow ranks from ``dp_shard *
cp`` (``etp == tp``) or from ``dp_shard * cp * tp`` (``etp == 1``).

The mesh (:meth:`Plan.mesh`) has one axis per degree above 1, laid out by
``order``: the names innermost first (``order[0]`` is the axis whose ranks
are consecutive, so TP stays inside a node by default). With expert
parallelism ``dp_shard`` splits into ``dp_shard_mod_ep`` (outer) and
``dp_shard_in_ep`` (inner) so that the EP group is a set of mesh axes.
:meth:`Plan.axes` gives the axes of each communication role (``fsdp``,
``ep``, ``loss``, ...), so passes never re-derive them.

A plan file is TOML with the fields of :class:`Plan` at the top level or
under ``[plan]``::

    dp_shard = -1
    tp = 8
    sp = true
    pp = 4
    pp_schedule = "interleaved-1f1b"
    pp_virtual_stages = 2
    microbatches = 16
    activation_checkpoint = "selective-op"
    fp8 = "tensorwise"        # or true; torchao's Float8Linear on the linear layers

Float8 (``fp8``, :mod:`flint.capture.float8`): the linear layers' GEMMs run
as torchao's ``Float8Linear`` with one of torchao's recipes (``tensorwise``,
``rowwise``, ``rowwise_with_gw_hp``; ``true`` means ``tensorwise``); modules
whose name contains an entry of ``fp8_filter_fqns`` stay in bf16 (default:
the output head, as torchtitan). A capture option: applied when the program
is captured, before any parallelism.

Pipelines and microbatches: capture takes ONE microbatch (the batch per
data-parallel rank over ``microbatches``) and ``pipeline-split`` runs it
``microbatches`` times in the order of ``torch.distributed.pipelining``'s
schedule for ``pp_schedule`` (:mod:`flint.pipeline`): ``gpipe``, ``1f1b``,
``interleaved-1f1b`` (``pp_virtual_stages`` >= 2, microbatches a multiple
of ``pp``), ``interleaved-zero-bubble`` (the same) and ``zbv-zero-bubble``
(``pp_virtual_stages`` = 2), whose backward is split into input- and
weight-gradient halves. ``pp_layers`` lists blocks per stage (``pp * pp_virtual_stages``
entries), else an even split. ``grad_sync = "step"`` reduces data-parallel
gradients once per step (the last microbatch), ``"microbatch"`` every time.
With ``zero = 2`` (FSDP2 ``reshard_after_forward=False``, torchtitan's default
for every block when pipeline parallelism is on: ``reshard_after_forward = not
pp_enabled``) the gathered parameters also stay unsharded from one microbatch to
the next (torch's pipelining runs non-last backwards with
``set_reshard_after_backward(False)``): they are all-gathered once per step, in
the first microbatch's forward. ``zero = 3`` (the default) reshards every block
after each microbatch's forward; the head (final norm and output) is never
resharded after forward, as torchtitan wraps ``[norm, output]``.

Gradient reduction dtype (``reduce_dtype``, FSDP2's ``MixedPrecisionPolicy.reduce_dtype``):
``"param"`` (default, FSDP2's None) reduces gradients in their own dtype;
``"float32"`` casts them to fp32 for the data-parallel reduce-scatter /
all-reduce and back to the parameters' dtype after, as FSDP2 does (and as
Megatron-LM does for bf16 models: ``accumulate_allreduce_grads_in_fp32``).
``param_dtype`` (``MixedPrecisionPolicy.param_dtype``, needs ``dp_shard``): the
sharded parameters keep the model's dtype (e.g. fp32 master weights, which the
optimizer steps) and are cast to it before their all-gather, so forward and
backward compute in it (Megatron's bf16 model with fp32 main parameters).
``master_dtype`` (``"param"``, the default, or ``"float32"``): without FSDP's mixed
precision, the optimizer keeps master copies of the (bf16 / fp16) parameters in
fp32, steps them with fp32 Adam state and the gradients cast to fp32, and copies
the result back into the parameters: Megatron-LM's mixed-precision optimizer
(``Float16OptimizerWithFloat16Params``), which every Megatron bf16 / fp16 run
uses, and DeepSpeed's bf16 optimizer. Not with ``param_dtype``, whose fp32
sharded parameters already are the master copies.

Gradient-norm clipping (``max_norm``, torchtitan's ``training.max_norm``, Megatron-LM's
``--clip-grad``; 0, the default, clips nothing): after the backward the optimizer's gradients are
scaled by ``min(1, max_norm / (total 2-norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does
(``foreach=False``): one norm kernel per gradient, one all-reduce of the norm per mesh axis the
gradients are sharded over (DTensor's ``full_tensor`` of a partial norm), one over ``pp``
(torchtitan's ``dist_utils.clip_grad_norm_``), and one scaling kernel per gradient. Both
torchtitan and Megatron-LM clip at 1.0 by default; Flint's default stays off, so a plan says it.
Captured into the program (on the planned path: into the single-device program, whose norms ``shard-expand``
keeps local to each rank's shards, adding ``@grad_clip``'s all-reduces).

``optimizer_impl`` (torchtitan's ``optimizer.implementation``): the form of torch's AdamW the step runs.
``for-loop`` (the default; ``foreach=False``, torch's CPU default, the form ``flint validate`` checks):
kernels per parameter. ``foreach`` (torch's default on a GPU): one multi-tensor op over all of a part's
tensors per step of the update, the step counts on the host. ``fused`` (torchtitan's default): one
``_fused_adamw_`` kernel per part. With ``foreach`` or ``fused``, clipping takes torch's GPU default too
(``_foreach_norm``, ``_foreach_mul_``), and master copies are copied back with one ``_foreach_copy_``.
Captured into the program (on the planned path: into the single-device program, whose multi-tensor ops
``shard-expand`` expands index by index).

``pp_p2p`` (:func:`flint.pipeline.schedules.check_p2p`): the stage-boundary
send/recv as the schedule runs them (``schedule``, the default), ``overlap``
(Megatron's ``overlap_p2p_comm``; multi-stage schedules only, where it is what
torch's runtime runs too) or ``blocking`` (each send and recv waited where
torch's order issues it, the recv issued after the compute before it).

Loss parallelism (``loss_parallel``, needs ``tp`` > 1; a capture option for zoo models): the output
projection keeps the logits sharded over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1))``)
and the cross-entropy runs on the shards under ``torch.distributed.tensor.parallel.loss_parallel``:
per-token max and sum-of-exponentials all-reduces instead of an all-gather of the logits and a
replicated loss. torchtitan's default with TP; Megatron-LM's vocab-parallel cross-entropy. Off by
default (the loss is computed on replicated logits).

Validation happens once, in :meth:`Plan.validate` (called by every
constructor here) and :meth:`Plan.check_model` (against a model's shape),
before any work; errors are :class:`PlanError` naming the field and the
constraint. A consumer that does not implement a field calls
:meth:`Plan.require` so that an unsupported setting is refused, never
silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from flint.errors import FlintError
from flint.tomlio import parse_toml
from flint.mesh import Mesh

# Degree fields, in torchtitan's outermost-to-innermost mesh order.
DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEFAULT_ORDER = tuple(reversed(DEGREES))  # innermost first
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble")
AC_MODES = ("none", "selective-op", "selective-layer", "full")
# float8 linear layers: torchao's recipes (Float8LinearConfig.from_recipe_name); plan files may say true / false
FP8_RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
GRAD_SYNC = ("step", "microbatch")
# dtype of the data-parallel gradient reduction (FSDP2's MixedPrecisionPolicy.reduce_dtype): "param" is
# FSDP2's None (the gradients' own dtype), else the gradients are cast to it for the reduce-scatter /
# all-reduce and back to the parameters' dtype after (Megatron-LM reduces bf16 models' gradients in fp32)
REDUCE_DTYPES = ("param", "float32", "bfloat16", "float16")
# dtype of the optimizer's master copies of the parameters ("param": none, the optimizer steps the parameters)
MASTER_DTYPES = ("param", "float32")
# forms of torch's AdamW (torchtitan's optimizer.implementation): per-parameter kernels, multi-tensor, fused
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
# Plan fields the planned path's single-device program is captured with (what its optimizer steps, in which
# form, whether it clips the gradients first, what its backward recomputes): shard-expand expands its ops for
# them and never adds them, so a plan may repeat them or leave them unset, never change them
PROGRAM_FIELDS = ("master_dtype", "optimizer_impl", "max_norm", "activation_checkpoint", "ac_every")
# Where expanded TP reduces partial sums: "dtensor" as PyTorch's DTensor runs it (one backward all-reduce
# per column-parallel linear: five per Llama block; sequence-parallel norm gradients reduced by the
# optimizer, or in backward before data parallelism's own collective), "megatron" as Megatron-LM (one per
# attention and MLP input; norm gradients in backward).
TP_STYLES = ("dtensor", "megatron")
ZERO_STAGES = (1, 2, 3)
# Largest world size a plan may name: beyond what the emitter and simulator can hold.
from flint.limits import MAX_WORLD_SIZE  # noqa: E402  (one limit for plans, grids and traces)


class PlanError(FlintError):
    """A plan field is wrong; the message names the field (and the file) and the constraint."""

    def __init__(self, field_name: str, message: str, source: str | None = None) -> None:
        self.field = field_name
        where = f"{source}: " if source else ""
        super().__init__(f"{where}plan field '{field_name}': {message}")


@dataclass(frozen=True)
class Plan:
    """A parallelism plan over a named mesh (see the module docstring)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    # expert-parallel all_to_all buffers hold capacity_factor x the balanced rows per (expert, source rank)
    # (GShard / Switch capacity; 1.0 = exactly the balanced routing, as torchtitan's dropless EP sends)
    capacity_factor: float = 1.0
    sp: bool = False
    loss_parallel: bool = False  # cross-entropy on vocabulary-sharded logits (torch's loss_parallel; needs tp > 1)
    zero: int = 3  # ZeRO stage of the dp_shard axis: 1 optimizer state, 2 + gradients, 3 + parameters
    order: tuple[str, ...] = DEFAULT_ORDER  # mesh axes, innermost first
    microbatches: int = 1
    grad_sync: str = "step"  # data-parallel gradient collectives once per step or per microbatch
    reduce_dtype: str = "param"  # data-parallel gradient reduction dtype (FSDP2 MixedPrecisionPolicy.reduce_dtype)
    param_dtype: str = "param"  # dtype FSDP gathers and computes parameters in (MixedPrecisionPolicy.param_dtype)
    master_dtype: str = "param"  # fp32 master copies the optimizer steps (Megatron's mixed-precision optimizer)
    max_norm: float = 0.0  # gradient-norm clipping threshold (torch.nn.utils.clip_grad_norm_); 0: no clipping
    optimizer_impl: str = "for-loop"  # torch's AdamW form: for-loop (foreach=False), foreach, fused
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved schedules: > 1)
    pp_layers: tuple[int, ...] | None = None  # explicit layers per stage; None: even split
    pp_p2p: str = "schedule"  # stage-boundary send/recv: as the schedule runs them, "overlap" or "blocking"
    activation_checkpoint: str = "none"
    tp_style: str = "dtensor"  # shard-expand: where TP partial sums are reduced (dtensor: per linear; megatron: fused)
    ac_every: int = 1  # selective-layer: checkpoint every N-th block
    # float8 linear layers (torchao's Float8Linear, flint.capture.float8): "none" or a torchao recipe
    fp8: str = "none"
    fp8_filter_fqns: tuple[str, ...] = ("output", "lm_head")  # modules kept in high precision (the head)
    world_size: int | None = None  # filled in by validate()
    source: str | None = field(default=None, compare=False)  # plan file, for messages

    # ------------------------------------------------------------ construction

    @staticmethod
    def from_dict(data: Mapping[str, Any], *, world_size: int | None = None, source: str | None = None) -> "Plan":
        """A validated plan from a mapping of field names to values (TOML types)."""
        if not isinstance(data, Mapping):
            raise PlanError("plan", f"expected a table of fields, got {type(data).__name__}", source)
        known = {f.name for f in dataclasses.fields(Plan)} - {"source"}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise PlanError(str(key), f"unknown field{hint}; known fields: {', '.join(sorted(known))}", source)
            kwargs[key] = _coerce(key, value, source)
        if world_size is not None:
            if kwargs.get("world_size") not in (None, world_size):
                raise PlanError("world_size", f"the plan says {kwargs['world_size']} but the command asks "
                                f"for {world_size}", source)
            kwargs["world_size"] = world_size
        return Plan(**kwargs, source=source).validate()

    @staticmethod
    def load(path: str | Path, *, world_size: int | None = None) -> "Plan":
        """A validated plan from a TOML file (fields at the top level or under ``[plan]``)."""
        path = Path(path)
        try:
            data = parse_toml(path.read_bytes())
        except FileNotFoundError:
            raise PlanError("plan", "no such file", str(path)) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise PlanError("plan", f"not valid TOML: {e}", str(path)) from None
        except OSError as e:
            raise PlanError("plan", f"cannot read: {e.strerror}", str(path)) from None
        if "plan" in data:
            extra = sorted(set(data) - {"plan"})
            if extra:
                raise PlanError(extra[0], "fields must be either all under [plan] or all at the top level",
                                str(path))
            data = data["plan"]
        return Plan.from_dict(data, world_size=world_size, source=str(path))

    def replace(self, **changes: Any) -> "Plan":
        """A copy with ``changes`` applied, validated again (``world_size`` re-derived unless given)."""
        if "world_size" not in changes and any(k in changes for k in DEGREES):
            changes["world_size"] = None
        return dataclasses.replace(self, **changes).validate()

    # -------------------------------------------------------------- validation

    def validate(self) -> "Plan":
        """Check every field and the constraints between them; fill in ``dp_shard = -1`` and ``world_size``."""
        src = self.source
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "etp", "microbatches", "pp_virtual_stages", "ac_every"):
            value = getattr(self, name)
            if value < 1:
                raise PlanError(name, f"must be at least 1, got {value}", src)
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise PlanError("dp_shard", f"must be -1 (the rest of the world) or at least 1, got {self.dp_shard}", src)
        others = self.dp_replicate * self.cp * self.tp * self.pp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if self.world_size is None:
                raise PlanError("dp_shard", "-1 needs a world size (give world_size in the plan or on the "
                                "command line)", src)
            if self.world_size % others:
                raise PlanError("dp_shard", f"-1: world size {self.world_size} is not divisible by "
                                f"dp_replicate*cp*tp*pp = {others}", src)
            dp_shard = self.world_size // others
        world = others * dp_shard
        if self.world_size is not None:
            if self.world_size < 1:
                raise PlanError("world_size", f"must be at least 1, got {self.world_size}", src)
            if world != self.world_size:
                raise PlanError("world_size", f"dp_replicate({self.dp_replicate}) * dp_shard({dp_shard}) * "
                                f"cp({self.cp}) * tp({self.tp}) * pp({self.pp}) = {world}, not the world "
                                f"size {self.world_size}", src)
        if world > MAX_WORLD_SIZE:
            raise PlanError("world_size", f"{world} ranks is more than Flint can hold ({MAX_WORLD_SIZE})", src)
        if not self.capacity_factor >= 1.0 or self.capacity_factor > 64:
            raise PlanError("capacity_factor", f"must be between 1.0 and 64 (token dropping is not modeled), got "
                            f"{self.capacity_factor}", src)
        if self.capacity_factor != 1.0 and self.ep == 1:
            raise PlanError("capacity_factor", "sizes expert-parallel dispatch buffers: it needs ep > 1", src)
        if self.zero not in ZERO_STAGES:
            raise PlanError("zero", f"must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.zero}", src)
        if self.sp and self.tp == 1:
            raise PlanError("sp", "sequence parallelism needs tp > 1", src)
        if self.loss_parallel and self.tp == 1:
            raise PlanError("loss_parallel", "shards the logits over the tensor-parallel axis: it needs tp > 1", src)
        if self.tp_style not in TP_STYLES:
            raise PlanError("tp_style", f"unknown value '{self.tp_style}'; known: {', '.join(TP_STYLES)}", src)
        if self.grad_sync not in GRAD_SYNC:
            raise PlanError("grad_sync", f"unknown value '{self.grad_sync}'; known: {', '.join(GRAD_SYNC)}", src)
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise PlanError("reduce_dtype", f"unknown dtype '{self.reduce_dtype}'; known: {', '.join(REDUCE_DTYPES)} "
                            "(param: the gradients' own dtype, FSDP2's reduce_dtype=None)", src)
        if self.reduce_dtype != "param" and self.dp_replicate * dp_shard == 1:
            raise PlanError("reduce_dtype", f"'{self.reduce_dtype}' is the dtype of the data-parallel gradient "
                            "reduction; this plan has no data parallelism (dp_replicate = dp_shard = 1)", src)
        if self.param_dtype not in REDUCE_DTYPES:
            raise PlanError("param_dtype", f"unknown dtype '{self.param_dtype}'; known: {', '.join(REDUCE_DTYPES)} "
                            "(param: the parameters' own dtype, FSDP2's param_dtype=None)", src)
        if self.param_dtype != "param" and dp_shard == 1:
            raise PlanError("param_dtype", f"'{self.param_dtype}' is the dtype FSDP all-gathers parameters in "
                            "(MixedPrecisionPolicy.param_dtype); this plan has dp_shard = 1", src)
        if self.master_dtype not in MASTER_DTYPES:
            raise PlanError("master_dtype", f"unknown dtype '{self.master_dtype}'; known: {', '.join(MASTER_DTYPES)} "
                            "(param: the optimizer steps the parameters themselves)", src)
        if not (0.0 <= self.max_norm < math.inf):
            raise PlanError("max_norm", f"must be a finite number >= 0 (0: no clipping), got {self.max_norm}", src)
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise PlanError("optimizer_impl", f"unknown form '{self.optimizer_impl}'; known: "
                            f"{', '.join(OPTIMIZER_IMPLS)} (torchtitan's optimizer.implementation)", src)
        if self.master_dtype != "param" and self.param_dtype != "param":
            raise PlanError("master_dtype", f"FSDP's mixed precision (param_dtype = \"{self.param_dtype}\") keeps "
                            "the sharded parameters in the model's dtype, which the optimizer steps: they already "
                            "are the master copies; give a float32 model with param_dtype, or master_dtype "
                            "without it", src)
        if self.activation_checkpoint not in AC_MODES:
            raise PlanError("activation_checkpoint", f"unknown mode '{self.activation_checkpoint}'; known: "
                            f"{', '.join(AC_MODES)}", src)
        if self.ac_every != 1 and self.activation_checkpoint != "selective-layer":
            raise PlanError("ac_every", "applies only to activation_checkpoint = \"selective-layer\"", src)
        if self.fp8 not in FP8_RECIPES:
            raise PlanError("fp8", f"unknown float8 recipe '{self.fp8}'; known: {', '.join(FP8_RECIPES)} "
                            "(true = tensorwise)", src)
        if tuple(self.fp8_filter_fqns) != Plan.fp8_filter_fqns and self.fp8 == "none":
            raise PlanError("fp8_filter_fqns", "applies only with fp8 set to a recipe", src)
        self._validate_pipeline(src)
        self._validate_experts(dp_shard, src)
        order = tuple(self.order)
        if sorted(order) != sorted(DEGREES):
            unknown = sorted(set(order) - set(DEGREES))
            missing = sorted(set(DEGREES) - set(order))
            what = f"unknown axis name(s) {unknown}" if unknown else f"missing axis name(s) {missing}"
            if len(set(order)) != len(order):
                what = f"repeats an axis in {list(order)}"
            raise PlanError("order", f"{what}; it must list each of {', '.join(DEGREES)} once, innermost first",
                            src)
        pp_layers = tuple(self.pp_layers) if self.pp_layers is not None else None
        out = dataclasses.replace(self, dp_shard=dp_shard, world_size=world, order=order, pp_layers=pp_layers,
                                  fp8_filter_fqns=tuple(self.fp8_filter_fqns))
        return out

    def _validate_pipeline(self, src: str | None) -> None:
        if self.pp_schedule not in PP_SCHEDULES:
            raise PlanError("pp_schedule", f"unknown schedule '{self.pp_schedule}'; known: "
                            f"{', '.join(PP_SCHEDULES)}", src)
        v = self.pp_virtual_stages
        if self.pp_schedule in ("gpipe", "1f1b") and v != 1:
            raise PlanError("pp_virtual_stages", f"schedule '{self.pp_schedule}' runs one stage per rank; "
                            f"got {v} (use interleaved-1f1b for virtual stages)", src)
        if self.pp_schedule == "zbv-zero-bubble" and v != 2:
            raise PlanError("pp_virtual_stages", f"schedule 'zbv-zero-bubble' runs exactly 2 stages per rank, got {v}",
                            src)
        if self.pp > 1 and self.pp_schedule.startswith("interleaved") and self.microbatches % self.pp:
            raise PlanError("microbatches", f"schedule '{self.pp_schedule}' needs a multiple of pp = {self.pp} "
                            f"microbatches, got {self.microbatches}", src)
        if self.pp > 1:  # what torch.distributed.pipelining's schedule classes accept
            from flint.pipeline.schedules import check, check_p2p

            check(self.pp_schedule, self.pp, self.microbatches, v, src, counts=False)
            check_p2p(self.pp_p2p, self.pp_schedule, src)
        if self.pp_layers is not None:
            layers = tuple(self.pp_layers)
            if len(layers) != self.pp * v:
                raise PlanError("pp_layers", f"lists {len(layers)} stages, but pp * pp_virtual_stages = "
                                f"{self.pp * v}", src)
            if any(n < 1 for n in layers):
                raise PlanError("pp_layers", f"every stage needs at least one layer, got {list(layers)}", src)

    def _validate_experts(self, dp_shard: int, src: str | None) -> None:
        if self.ep == 1:
            if self.etp != 1:
                raise PlanError("etp", "expert tensor parallelism needs ep > 1", src)
            return
        if self.etp not in (1, self.tp):
            raise PlanError("etp", f"must be 1 or tp ({self.tp}), got {self.etp}", src)
        borrow = dp_shard * self.cp * (self.tp if self.etp == 1 else 1)
        unit = self.cp * (self.tp if self.etp == 1 else 1)
        what = "dp_shard*cp" + ("*tp" if self.etp == 1 else "")
        if self.ep % unit or borrow % self.ep:
            raise PlanError("ep", f"{self.ep} must be a multiple of {unit} (cp{'*tp' if self.etp == 1 else ''}) "
                            f"that divides {what} = {borrow}", src)

    def check_model(self, *, n_layers: int | None = None, n_heads: int | None = None,
                    n_kv_heads: int | None = None, hidden: int | None = None, ffn_hidden: int | None = None,
                    n_experts: int | None = None, seq_len: int | None = None,
                    local_batch: int | None = None) -> None:
        """Check the plan against a model's and a batch's shape (any argument may be left out).

        ``local_batch`` is the batch per data-parallel rank (the global batch
        over ``dp_replicate * dp_shard``).
        """
        src = self.source
        for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("hidden", hidden),
                            ("ffn_hidden", ffn_hidden)):
            if value is not None and value % self.tp:
                raise PlanError("tp", f"{self.tp} does not divide the model's {name} = {value}", src)
        if n_experts is not None and n_experts % self.ep:
            raise PlanError("ep", f"{self.ep} does not divide the model's {n_experts} experts", src)
        if n_experts is None and self.ep > 1:
            raise PlanError("ep", "expert parallelism needs a mixture-of-experts model (on the planned path: "
                            "stacked expert weights that an [[experts]] sharding rule names)", src)
        if seq_len is not None:
            divisor = (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)
            if seq_len % divisor:
                raise PlanError("cp" if self.cp > 1 else "sp", f"sequence length {seq_len} is not divisible by "
                                f"{divisor} (2*cp for load-balanced causal attention, times tp with sp)", src)
        if n_layers is not None and self.pp > 1:
            stages = self.pp * self.pp_virtual_stages
            if self.pp_layers is not None and sum(self.pp_layers) != n_layers:
                raise PlanError("pp_layers", f"sums to {sum(self.pp_layers)} layers, but the model has {n_layers}",
                                src)
            if stages > n_layers:
                raise PlanError("pp", f"{stages} pipeline stages (pp * pp_virtual_stages) for a model of "
                                f"{n_layers} layers", src)
        if local_batch is not None and local_batch % self.microbatches:
            raise PlanError("microbatches", f"{self.microbatches} does not divide the batch per data-parallel "
                            f"rank ({local_batch})", src)

    def require(self, supported: Iterable[str], consumer: str) -> None:
        """Refuse settings ``consumer`` does not implement: every field off its default must be in ``supported``."""
        allowed = set(supported) | {"world_size", "order", "dp_shard", "source"}
        default = Plan()
        for f in dataclasses.fields(Plan):
            if f.name in allowed:
                continue
            if getattr(self, f.name) != getattr(default, f.name):
                raise PlanError(f.name, f"{consumer} does not support it yet (set to "
                                f"{getattr(self, f.name)!r}; supported fields: {', '.join(sorted(supported))})",
                                self.source)

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from the defaults, plus ``world_size`` (TOML-ready; ``from_dict`` inverts it)."""
        default = Plan()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(Plan):
            if f.name == "source":
                continue
            value = getattr(self, f.name)
            if f.name == "world_size" or value != getattr(default, f.name):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    # ------------------------------------------------------------------- mesh

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREES}

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    def _mesh_axes(self) -> list[tuple[str, int]]:
        """(name, size) of the mesh axes, outermost first."""
        axes: list[tuple[str, int]] = []
        for name in reversed(self.order):
            size = getattr(self, name)
            if name == "dp_shard" and self.ep > 1:
                inner = self.ep // (self.cp * (self.tp if self.etp == 1 else 1))
                if size // inner > 1:
                    axes.append(("dp_shard_mod_ep", size // inner))
                if inner > 1:
                    axes.append(("dp_shard_in_ep", inner))
            elif size > 1:
                axes.append((name, size))
        return axes or [("dp_shard", 1)]

    def mesh(self) -> Mesh:
        """The device mesh: one axis per degree above 1, outermost first (row-major ranks)."""
        axes = self._mesh_axes()
        return Mesh(tuple(s for _, s in axes), tuple(n for n, _ in axes))

    def axes(self, role: str) -> tuple[str, ...]:
        """Mesh axis names a communication role spans, outermost first (empty: no communication).

        Roles: ``dp_replicate``, ``fsdp`` (parameter sharding: dp_shard and
        cp, as torchtitan's ``dp_shard_cp``), ``dp`` (the batch split),
        ``loss`` (dp and cp), ``cp``, ``tp``, ``pp``, ``ep``, and
        ``expert_fsdp`` (what shards an expert's parameters besides EP).
        """
        names = [n for n, _ in self._mesh_axes() if n != "dp_shard" or self.dp_shard > 1]
        shard = {"dp_shard", "dp_shard_mod_ep", "dp_shard_in_ep"}
        pick = {
            "dp_replicate": {"dp_replicate"},
            "fsdp": shard | {"cp"},
            "dp": shard | {"dp_replicate"},
            "loss": shard | {"dp_replicate", "cp"},
            "cp": {"cp"},
            "tp": {"tp"},
            "pp": {"pp"},
            "ep": {"dp_shard_in_ep", "cp"} | ({"tp"} if self.etp == 1 else set()),
            "expert_fsdp": {"dp_shard_mod_ep"},
        }
        if role not in pick:
            raise FlintError(f"unknown plan role '{role}'; known: {', '.join(pick)}")
        if role == "ep" and self.ep == 1:
            return ()
        return tuple(n for n in names if n in pick[role])

    def describe(self) -> str:
        """One line, e.g. ``dp_shard=16 x tp=8 (sp) x pp=4 [1f1b, 8 microbatches] = 512 ranks``."""
        parts = [f"{n}={getattr(self, n)}" for n in DEGREES if getattr(self, n) > 1]
        if self.sp:
            parts = [p + " (sp)" if p.startswith("tp=") else p for p in parts]
        if self.ep > 1:
            parts.append(f"ep={self.ep}" + (f" etp={self.etp}" if self.etp > 1 else "")
                         + (f" capacity {self.capacity_factor:g}" if self.capacity_factor != 1.0 else ""))
        text = " x ".join(parts) or "single rank"
        extra = []
        if self.pp > 1:
            extra.append(self.pp_schedule + (f" v={self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""))
        if self.microbatches > 1:
            extra.append(f"{self.microbatches} microbatches")
        if self.dp_shard > 1 and self.zero != 3:
            extra.append(f"ZeRO-{self.zero}")
        if self.param_dtype != "param":
            extra.append(f"params gathered in {self.param_dtype}")
        if self.reduce_dtype != "param":
            extra.append(f"grads reduced in {self.reduce_dtype}")
        if self.master_dtype != "param":
            extra.append(f"{self.master_dtype} master params")
        if self.loss_parallel:
            extra.append("loss parallel")
        if self.max_norm:
            extra.append(f"grad clip {self.max_norm:g}")
        if self.optimizer_impl != "for-loop":
            extra.append(f"{self.optimizer_impl} AdamW")
        if self.activation_checkpoint != "none":
            extra.append(f"AC {self.activation_checkpoint}")
        if self.fp8 != "none":
            extra.append(f"fp8 {self.fp8}")
        return text + (f" [{', '.join(extra)}]" if extra else "") + f" = {self.world_size} ranks"


_BOOL_FIELDS = {"sp", "loss_parallel"}
_STR_FIELDS = {"grad_sync", "pp_schedule", "activation_checkpoint", "tp_style", "fp8", "reduce_dtype", "param_dtype",
               "master_dtype", "pp_p2p", "optimizer_impl"}
_LIST_FIELDS = {"order": str, "pp_layers": int, "fp8_filter_fqns": str}
_FLOAT_FIELDS = {"capacity_factor", "max_norm"}


def _coerce(key: str, value: Any, source: str | None) -> Any:
    """A TOML value as the field's Python type, or a PlanError naming the field."""
    if key == "fp8" and isinstance(value, bool):  # fp8 = true: torchao's default recipe
        return "tensorwise" if value else "none"
    if key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise PlanError(key, f"must be true or false, got {value!r}", source)
        return value
    if key in _STR_FIELDS:
        if not isinstance(value, str):
            raise PlanError(key, f"must be a string, got {value!r}", source)
        return value
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanError(key, f"must be a number, got {value!r}", source)
        return float(value)
    if key in _LIST_FIELDS:
        item = _LIST_FIELDS[key]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, item) and not isinstance(v, bool)
                                                         for v in value):
            raise PlanError(key, f"must be a list of {item.__name__}s, got {value!r}", source)
        return tuple(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(key, f"must be an integer, got {value!r}", source)
    if abs(value) > MAX_WORLD_SIZE:
        raise PlanError(key, f"{value} is out of range (at most {MAX_WORLD_SIZE})", source)
    return value


# Flint's named recipes (``--plan``) as plans over ``world_size`` ranks.
def from_recipe(name: str, world_size: int, tp: int = 1) -> Plan:
    """The plan a named capture recipe (``dp``, ``fsdp``, ``tp+sp``, ``fsdp+tp``, ...) stands for.

    ``tp`` is the tensor-parallel degree of 2-D recipes; a recipe with TP
    alone spans the whole world.
    """
    parts = name.split("+")
    if set(parts) - {"dp", "fsdp", "tp", "sp"} or len(set(parts)) != len(parts) or {"dp", "fsdp"} <= set(parts) \
            or ("sp" in parts and "tp" not in parts):
        raise PlanError("plan", f"unknown recipe '{name}'")
    if "tp" in parts and ("dp" in parts or "fsdp" in parts):
        if tp < 1 or world_size % tp:
            raise PlanError("tp", f"TP degree {tp} does not divide world size {world_size}")
    else:
        tp = world_size if "tp" in parts else 1
    rest = world_size // tp
    fields = {"tp": tp, "sp": "sp" in parts,
              "dp_replicate": rest if "dp" in parts else 1, "dp_shard": rest if "fsdp" in parts else 1}
    return Plan.from_dict(fields, world_size=world_size)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (for plan searches)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# The plan a module was captured or expanded under, as a module attribute.
PLAN_ATTR = "flint.plan"


def attach(module: Any, plan: Plan) -> None:
    """Record ``plan`` on an IR module (``flint.plan = {dp_shard = 8 : i64, ...}``)."""
    from xdsl.dialects.builtin import ArrayAttr, BoolAttr, DictionaryAttr, FloatAttr, IntegerAttr, StringAttr, f64, i64

    def attr(value: Any):
        if isinstance(value, bool):
            return BoolAttr.from_bool(value)
        if isinstance(value, float):
            return FloatAttr(value, f64)
        if isinstance(value, int):
            return IntegerAttr(value, i64)
        if isinstance(value, str):
            return StringAttr(value)
        return ArrayAttr([attr(v) for v in value])

    module.attributes[PLAN_ATTR] = DictionaryAttr({k: attr(v) for k, v in plan.to_dict().items()})


def plan_of(module: Any) -> Plan | None:
    """The plan recorded on an IR module by :func:`attach`, validated (None if there is none)."""
    from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, FloatAttr, IntegerAttr, StringAttr

    table = module.attributes.get(PLAN_ATTR)
    if table is None:
        return None
    if not isinstance(table, DictionaryAttr):
        raise PlanError("plan", f"module attribute '{PLAN_ATTR}' must be a dictionary")

    def value(a: Any) -> Any:
        if isinstance(a, IntegerAttr):
            v = a.value.data
            return bool(v) if a.type.width.data == 1 else v
        if isinstance(a, StringAttr):
            return a.data
        if isinstance(a, FloatAttr):
            return a.value.data
        if isinstance(a, ArrayAttr):
            return [value(v) for v in a.data]
        raise PlanError("plan", f"module attribute '{PLAN_ATTR}' holds an unsupported value {a}")

    return Plan.from_dict({k: value(v) for k, v in table.data.items()}, source=f"module attribute '{PLAN_ATTR}'")
