"""`attention-kernel`: say which fused attention kernel the program's attention runs.

A capture on fake tensors records ``scaled_dot_product_attention`` as the op PyTorch's CPU
dispatch picks; which GPU kernel runs it is the software stack's choice, not the program's:

- ``flash`` (the default; no mark): PyTorch's ``scaled_dot_product_attention`` tries its flash
  backend first, FlashAttention-2 unless another implementation is activated
  (``torch.nn.attention.activate_flash_attention_impl``; torch 2.13's registry restores "the
  default FA2 implementation"), also on Hopper, where cuDNN's kernels are faster (Hugging Face
  transformers PR 48163, 2026: "a fixed priority that puts FlashAttention first").
- ``cudnn``: cuDNN's fused attention, which Transformer Engine selects first on Hopper
  ("sm90: cuDNN attention > flash-attention > PyTorch-native attention", its attention guide),
  so Megatron-Core runs it; in PyTorch, ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``.

The pass marks every fused attention op (forward and backward) ``flint.attention_kernel =
"cudnn"`` (``kernel=flash`` removes the mark) and drops cost annotations already on them, so
whatever prices them next (``fuse-pointwise``, ``annotate-cost`` or ``lower-to-chakra``) uses the
device calibration's ``[cudnn_attention]`` rates; a device without that table is an error there.

Options: ``kernel`` (``flash`` or ``cudnn``, default ``cudnn``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass

from flint.cost.opclass import ATTENTION, classify_target
from flint.errors import FlintError
from flint.ir.aten import AtenOp
from flint.passes.annotate_cost import ATTENTION_KERNEL_ATTR, BYTES_ATTR, DURATION_ATTR, FLOPS_ATTR

KERNELS = ("flash", "cudnn")


@dataclass(frozen=True)
class AttentionKernelPass(ModulePass):
    """Mark the fused attention ops with the kernel that runs them (module docstring)."""

    name = "attention-kernel"

    kernel: str = "cudnn"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise FlintError(f"{self.name}: option kernel={self.kernel} is not a kernel Flint prices; "
                             f"kernels: {', '.join(KERNELS)}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        n = 0
        for o in op.walk():
            if isinstance(o, AtenOp) and classify_target(o.overload) == ATTENTION:
                for key in (FLOPS_ATTR, BYTES_ATTR, DURATION_ATTR):
                    o.attributes.pop(key, None)
                if self.kernel == "flash":
                    o.attributes.pop(ATTENTION_KERNEL_ATTR, None)
                else:
                    o.attributes[ATTENTION_KERNEL_ATTR] = StringAttr(self.kernel)
                n += 1
        print(f"{self.name}: {n} fused attention op{'' if n == 1 else 's'} priced as the {self.kernel} kernel",
              file=sys.stderr)
