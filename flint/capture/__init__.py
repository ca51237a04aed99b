"""Capture real PyTorch training steps at any cluster size, on one CPU.

>>> from flint.capture import capture_step
>>> from flint.models import factory
>>> step = capture_step(factory("llama3-8b"), {"tokens": (1024, 8192), "labels": (1024, 8192)},
...                     world_size=1024, plan="fsdp+tp", tp=8, dtype="bfloat16")   # doctest: +SKIP
>>> step.part("block").repeat                             # doctest: +SKIP
32

See :func:`capture_step` (flint/capture/step.py) for the inputs and
:class:`CapturedStep` for what comes back; plans are :class:`flint.plan.Plan`
(or a recipe name, a preset for one); recipes are in
:mod:`flint.capture.recipes`, op classes in :mod:`flint.capture.opclass`.
"""

import logging
import sys
import warnings
from contextlib import contextmanager

from flint.capture.errors import CaptureError


class _LibraryImportNoise(logging.Filter):
    """Drop two messages importing torchao prints, which nobody capturing with Flint can act on: its
    "Failed to load .../_C*.so" (its CUDA kernels do not load on a CPU build of torch; float8 training's
    ``_scaled_mm`` path does not use them) and torch 2.13's deprecation of ``register_constant()`` on the
    Enum classes torchao registers (addressed to torchao). transformers imports torchao when a model class
    is first used, so the filters sit on the two loggers from the first import of ``flint.capture`` on,
    before any model file is loaded; every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ((msg.startswith("Failed to load") and ".so" in msg)
                    or "is an Enum subclass and is now natively supported by torch.compile" in msg)


logging.getLogger("torchao").addFilter(_LibraryImportNoise())
logging.getLogger("torch.utils._pytree").addFilter(_LibraryImportNoise())


@contextmanager
def pytorch_warnings(verbose: bool = False):
    """Collect the warnings PyTorch prints while capturing (e.g. the activation-checkpoint block every
    FSDP capture triggers): printed with ``verbose`` (``flint capture --verbose``) or when the capture fails,
    else only collected (the caller may count them)."""
    records: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    handler = _Collect(level=logging.WARNING)
    # torch attaches its own stderr handlers to its loggers: swap them for the collector meanwhile.
    saved = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not verbose:
            names = ["torch"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
            for n in names:
                lg = logging.getLogger(n)
                if lg.handlers or n == "torch":
                    saved[n] = lg.handlers[:]
                    lg.handlers = [handler]
        ok = False
        try:
            yield records
            ok = True
        finally:
            for n, hs in saved.items():
                logging.getLogger(n).handlers = hs
            seen = set()
            for w in caught:
                text = f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}"
                if text not in seen:
                    seen.add(text)
                    records.append(text)
            if verbose or not ok:
                for r in records:
                    print(f"  warning: {r}", file=sys.stderr)


# Everything else on first use (PEP 562): ``import flint.capture.opclass`` (the op classes the cost
# model reads while lowering a written IR) must not pay for torch._dynamo, DTensor and the recipes.
_LAZY = {
    "classify_aten": "flint.capture.opclass",
    "RECIPES": "flint.capture.recipes",
    "ParamInfo": "flint.capture.recipes",
    **{name: "flint.capture.step" for name in ("CapturedGraph", "CapturedPart", "CapturedStep", "Role",
                                               "StepSummary", "capture_step", "summarize")},
}

__all__ = ["capture_step", "CapturedStep", "CapturedPart", "CapturedGraph", "Role", "StepSummary",
           "summarize", "classify_aten", "CaptureError", "RECIPES", "ParamInfo", "pytorch_warnings"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flint.capture' has no attribute '{name}'")
    from importlib import import_module

    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
