"""Float8 training of the linear layers, as torchtitan applies it: torchao's ``Float8Linear``.

A plan with ``fp8`` set (:class:`flint.plan.Plan`) swaps the model's
``nn.Linear`` modules for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training``, pinned in pyproject.toml)
before any parallelism is applied, as torchtitan's ``Float8LinearConverter``
does (``torchtitan/components/quantization/float8.py``). The captured program
is then what torchao runs: per linear layer and step, ``aten._scaled_mm``
for the forward GEMM and the two backward GEMMs (``rowwise_with_gw_hp``
keeps the weight-gradient GEMM an ``aten.mm`` in bf16), and the dynamic
scaling in front of each: ``abs`` + ``max`` (the amax), the scale
(``clamp``, ``reciprocal``, ``mul``) and the cast to float8 (``mul``,
``clamp``, ``_to_copy``) of the input, the weight and the output gradient.
Flint prices each ``_scaled_mm`` at the device's fp8 peak
(:func:`flint.passes.annotate_cost.compute_dtype`) and every scaling op as
the memory-bound kernel it is (captured before ``torch.compile``'s fusion,
so unfused: the upper end of the overhead; ``fuse-pointwise`` groups them).

Which modules convert is torchtitan's ``module_filter_fn``
(``torchtitan/components/quantization/utils.py``): ``nn.Linear`` whose
weight dims are both multiples of 16 (the fp8 tensor-core requirement),
and whose fully qualified name contains none of ``fp8_filter_fqns`` (default
``["output", "lm_head"]``: torchtitan's Llama configs filter the output
head ``output``; ``lm_head`` is its name in Hugging Face models).

Recipes (torchao's ``Float8LinearConfig.from_recipe_name``): ``tensorwise``
(dynamic per-tensor scales, e4m3 input / weight, e5m2 gradient: torchao's
default and the fastest), ``rowwise`` and ``rowwise_with_gw_hp``.

Not modelled: torchao's FSDP float8 all-gather
(``enable_fsdp_float8_all_gather``, off by default in torchtitan): Flint's
FSDP gathers the bf16 weights, and each rank scales its gathered weight,
which is what FSDP2 runs with that option off.
"""

from __future__ import annotations

from torch import nn

from flint.plan import Plan, PlanError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def module_filter(module: nn.Module, fqn: str, filter_fqns: tuple[str, ...]) -> bool:
    """torchtitan's ``module_filter_fn``: convert ``nn.Linear`` with weight dims divisible by 16 whose
    name contains none of ``filter_fqns``."""
    if not isinstance(module, nn.Linear):
        return False
    out_f, in_f = module.weight.shape
    return out_f % 16 == 0 and in_f % 16 == 0 and not any(f in fqn for f in filter_fqns)


def apply_float8(model: nn.Module, plan: Plan) -> list[str]:
    """Swap ``model``'s eligible linear layers for torchao's ``Float8Linear`` (module docstring).

    Returns the converted modules' names. Raises :class:`PlanError` (field
    ``fp8``) when the model has no linear layer, or none that qualifies.
    """
    if plan.fp8 == "none":
        return []
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise PlanError("fp8", f"'{plan.fp8}' runs the GEMMs of nn.Linear layers in float8, and this model "
                        f"({type(model).__name__}) has no nn.Linear layer; set fp8 = \"none\"", plan.source)
    filt = tuple(plan.fp8_filter_fqns)
    chosen = [n for n, m in linears if module_filter(m, n, filt)]
    if not chosen:
        odd = [n for n, m in linears if any(d % 16 for d in m.weight.shape)]
        why = []
        if odd:
            why.append(f"{len(odd)} have a weight dim that is not a multiple of 16 (fp8 tensor cores need it): "
                       + ", ".join(odd[:3]) + (", ..." if len(odd) > 3 else ""))
        if len(odd) < len(linears):
            why.append(f"{len(linears) - len(odd)} match fp8_filter_fqns {list(filt)}")
        raise PlanError("fp8", f"none of the model's {len(linears)} nn.Linear layers qualifies for float8: "
                        + "; ".join(why), plan.source)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(plan.fp8)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: module_filter(m, fqn, filt))
    return chosen
