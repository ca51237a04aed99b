"""Bring your own model: any ``nn.Module``, its inputs, its repeated blocks, the user's parallelisation.

- :func:`find_layers` finds the layer stack (any ``nn.ModuleList`` /
  ``nn.Sequential``, whatever its attribute name), whose layers the named plans
  wrap one by one, and the run of identical layers in it, which capture runs
  once and repeats (:func:`find_blocks`: a stack of identical blocks only);
- :func:`parse_inputs` / :func:`default_inputs` give the batch as the model's
  ``forward`` takes it (``input_ids=8x2048:int64,labels=8x2048:int64``);
- :func:`intercept` runs a user's ``parallelize(model, mesh)`` as their
  training script would, recording ``fully_shard`` and ``replicate`` calls
  (see its docstring for why and how), while ``parallelize_module`` and
  activation checkpointing run for real;
- :data:`TP_PRESETS` are tensor-parallel plans as data (module-path pattern ->
  ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel``) for
  torchtitan's and Hugging Face's Llama naming and Hugging Face's GPT-2 (Conv1D), and :func:`preset_parallelize`
  writes Flint's named plans as such a function.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import inspect
import logging
import os
import re
import sys
import sysconfig
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from flint.capture.errors import CaptureError

# ------------------------------------------------------------------ user files


_STDLIB = sysconfig.get_paths()["stdlib"] + "/"  # contextlib's frames are not the user's


def _user_frame(tb, path: str) -> str | None:
    """'file:line in fn' of the innermost frame of ``tb`` inside ``path`` (or any non-library frame)."""
    frames = traceback.extract_tb(tb)
    real = os.path.realpath(path) if path else None
    mine = [f for f in frames if real and os.path.realpath(f.filename) == real]
    if not mine:
        mine = [f for f in frames if "/site-packages/" not in f.filename and "/flint/" not in f.filename]
    if not mine:  # a library's model (transformers' modeling file): its frame, not torch's or Flint's
        mine = [f for f in frames if "/torch/" not in f.filename and "/flint/" not in f.filename
                and not f.filename.startswith(_STDLIB)]
    if not mine:
        return None
    f = mine[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def load_user_module(path: str, field_name: str):
    """Import ``path`` as a registered module (``sys.modules``), so its globals resolve under torch.compile."""
    if not os.path.isfile(path):
        raise CaptureError(field_name, f"no such file {path}")
    real = os.path.realpath(path)
    name = "flint_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(real))[0]) + \
        f"_{abs(hash(real)) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, real)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, os.path.dirname(real))
    # notices libraries print on import (torchao's optional CUDA kernels failing to load on a CPU machine,
    # torch's pytree deprecations of torchao's enums): not the user's to act on; errors still show
    quiet = [logging.getLogger(n) for n in _IMPORT_NOISE]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        del sys.modules[name]
        raise CaptureError(field_name, f"{path} called sys.exit({e.code!r}) while being imported; a model file "
                           "must only define functions (guard scripts with if __name__ == '__main__')") from None
    except Exception as e:  # noqa: BLE001 - reported with the user's line
        del sys.modules[name]
        raise CaptureError(field_name, f"{path} failed to import: {type(e).__name__}: {e}",
                           _user_frame(e.__traceback__, real)) from None
    finally:
        sys.path.remove(os.path.dirname(real))
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return module


_IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def user_function(spec: str, field_name: str, default: str, what: str) -> tuple[Callable, str]:
    """``path/to/file.py[:fn]`` -> (the function, its file)."""
    path, _, fn_name = spec.partition(":")
    fn_name = fn_name or default
    module = load_user_module(path, field_name)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise CaptureError(field_name, f"{path} defines no function '{fn_name}' ({what}); "
                           f"functions it defines: {', '.join(names) or 'none'}")
    return fn, os.path.realpath(path)


def call_user(fn: Callable, args: Sequence[Any], field_name: str, what: str) -> Any:
    """Call a user function; an exception becomes a CaptureError at the user's line."""
    try:
        return fn(*args)
    except CaptureError:
        raise
    except SystemExit as e:
        raise CaptureError(field_name, f"{what} '{getattr(fn, '__name__', fn)}' called sys.exit({e.code!r}) "
                           "instead of returning") from None
    except Exception as e:  # noqa: BLE001
        file = inspect.getsourcefile(fn) or ""
        raise CaptureError(field_name, f"{what} '{getattr(fn, '__name__', fn)}' raised {type(e).__name__}: {e}",
                           _user_frame(e.__traceback__, file)) from None


def is_model_file(spec: str) -> bool:
    """Whether a model spec names a file (``path/to/file.py[:function]``) rather than a zoo preset."""
    return spec.endswith(".py") or ".py:" in spec


def model_factory(spec: str, layers: int | None = None, field_name: str = "--model",
                  layers_field: str = "--layers") -> tuple[Callable, Any, Any]:
    """A zoo preset name, or ``path/to/file.py[:function]`` defining a zero-argument model factory.

    Returns (factory, zoo config or None, the user's module or None). The file is imported as a
    registered module (``sys.modules``), so its globals resolve under torch.compile. ``layers``
    (the zoo's depth override) is refused for a file, naming ``layers_field``.
    """
    from flint.errors import FlintError

    if layers is not None and layers < 1:
        raise FlintError(f"{layers_field} must be at least 1, got {layers}")
    if is_model_file(spec):
        fn, _ = user_function(spec, field_name, "model_factory", "a zero-argument model factory")
        if layers is not None:
            raise FlintError(f"{layers_field} applies to zoo models only; set the depth in your factory")
        return fn, None, load_user_module(spec.partition(":")[0], field_name)
    from flint.models import config, factory

    overrides = {"n_layers": layers} if layers is not None else {}
    cfg = config(spec, **overrides)
    return factory(spec, **overrides), cfg, None


def file_inputs(user_module, field_name: str) -> dict[str, "InputSpec"] | None:
    """The batch a model file's ``example_inputs()`` gives (name -> shape, ``'DIMxDIM:dtype'``, tensor or
    :class:`InputSpec`; GLOBAL shapes), or None when the file defines none (a causal LM's defaults)."""
    from flint.errors import FlintError

    fn = getattr(user_module, "example_inputs", None) if user_module is not None else None
    if not callable(fn):
        return None
    value = call_user(fn, (), "example_inputs", "the model file's example_inputs")
    if not isinstance(value, dict) or not value:
        raise FlintError(f"{field_name}: example_inputs() must return a dict name -> shape, 'DIMxDIM:dtype' or "
                         f"tensor, got {type(value).__name__}")
    out = {}
    for name, v in value.items():
        if isinstance(v, torch.Tensor):
            out[name] = InputSpec(tuple(v.shape), v.dtype)
        elif isinstance(v, str):
            out[name] = parse_inputs(f"{name}={v}")[name]
        elif isinstance(v, InputSpec):
            out[name] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(d, int) for d in v):
            out[name] = InputSpec(tuple(v))
        else:
            raise FlintError(f"{field_name}: example_inputs()['{name}'] is {v!r}: expected a shape, 'DIMxDIM:dtype' "
                             "or a tensor")
    return out


def where_defined(obj: Any) -> str | None:
    try:
        fn = obj if inspect.isfunction(obj) else type(obj)
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return None


# ------------------------------------------------------------------ blocks


def _signature(module: nn.Module) -> tuple:
    """A layer's structure: its type, its parameters' names, shapes, dtypes and whether they are trainable (a
    frozen layer is not repeated as a trainable one), and its submodules' types."""
    return (type(module), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()),
            tuple(type(m).__name__ for _, m in module.named_modules()))


def _alike(children: Sequence[nn.Module]) -> bool:
    """Structurally identical modules with parameters."""
    sig = _signature(children[0])
    return bool(sig[1]) and all(_signature(c) == sig for c in children[1:])


def _largest_stack(model: nn.Module, at_least: int,
                   accept: Callable[[list[nn.Module]], bool]) -> tuple[str, nn.Module] | None:
    """The largest (by parameters, then the shallowest) ``ModuleList`` / ``Sequential`` / ``ModuleDict`` of
    >= ``at_least`` modules whose children ``accept`` takes: ``(path, container)`` or None."""
    best: tuple[int, int, str, nn.Module] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or len(mod) < at_least:
            continue
        if not accept(list(mod.children())):
            continue
        key = (sum(p.numel() for p in mod.parameters()), -path.count("."), path, mod)
        if best is None or key[:2] > best[:2]:
            best = key
    return (best[2], best[3]) if best else None


def find_blocks(model: nn.Module, at_least: int = 2) -> tuple[str, nn.Module] | None:
    """The largest ``ModuleList`` / ``Sequential`` / ``ModuleDict`` of >= ``at_least`` structurally identical modules with parameters.

    Structure: same class, same parameter names, shapes and dtypes, same
    submodule classes. Returns ``(path, container)`` or None (capture whole).
    """
    return _largest_stack(model, at_least, _alike)


@dataclass(frozen=True)
class LayerStack:
    """A model's layers (``path``: its container) and the run ``keys`` of layers in it that capture runs once
    per ``period`` and repeats: ``period`` consecutive layers (one; four for Llama 4) whose pattern repeats over
    the run (empty: nothing repeats, the model is captured whole)."""

    path: str
    container: nn.Module
    keys: tuple[str, ...]
    period: int = 1


def find_layers(model: nn.Module) -> LayerStack | None:
    """The model's layer stack: what a training script wraps layer by layer (torchtitan's ``fully_shard`` and
    ``checkpoint_wrapper`` over ``model.layers``), and the run of layers in it that capture repeats.

    The stack is the largest (by parameters) ``ModuleList`` / ``Sequential`` / ``ModuleDict`` of >= 2
    structurally identical modules with parameters (:func:`find_blocks`'s candidates) or of >= 2 composite
    modules of one class, each with parameters: such layers need not be alike (DeepSeek-V3's dense first layers
    before its MoE ones, Llama 4's interleaved MoE layers), while leaf modules of one class (a ``Sequential`` of
    ``nn.Linear``s of different sizes) are not layers. Where every layer is alike, it is :func:`find_blocks`'s
    stack. The repeated run is the longest run of a repeating pattern of ``period`` consecutive layers (one:
    identical neighbours; four: Llama 4's dense and MoE layers alternating, every fourth without rotary
    embedding), at least two repeats of it, the shortest period and then the first run on a tie; without one,
    nothing repeats. A run with trainable parameters goes before a longer one of frozen layers."""
    def layers(children: list[nn.Module]) -> bool:
        return _alike(children) or (len({type(c) for c in children}) == 1 and all(
            any(True for _ in c.children()) and any(True for _ in c.parameters()) for c in children))

    found = _largest_stack(model, 2, layers)
    if found is None:
        return None
    path, container = found
    keys, sigs = list(container._modules), [_signature(c) for c in container._modules.values()]
    trainable = [any(p[3] for p in sig[1]) for sig in sigs]
    best_run, best = (0, 0, 1), (False, 0, 0, 0)  # (start, repeats, period), its rank
    for period in range(1, len(sigs) // 2 + 1):
        for start in range(period):  # runs aligned to this offset
            i = start
            while i + period <= len(sigs):
                j = i + period  # extend while the next window repeats the one at i
                while j + period <= len(sigs) and sigs[j:j + period] == sigs[i:i + period]:
                    j += period
                reps = (j - i) // period
                # frozen layers (partial fine-tuning freezes the bottom ones) run forward only where nothing
                # trainable feeds them: a run with trainable parameters first
                rank = (any(trainable[i:i + period]), reps * period, -period, -i)
                if reps >= 2 and rank > best:
                    best_run, best = (i, reps, period), rank
                i = j if reps >= 2 else i + period
    start, reps, period = best_run
    if reps < 2:
        return LayerStack(path, container, ())
    return LayerStack(path, container, tuple(keys[start:start + reps * period]), period)


# ------------------------------------------------------------------ inputs


_DTYPE_NAMES = {"int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
                "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "bool": torch.bool}


@dataclass(frozen=True)
class InputSpec:
    """One model input: global shape (dim 0 is the batch) and dtype (None: the model's dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


def parse_inputs(text: str) -> dict[str, InputSpec]:
    """``'input_ids=8x2048:int64,labels=8x2048:int64'`` -> {name: InputSpec}."""
    out: dict[str, InputSpec] = {}
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        name, eq, rest = item.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise CaptureError("--inputs", f"'{item}': expected name=DIMxDIM[:dtype], e.g. input_ids=8x2048:int64")
        dims, _, dt = rest.partition(":")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise CaptureError("--inputs", f"'{item}': shape '{dims}' is not DIMxDIM... of integers") from None
        if not shape or any(d < 1 for d in shape):
            raise CaptureError("--inputs", f"'{item}': every dimension must be at least 1")
        if dt and dt not in _DTYPE_NAMES:
            raise CaptureError("--inputs", f"'{item}': unknown dtype '{dt}'; known: {', '.join(_DTYPE_NAMES)}")
        if name in out:
            raise CaptureError("--inputs", f"'{name}' given twice")
        out[name] = InputSpec(shape, _DTYPE_NAMES[dt] if dt else None)
    if not out:
        raise CaptureError("--inputs", "no inputs given")
    return out


_INT_NAMES = re.compile(r"(^|_)(ids|labels|tokens|targets|target|label|idx|positions)$")


def input_dtype(name: str, spec: InputSpec, model_dtype: torch.dtype) -> torch.dtype:
    if spec.dtype is not None:
        return spec.dtype
    return torch.int64 if _INT_NAMES.search(name) else model_dtype


def forward_parameters(model: nn.Module) -> tuple[list[str], bool]:
    """Names ``model.forward`` takes (without self), and whether it takes ``**kwargs``."""
    sig = inspect.signature(model.forward)
    names, var_kw = [], False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind is not p.VAR_POSITIONAL:
            names.append(p.name)
    return names, var_kw


def is_causal_lm(model: nn.Module) -> bool:
    names, _ = forward_parameters(model)
    return "input_ids" in names and "labels" in names


def default_inputs(model: nn.Module, batch: int, seq: int) -> dict[str, InputSpec]:
    """Causal LMs (``forward(input_ids, ..., labels)``): int64 ids and labels, the model's own loss."""
    if is_causal_lm(model):
        return {"input_ids": InputSpec((batch, seq), torch.int64), "labels": InputSpec((batch, seq), torch.int64)}
    names, _ = forward_parameters(model)
    raise CaptureError("inputs", f"cannot guess the inputs of {type(model).__name__}.forward({', '.join(names)}); "
                       "give them with --inputs 'name=DIMxDIM:dtype,...' or an example_inputs() function "
                       "in the model file", where_defined(model))


def check_inputs(model: nn.Module, names: Sequence[str], loss_targets: Sequence[str] = ()) -> None:
    """Every input must be a parameter of ``forward`` (or a loss target); every required one given."""
    params, var_kw = forward_parameters(model)
    sig = inspect.signature(model.forward)
    extra = [n for n in names if n not in params and n not in loss_targets]
    if extra and not var_kw:
        raise CaptureError("inputs", f"{type(model).__name__}.forward takes ({', '.join(params)}), "
                           f"not {', '.join(repr(e) for e in extra)}", where_defined(model))
    if extra and params and not any(n in params for n in names):
        # e.g. a file's example_inputs() written for another model of the same file
        raise CaptureError("inputs", f"none of the inputs ({', '.join(repr(e) for e in extra)}) is a parameter of "
                           f"{type(model).__name__}.forward({', '.join(params)}), which would take them all as "
                           "**kwargs; give the model's own with --inputs 'name=DIMxDIM:dtype,...' (an "
                           "example_inputs() in the model file applies to every model of that file)",
                           where_defined(model))
    missing = [p.name for p in sig.parameters.values() if p.default is p.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names]
    if missing:
        raise CaptureError("inputs", f"{type(model).__name__}.forward({', '.join(params)}) needs "
                           f"{', '.join(repr(m) for m in missing)}, which the inputs do not give",
                           where_defined(model))


LOSSES = ("auto", "cross_entropy", "mse", "sum")


@contextmanager
def eager_mask_decisions(input_names: Sequence[str]) -> Iterator[None]:
    """Hugging Face's attention masks decided as an eager run decides them, for inputs without ``position_ids``.

    With no ``attention_mask``, Hugging Face's mask creation (``transformers.masking_utils``) asks
    ``find_packed_sequence_indices(position_ids)`` whether the batch packs several sequences per row; "no" lets
    SDPA run ``is_causal`` without a mask (and ``enable_gqa`` instead of repeating K/V heads). The answer reads
    the values, which a traced run cannot, so under ``torch.compile`` it is always "maybe" and an explicit
    ``[B, 1, S, S]`` mask is built. Where the model builds ``position_ids`` itself (``arange``, no such input),
    eager's answer is known: no packing. Flint's capture gives that answer, so the step is the one an eager run
    (and PyTorch's ``context_parallel``, which takes no mask) executes. A ``position_ids`` input keeps the traced
    behaviour: its values are unknown. No-op when transformers is not loaded or has no such function.
    """
    mu = sys.modules.get("transformers.masking_utils")
    find = getattr(mu, "find_packed_sequence_indices", None)
    if find is None or "position_ids" in input_names:
        yield
        return
    mu.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = find


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    """``find_packed_sequence_indices`` for ``position_ids`` the model built as ``arange``: one sequence a row."""
    return None


def loss_of(out: Any, targets: Mapping[str, torch.Tensor], loss: str) -> torch.Tensor:
    """The scalar to differentiate: the model's own loss, or ``loss`` of its logits / output."""
    own = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else None
    if isinstance(out, dict) and "loss" in out:
        own = out["loss"]
    if loss == "auto" and own is not None:
        return own
    if isinstance(out, torch.Tensor):
        value = out
    elif isinstance(out, dict) or hasattr(out, "logits"):
        value = out["logits"] if isinstance(out, dict) else out.logits
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        value = out[0]
    else:
        raise CaptureError("loss", f"the model returned {type(out).__name__}: expected a loss tensor, a tensor "
                           "of logits or an output with .loss / .logits")
    if loss == "auto":
        if value.ndim == 0:
            return value
        loss = "cross_entropy" if targets and next(iter(targets.values())).dtype == torch.int64 else \
            "mse" if targets else "sum"
    if loss == "sum":
        return value.float().sum()
    if not targets:
        raise CaptureError("loss", f"loss '{loss}' needs a target input the model does not take "
                           "(e.g. --inputs '...,target=8:int64')")
    target = next(iter(targets.values()))
    if loss == "cross_entropy":
        return nn.functional.cross_entropy(value.float().flatten(0, -2), target.flatten())
    return nn.functional.mse_loss(value.float(), target.float())


# ------------------------------------------------------------------ parallelisation


@dataclass
class GroupCall:
    """One recorded ``fully_shard`` / ``replicate`` call: what FSDP2 would make a parameter group."""

    modules: list[nn.Module]
    mesh: Any
    mode: str  # "fsdp" or "dp"
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    source: str | None = None
    reduce_dtype: torch.dtype | None = None  # mp_policy.reduce_dtype (None: the gradients' own dtype)


@dataclass
class Recorded:
    groups: list[GroupCall] = field(default_factory=list)


def _caller() -> str | None:
    for f in reversed(traceback.extract_stack()[:-2]):
        if "/flint/" not in f.filename and "/torch/" not in f.filename:
            return f"{f.filename}:{f.lineno}"
    return None


@contextmanager
def intercept(user_globals: dict | None = None) -> Iterator[Recorded]:
    """Record ``fully_shard`` and ``replicate`` calls made inside the block.

    Real FSDP2 (``fully_shard``) cannot be captured by ``torch.compile`` with
    fullgraph on fake tensors: its parameter management lives in forward
    hooks and autograd hooks on a Python state machine that dynamo skips
    (``torch._dynamo.config.skip_fsdp_hooks``), so a captured graph would
    show no collectives. Flint intercepts the calls instead and applies what
    they mean, with PyTorch's own APIs, SimpleFSDP-style
    (:class:`flint.capture.recipes.ParamGroup`): every call is one parameter
    group of the modules' parameters not already in a group (as FSDP2 does:
    a later call on an ancestor takes what is left); its parameters become
    dim-0 shards over the call's mesh, all-gathered in one flat
    ``all_gather_tensor_autograd`` before the group's forward (the backward
    of which is the gradient ``reduce_scatter``), gathered again in backward
    when ``reshard_after_forward`` (selective-checkpoint ``MUST_RECOMPUTE``),
    in ``mp_policy.param_dtype`` when given, the gradients reduce-scattered (and, for
    HSDP, all-reduced) in ``mp_policy.reduce_dtype`` when given (cast back to the
    sharded parameters' dtype after, as FSDP2's ``foreach_reduce``). A 2-D mesh is HSDP (replicate x
    shard). ``replicate`` is one gradient all-reduce (avg) per group. A list
    of modules (``fully_shard([norm, output])``) becomes one group per module
    (the same bytes, one collective per module instead of one for the list).
    Offloading and prefetch settings are not modelled.
    """
    import torch.distributed.fsdp as fsdp_mod

    rec = Recorded()

    def fully_shard(module, *, mesh=None, reshard_after_forward=True, shard_placement_fn=None,
                    mp_policy=None, offload_policy=None, ignored_params=None):
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        if mesh is None:
            raise CaptureError("parallelize", "fully_shard without mesh=: pass the data-parallel DeviceMesh",
                               _caller())
        param_dtype = getattr(mp_policy, "param_dtype", None)
        ras = reshard_after_forward if isinstance(reshard_after_forward, bool) else True
        rec.groups.append(GroupCall(modules, mesh, "fsdp", ras, param_dtype, _caller(),
                                    getattr(mp_policy, "reduce_dtype", None)))
        return module

    def replicate(module, *args, device_mesh=None, mesh=None, **kwargs):
        mesh = mesh if mesh is not None else device_mesh
        if mesh is None:
            raise CaptureError("parallelize", "replicate without a mesh: pass device_mesh= / mesh=", _caller())
        modules = list(module) if isinstance(module, (list, tuple)) else [module]
        rec.groups.append(GroupCall(modules, mesh, "dp", True, None, _caller()))
        return module

    targets: list[tuple[Any, str, Any]] = []
    mods = [fsdp_mod]
    for name in ("torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard",
                 "torch.distributed._composable.replicate", "torch.distributed._composable.replicate_with_fsdp",
                 "torch.distributed._composable"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    originals = {}
    for m in mods:
        for attr, repl in (("fully_shard", fully_shard), ("replicate", replicate)):
            orig = getattr(m, attr, None)
            if orig is not None and not inspect.ismodule(orig):
                originals[id(orig)] = repl
                targets.append((m.__dict__, attr, orig))
    if user_globals is not None:
        for k, v in list(user_globals.items()):
            if id(v) in originals:
                targets.append((user_globals, k, v))
    seen = set()
    for ns, attr, orig in targets:
        if (id(ns), attr) in seen:
            continue
        seen.add((id(ns), attr))
        ns[attr] = originals[id(orig)]
    try:
        yield rec
    finally:
        for ns, attr, orig in targets:
            ns[attr] = orig


# ------------------------------------------------------------------ TP plans as data


# (module-path pattern relative to the model root, style); styles: colwise, rowwise (nn.Linear),
# conv1d_colwise, conv1d_rowwise (Hugging Face's Conv1D, whose weight is nn.Linear's transposed),
# sp_norm (SequenceParallel), prepare (block input from Shard(1) to Replicate). "divide": module
# attributes of a block holding a width that TP shards (divided by the TP degree); "sp": False
# when the model cannot run sequence parallel with this plan.
TP_PRESETS: dict[str, dict[str, Any]] = {
    "torchtitan": {
        "blocks": "layers",
        "embed": "tok_embeddings", "norm": "norm", "head": "output",
        "block": {"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                  "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
                  "feed_forward.w2": "rowwise", "attention_norm": "sp_norm", "ffn_norm": "sp_norm",
                  "attention": "prepare", "feed_forward": "prepare"},
        "heads": ("n_heads", "n_kv_heads"),
    },
    "hf-llama": {
        "blocks": "model.layers",
        "embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head",
        "block": {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                  "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                  "mlp.down_proj": "rowwise", "input_layernorm": "sp_norm", "post_attention_layernorm": "sp_norm",
                  "self_attn": "prepare", "mlp": "prepare"},
        "heads": ("num_attention_heads", "num_key_value_heads"),
        # sequence parallel: Hugging Face computes the positions and the causal mask from the embedding
        # output's sequence length, so the residual stream stays a DTensor (global shape, Shard(1)); the
        # decoder layer calls self_attn with keywords only
        "sp_dtensor_stream": True, "kwarg_inputs": {"self_attn": "hidden_states"},
    },
    # GPT-2's fused c_attn (x @ [Wq Wk Wv]) is column-sharded as one Conv1D: each rank holds n/tp of
    # its 3n columns and reads them as its own [q | k | v] slices (split_size divided), Megatron's
    # layout of a fused QKV (a pretrained checkpoint is permuted on load, as Megatron's GPT-2
    # converter does). Sequence parallel: a DTensor stream as hf-llama's; the learned position
    # embedding (whole on every rank) is redistributed to the sequence shard before it is added.
    "hf-gpt2": {
        "blocks": "transformer.h",
        "embed": "transformer.wte", "norm": "transformer.ln_f", "head": "lm_head",
        "positions": "transformer.wpe",
        "block": {"attn.c_attn": "conv1d_colwise", "attn.c_proj": "conv1d_rowwise",
                  "mlp.c_fc": "conv1d_colwise", "mlp.c_proj": "conv1d_rowwise", "ln_1": "sp_norm",
                  "ln_2": "sp_norm", "attn": "prepare", "mlp": "prepare"},
        "divide": ("attn.split_size",),
        # each rank reads its columns as [q | k | v] of equal widths: multi-head attention only (not
        # GPTBigCode's multi-query c_attn, whose k and v are one head wide)
        "fused_qkv": "attn.c_attn",
        "heads": ("num_attention_heads",),
        "sp_dtensor_stream": True,
    },
}


def _conv1d_styles():
    """ColwiseParallel / RowwiseParallel for Hugging Face's ``Conv1D`` (``y = x @ W + b``, ``W`` of shape
    (in, out)): colwise shards ``W`` on dim 1 and the bias on dim 0, rowwise shards ``W`` on dim 0 and
    replicates the bias; inputs and outputs are prepared by torch's own styles."""
    from functools import partial

    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def shard(style, module: nn.Module, mesh, placements: dict[str, Any]) -> None:
        for pname, placement in placements.items():
            param = getattr(module, pname)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, mesh, [placement], src_data_rank=style.src_data_rank),
                requires_grad=param.requires_grad))

    class Conv1DColwiseParallel(ColwiseParallel):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(
                module, device_mesh,
                lambda _, m, mesh: shard(self, m, mesh, {"weight": Shard(1), "bias": Shard(0)}),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class Conv1DRowwiseParallel(RowwiseParallel):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module, device_mesh,
                lambda _, m, mesh: shard(self, m, mesh, {"weight": Shard(0), "bias": Replicate()}),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return Conv1DColwiseParallel, Conv1DRowwiseParallel


def _preset_mismatch(preset: str, modules: Mapping[str, nn.Module]) -> str | None:
    """Why ``preset`` does not fit a model whose block pattern names it has (``modules``: its named modules):
    a layer of another type than the style shards (``nn.Linear`` for colwise / rowwise, Hugging Face's
    ``Conv1D`` for conv1d_*), or a fused QKV projection whose q, k and v are not of one width. None if it fits."""
    table = TP_PRESETS[preset]
    first = f"{table['blocks']}.0"
    for sub, style in table["block"].items():
        module = modules[f"{first}.{sub}"] if style != "prepare" else None
        if style in ("colwise", "rowwise") and not isinstance(module, nn.Linear):
            return f"{first}.{sub} is a {type(module).__name__}, where the preset shards an nn.Linear"
        if style.startswith("conv1d_") and type(module).__name__ != "Conv1D":
            return (f"{first}.{sub} is a {type(module).__name__}, where the preset shards Hugging Face's Conv1D "
                    "(weight (in, out))")
    if "fused_qkv" in table:
        weight = modules[f"{first}.{table['fused_qkv']}"].weight
        width, out = weight.shape  # Conv1D: (in, out)
        if out != 3 * width:
            return (f"{first}.{table['fused_qkv']} projects {width} to {out} features, not to equal q, k and v "
                    f"of {width} (3 x {width} = {3 * width}; multi-query or grouped-query attention), which the "
                    "preset splits per rank")
    return None


def _named_presets(model: nn.Module) -> dict[str, str | None]:
    """The presets whose block pattern names exist in ``model``, each with why it does not fit (None: it fits)."""
    modules = dict(model.named_modules())
    return {preset: _preset_mismatch(preset, modules) for preset, table in TP_PRESETS.items()
            if all(f"{table['blocks']}.0.{sub}" in modules for sub, style in table["block"].items()
                   if style != "prepare")}


def detect_tp_preset(model: nn.Module) -> str | None:
    """The preset whose block pattern names exist in ``model`` and whose styles fit its layers (or None)."""
    return next((preset for preset, why in _named_presets(model).items() if why is None), None)


def tp_plan(preset: str, sp: bool, model: nn.Module) -> dict[str, Any]:
    """The ``parallelize_module`` plan (module-path patterns -> ParallelStyle) of ``preset``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    table = TP_PRESETS[preset]
    Conv1DColwiseParallel, Conv1DRowwiseParallel = _conv1d_styles()
    out_layout = Shard(1) if sp else Replicate()
    local = not (sp and table.get("sp_dtensor_stream", False))  # use_local_output of the stream's producers
    plan: dict[str, Any] = {table["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=out_layout,
                                                            use_local_output=local),
                            table["head"]: ColwiseParallel(input_layouts=out_layout, output_layouts=Replicate())}
    if sp:
        plan[table["norm"]] = SequenceParallel()
    if sp and "positions" in table:  # a learned position table: its rows for this rank's sequence shard
        plan[table["positions"]] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                       use_local_output=False)
    names = {n for n, _ in model.named_modules()}
    for sub, style in table["block"].items():
        if f"{table['blocks']}.0.{sub}" not in names and style != "prepare":
            continue
        key = f"{table['blocks']}.*.{sub}"
        if style == "colwise":
            plan[key] = ColwiseParallel()
        elif style == "rowwise":
            plan[key] = RowwiseParallel(output_layouts=out_layout, use_local_output=local)
        elif style == "conv1d_colwise":
            plan[key] = Conv1DColwiseParallel()
        elif style == "conv1d_rowwise":
            plan[key] = Conv1DRowwiseParallel(output_layouts=out_layout, use_local_output=local)
        elif sp and style == "sp_norm":
            plan[key] = SequenceParallel()
        elif sp and style == "prepare" and sub in table.get("kwarg_inputs", {}):
            kw = table["kwarg_inputs"][sub]
            plan[key] = PrepareModuleInput(input_kwarg_layouts={kw: Shard(1)},
                                           desired_input_kwarg_layouts={kw: Replicate()})
        elif sp and style == "prepare":
            plan[key] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


# Hugging Face's own tensor-parallel styles (transformers.distributed.tensor_parallel) that are DTensor
# layouts around a module's forward: torch.compile captures their collectives as it does torch's styles.
HF_TP_STYLES = frozenset({"colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input",
                          "rowwise_rep", "embedding_rowwise", "embedding_colwise", "all_reduce", "replicate"})
# A replicated weight whose gradient Hugging Face all-reduces over tp in a post-accumulate-grad hook (a norm
# between a colwise and a rowwise layer, over this rank's heads: Qwen3's q_norm / k_norm). No compiled graph
# holds such a hook; Flint applies its DTensor equivalent (hf_grad_allreduce).
HF_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def hf_tp_plan(model: nn.Module, tp: int, quiet: bool = False) -> dict[str, str] | None:
    """Hugging Face's resolved tensor-parallel plan of ``model`` (module and parameter names -> style names):
    what ``from_pretrained(tp_plan="auto")`` applies, from the model's ``base_model_tp_plan`` and its head's
    ``_tp_plan``. None for a model that is not a Hugging Face model or declares no plan. ``quiet``: without
    Hugging Face's warning about rules that match nothing (a probe of a capture without TP, where it applies
    nothing)."""
    if not getattr(model, "supports_tp_plan", False) or not hasattr(model, "_resolve_parallel_plans"):
        return None
    import logging

    from transformers import DistributedConfig

    log = logging.getLogger("transformers.distributed.mixin")
    level = log.level
    if quiet:
        log.setLevel(logging.ERROR)
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))
    except ValueError as e:  # Hugging Face's own check of the plan against the model's module names
        raise CaptureError("plan", f"Hugging Face's tensor-parallel plan of {type(model).__name__}: {e}",
                           where_defined(model)) from None
    finally:
        log.setLevel(level)
    return plan or None


def hf_grad_allreduce(model: nn.Module, tp_mesh, hf_plan: Mapping[str, str]) -> None:
    """Hugging Face's ``replicated_with_grad_allreduce`` modules as DTensor states it: the weights
    ``Replicate`` and the input declared sharded on its second-to-last dim (the heads the norm sees:
    ``SequenceParallel(sequence_dim=-2)``, local output), so the weight's gradient is ``Partial`` and
    all-reduced over tp before the optimizer, where Hugging Face's hook all-reduces it after accumulation."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    modules = {n for n, _ in model.named_modules()}
    names = [n for n, style in hf_plan.items() if style == HF_GRAD_ALLREDUCE and n in modules]
    if names:
        parallelize_module(model, tp_mesh, {n: SequenceParallel(sequence_dim=-2, use_local_output=True)
                                            for n in names})


def _layer_pattern(name: str) -> str:
    """A resolved plan entry's name with its layer indices as ``*`` (``model.layers.*.mlp.c_fc.weight``)."""
    return re.sub(r"\.\d+(?=\.)", ".*", name)


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """A Hugging Face model's input embedding (``get_input_embeddings``), or None: a model without one (any
    ``nn.Module``; transformers' vision models, whose ``get_input_embeddings`` raises NotImplementedError)."""
    return _hf_module(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """A Hugging Face model's output projection (``get_output_embeddings``), or None (as :func:`input_embeddings`)."""
    return _hf_module(model, "get_output_embeddings")


def _hf_module(model: nn.Module, getter: str) -> nn.Module | None:
    try:
        found = getattr(model, getter)() if hasattr(model, getter) else None
    except NotImplementedError:
        return None
    return found if isinstance(found, nn.Module) else None


def apply_hf_tp(model: nn.Module, tp_mesh, hf_plan: Mapping[str, str]) -> None:
    """Tensor parallelism as Hugging Face applies it (``transformers.distributed.tensor_parallel.
    apply_tensor_parallelism`` on the resolved plan); a style Flint cannot capture is refused by name."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    bad = {_layer_pattern(n): s for n, s in hf_plan.items()
           if s not in HF_TP_STYLES and s != HF_GRAD_ALLREDUCE}
    if bad:
        name, style = min(bad.items())
        raise CaptureError("plan", f"tensor parallelism of {type(model).__name__}: Hugging Face's plan shards "
                           f"'{name}' with '{style}', which Flint does not capture (it captures "
                           f"{', '.join(sorted(HF_TP_STYLES | {HF_GRAD_ALLREDUCE}))}); pass --parallelize with "
                           "your own parallelize_module plan", where_defined(model))
    emb = input_embeddings(model)
    out = output_embeddings(model)
    tied = emb is not None and out is not None and out.weight is emb.weight
    # a tied output weight is not a parameter of its own (named_parameters lists it once, under the
    # embedding); Hugging Face shards it at load time before tying, then ties the two again
    path = {id(m): n for n, m in model.named_modules()}
    names = {n for n, _ in model.named_parameters()} | set(path.values())
    if tied:
        # both vocabulary-sharded (Shard(0)) or both whole: one weight serves both
        vocab_sharded = (hf_plan.get(path[id(emb)]) == "embedding_rowwise",
                         hf_plan.get(path[id(out)]) in ("colwise", "colwise_gather_output", "colwise_rep"))
        if vocab_sharded[0] != vocab_sharded[1]:
            raise CaptureError("plan", f"tensor parallelism of {type(model).__name__}: Hugging Face's plan shards "
                               f"the tied input and output embeddings differently ('{path[id(emb)]}': "
                               f"{hf_plan.get(path[id(emb)])}, '{path[id(out)]}': {hf_plan.get(path[id(out)])}); "
                               "untie them (tie_word_embeddings=False) or pass --parallelize", where_defined(model))
    apply_tensor_parallelism(model, tp_mesh, {n: s for n, s in hf_plan.items() if s in HF_TP_STYLES and n in names})
    if tied:
        out.weight = emb.weight
    hf_grad_allreduce(model, tp_mesh, hf_plan)


# How shard-expand (the planned path) reproduces a Hugging Face plan style on an nn.Linear's weight and bias:
# the dim tp splits, None for replicated. The input and output layouts these styles state are what
# shard-expand's propagation gives (a column-parallel output stays split to the row-parallel layer; a
# row-parallel output is reduced where it is next read whole; a replicated input is split locally).
_PLANNED_LINEAR = {"colwise": (0, 0), "rowwise": (1, None), "rowwise_split_input": (1, None)}


def planned_tp_rules(model: nn.Module) -> tuple[tuple[tuple[str, int], ...] | None, str]:
    """For the planned path: a Hugging Face model's ``[[tp]]`` parameter patterns (fnmatch over parameter
    names, the dim tp splits) from the plan it declares, which is what the captured path applies when no Flint
    TP preset names the model; or, second, why shard-expand cannot reproduce that plan. ``(None, "")`` where
    the built-in rules apply (a model a preset names, or one without a declared plan)."""
    if detect_tp_preset(model) is not None:
        return None, ""
    if (experts := config_experts(model)) is not None:
        from flint.sharding.rules import MOE_TP_REFUSED

        return None, f"{type(model).__name__} has {experts} experts per layer: its {MOE_TP_REFUSED}"
    try:
        plan = hf_tp_plan(model, 2, quiet=True)  # its module names; the degree only enters Hugging Face's checks
    except CaptureError as e:
        return None, e.message
    if not plan:
        return None, ""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    head = output_embeddings(model)
    rules: dict[str, int] = {}
    for name, style in sorted(plan.items()):
        if name not in params or style == HF_GRAD_ALLREDUCE:
            continue  # a module's own entry (its parameters have theirs); a replicated weight
        owner, _, kind = name.rpartition(".")
        module = modules.get(owner)
        pattern = _layer_pattern(name)
        where = f"Hugging Face's tensor-parallel plan of {type(model).__name__} shards '{pattern}' with '{style}'"
        if isinstance(module, nn.Embedding) and style == "embedding_rowwise":
            rules[pattern] = 0  # vocabulary-parallel
        elif isinstance(module, nn.Linear) and (style in _PLANNED_LINEAR or
                                                (style == "colwise_gather_output" and module is head)):
            # the output projection's gathered logits: the loss needs the whole vocabulary, as there
            dim = _PLANNED_LINEAR.get(style, (0, 0))[kind == "bias"]
            if dim is not None:
                rules[pattern] = dim
        elif style == "colwise_gather_output":
            return None, (f"{where}: it gathers the layer's output on every rank, which shard-expand does not "
                          "reproduce (it keeps the output split and reduces where it is next read whole)")
        else:
            return None, f"{where} on a {type(module).__name__}, which shard-expand has no rule for"
    return tuple(rules.items()), ""


def config_experts(model: nn.Module) -> int | None:
    """The experts per MoE layer a Hugging Face config gives (Mixtral's num_local_experts, Qwen3-MoE's and
    OLMoE's num_experts, DeepSeek's n_routed_experts), None for a dense model."""
    for key in ("num_local_experts", "n_experts", "num_experts", "n_routed_experts"):
        value = _cfg_get(model, key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _cfg_get(model: nn.Module, key: str) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def _apply_preset(model: nn.Module, mesh, preset: str, plan, hf_plan: Mapping[str, str] | None) -> None:
    """TP preset ``preset`` on ``model`` (``parallelize_module``), with the weights Hugging Face's own plan
    all-reduces the gradients of (``hf_plan``: e.g. Qwen3's per-head norms, which the preset leaves alone)."""
    from torch.distributed.tensor.parallel import parallelize_module

    table = TP_PRESETS[preset]
    head, embed = model.get_submodule(table["head"]), model.get_submodule(table["embed"])
    tied = head.weight is embed.weight
    parallelize_module(model, mesh["tp"], tp_plan(preset, plan.sp, model))
    if tied:  # both vocab-sharded (Shard(0)): keep ONE parameter, as the untouched model does
        head.weight = embed.weight
    if hf_plan:
        hf_grad_allreduce(model, mesh["tp"], hf_plan)
    for block in model.get_submodule(table["blocks"]).children():
        for attr in table.get("divide", ()):
            owner, _, name = attr.rpartition(".")
            holder = block.get_submodule(owner) if owner else block
            setattr(holder, name, getattr(holder, name) // plan.tp)


def preset_parallelize(plan, model: nn.Module, blocks_path: str | None,
                       stages: tuple[set[str], set[str]] | None = None) -> Callable[[nn.Module, Any], None]:
    """Flint's named plan as a parallelize function, written as a training script would.

    TP (``plan.tp > 1``): the TP preset matching the model's module names
    (:data:`TP_PRESETS`), else a Hugging Face model's own plan applied by
    Hugging Face's code (:func:`apply_hf_tp`). Data parallelism: ``fully_shard`` (``dp_shard``,
    HSDP with ``dp_replicate``) or ``replicate`` on the input embedding (if
    untied from the output), every block, ``[final norm, output]`` as one
    group when a preset names them, and the root, as torchtitan does. With
    pipeline stages (``stages``: the parameter names the first and the last
    stage read outside the blocks), each stage's remaining modules are a group
    of their own, as torchtitan shards each stage's model part.
    Activation checkpointing (``plan.activation_checkpoint``): the blocks at
    ``blocks_path`` wrapped as :func:`flint.capture.recipes.ac_wrap` does,
    after TP and before data parallelism.
    """

    def parallelize(model: nn.Module, mesh) -> None:
        import torch.distributed.fsdp as fsdp_mod
        from torch.distributed._composable.replicate_with_fsdp import replicate

        if plan.tp > 1:
            if config_experts(model) is not None:
                raise CaptureError("tp", "capturing tensor parallelism of mixture-of-experts layers is not "
                                   "implemented; use 'dp' or 'fsdp' for MoE models")
            preset = detect_tp_preset(model)
            hf_plan = hf_tp_plan(model, plan.tp)
            if preset is None and hf_plan is None:
                near = "; ".join(f"its module names are TP preset {name}'s, but {why}"
                                 for name, why in _named_presets(model).items())
                names = near or f"its module names match no TP preset ({', '.join(TP_PRESETS)})"
                raise CaptureError("plan", f"tensor parallelism of {type(model).__name__}: {names}, and it declares "
                                   "no Hugging Face tensor-parallel plan (base_model_tp_plan); pass --parallelize "
                                   "with your own parallelize_module plan", where_defined(model))
            heads = TP_PRESETS[preset]["heads"] if preset else ("num_attention_heads", "num_key_value_heads")
            for key in heads:
                value = _cfg_get(model, key)
                if value is not None and value % plan.tp:
                    raise CaptureError(key, f"{value} heads are not divisible by the tensor-parallel degree {plan.tp}")
            if preset is None:  # Hugging Face's own plan, applied by Hugging Face's own code
                if plan.sp:
                    raise CaptureError("sp", f"sequence parallelism of {type(model).__name__}: Flint's sequence-"
                                       f"parallel plans are its TP presets ({', '.join(TP_PRESETS)}), whose module "
                                       "names this model does not have, and Hugging Face's plan has none; drop "
                                       "sp or pass --parallelize", where_defined(model))
                if blocks_path is not None and not any(n.startswith(f"{blocks_path}.") for n in hf_plan):
                    raise CaptureError("plan", f"tensor parallelism of {type(model).__name__}: Hugging Face's plan "
                                       f"shards nothing in its blocks ('{blocks_path}'), which would stay whole on "
                                       f"every tp rank (resolved plan: {sorted(hf_plan)}); fix base_model_tp_plan "
                                       "or pass --parallelize", where_defined(model))
                apply_hf_tp(model, mesh["tp"], hf_plan)
                parallelize.tp_applied = "the tensor-parallel plan its Hugging Face config declares"
            else:
                _apply_preset(model, mesh, preset, plan, hf_plan)
                parallelize.tp_applied = f"Flint's TP preset '{preset}', matched by its module names"
        if blocks_path is not None and plan.activation_checkpoint != "none":
            # after TP, before data parallelism, as torchtitan applies it
            from flint.capture.recipes import ac_layers, ac_wrap

            blocks = model.get_submodule(blocks_path)
            keys = list(blocks._modules)
            for i in ac_layers(plan, len(keys)):
                blocks._modules[keys[i]] = ac_wrap(blocks._modules[keys[i]], plan)
        if plan.dp_shard > 1:
            dp_mesh = mesh["dp_replicate", "dp_shard"] if plan.dp_replicate > 1 else mesh["dp_shard"]
            # the plan's ZeRO stage and mixed precision, as fully_shard takes them
            kw: dict[str, Any] = {"reshard_after_forward": False} if plan.zero == 2 else {}
            mp = {f"{k}_dtype": getattr(torch, v) for k, v in (("param", plan.param_dtype),
                                                                ("reduce", plan.reduce_dtype)) if v != "param"}
            if mp:
                kw["mp_policy"] = fsdp_mod.MixedPrecisionPolicy(**mp)
            wrap = lambda m, **extra: fsdp_mod.fully_shard(m, mesh=dp_mesh, **{**kw, **extra})  # noqa: E731
        elif plan.reduce_dtype != "param":
            raise CaptureError("reduce_dtype", f"'{plan.reduce_dtype}' with replicate (dp_replicate only) on a model "
                               "Flint has no recipe for: torch's replicate takes no reduce dtype; use dp_shard "
                               "(FSDP2's MixedPrecisionPolicy) or --parallelize", where_defined(model))
        elif plan.dp_replicate > 1:
            wrap = lambda m: replicate(m, mesh=mesh["dp_replicate"])  # noqa: E731
        else:
            return
        grouped: set[int] = set()

        def group(m, **extra) -> None:  # noqa: ANN001
            grouped.update(id(p) for x in (m if isinstance(m, list) else [m]) for p in x.parameters())
            wrap(m, **extra)

        emb = input_embeddings(model)
        out = output_embeddings(model)
        tied = emb is not None and out is not None and out.weight is emb.weight
        if emb is not None and not tied:
            group(emb)
        if blocks_path is not None:
            for block in model.get_submodule(blocks_path).children():
                group(block)
        preset = detect_tp_preset(model)
        if preset is not None:
            # final norm and output as one group, not resharded after forward, as torchtitan does; a tied input
            # embedding joins them: FSDP2 refuses one parameter in two groups ("is shared with a parameter already
            # managed by another FSDP group"), which the root would otherwise make it
            table = TP_PRESETS[preset]
            extra = {"reshard_after_forward": False} if plan.dp_shard > 1 else {}
            head = [model.get_submodule(table["norm"]), model.get_submodule(table["head"])]
            group(([emb] if tied else []) + head, **extra)
        for side in stages or ():
            # the stage's modules not grouped yet: torchtitan's fully_shard on each stage's model part, the root
            # of its stage, which FSDP2 does not reshard after forward (as the root group without stages)
            owners = {n.rpartition(".")[0]: None for n, p in model.named_parameters()
                      if n in side and id(p) not in grouped and "." in n}
            if owners:
                mods = [model.get_submodule(o) for o in owners]
                group(mods if len(mods) > 1 else mods[0],
                      **({"reshard_after_forward": False} if plan.dp_shard > 1 else {}))
        wrap(model)

    parallelize.__name__ = plan.describe()
    parallelize.tp_applied = ""  # what split the model's layers over tp, once it has run (for error messages)
    return parallelize


def group_params(group_modules: Sequence[nn.Module], taken: set[int]) -> list[tuple[nn.Module, list[str]]]:
    """Per module of a recorded call: the parameter names not already in an earlier group."""
    out = []
    for m in group_modules:
        names = [n for n, p in m.named_parameters() if id(p) not in taken]
        out.append((m, names))
    return out


def fnmatch_any(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)
