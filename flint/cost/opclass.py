"""Op classes: which efficiency factor of a device applies to an ATen op.

A device model (:mod:`flint.cost.device`) has one compute efficiency and one
memory efficiency per op class; :func:`classify_aten` maps an ATen overload
name (``"aten.mm.default"``) to its class. Classes:

``gemm``        matrix multiplies (mm, addmm, bmm, baddbmm, _scaled_mm, _grouped_mm, linear, matmul)
``attention``   fused attention kernels (SDPA flash / efficient / cuDNN, fwd and bwd)
``conv``        convolutions, fwd and bwd
``norm``        layer norm, RMS norm, batch / group norm, fwd and bwd
``softmax``     softmax and log-softmax, fwd and bwd
``reduction``   sum, mean, max, norms of vectors, losses
``embedding``   embedding lookup and its backward (gather / scatter-add)
``copy``        materializing copies: clone, contiguous, cat, copy_, index ops
``view``        metadata-only ops (view, reshape of contiguous, permute, t, slice, ...): no kernel, zero cost
``optimizer``   fused / foreach optimizer updates
``elementwise`` pointwise arithmetic and activations (the default for unknown ``aten`` ops)

NOTE: the capture package may grow its own ``classify_aten`` in
``flint/capture/opclass.py``; the two must be merged into one.
"""

from __future__ import annotations

from enum import StrEnum


class OpClass(StrEnum):
    """Op class names; the keys of a device's efficiency tables."""

    GEMM = "gemm"
    ATTENTION = "attention"
    CONV = "conv"
    NORM = "norm"
    SOFTMAX = "softmax"
    REDUCTION = "reduction"
    EMBEDDING = "embedding"
    COPY = "copy"
    VIEW = "view"
    OPTIMIZER = "optimizer"
    ELEMENTWISE = "elementwise"


_BY_PACKET: dict[str, OpClass] = {}


def _reg(cls: OpClass, names: str) -> None:
    for n in names.split():
        _BY_PACKET[n] = cls


_reg(OpClass.GEMM, "mm addmm bmm baddbmm _scaled_mm _grouped_mm _scaled_grouped_mm linear matmul addbmm addmv mv dot "
     "_addmm_activation linear_backward")
_reg(OpClass.ATTENTION, "_scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward "
     "_scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward "
     "_scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward "
     "_flash_attention_forward _flash_attention_backward _efficient_attention_forward "
     "_efficient_attention_backward scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu "
     "_scaled_dot_product_flash_attention_for_cpu_backward _scaled_dot_product_attention_math")
_reg(OpClass.CONV, "convolution _convolution convolution_backward cudnn_convolution convolution_overrideable "
     "_slow_conv2d_forward conv1d conv2d conv3d")
_reg(OpClass.NORM, "native_layer_norm native_layer_norm_backward layer_norm rms_norm _fused_rms_norm "
     "_fused_rms_norm_backward native_batch_norm native_batch_norm_backward native_group_norm "
     "native_group_norm_backward _native_batch_norm_legit _native_batch_norm_legit_no_training batch_norm group_norm")
_reg(OpClass.SOFTMAX, "_softmax _softmax_backward_data softmax _log_softmax _log_softmax_backward_data log_softmax")
_reg(OpClass.REDUCTION, "sum mean amax amin max min argmax argmin prod var var_mean std std_mean norm "
     "linalg_vector_norm _foreach_norm nll_loss_forward nll_loss_backward nll_loss nll_loss2d_forward "
     "nll_loss2d_backward cross_entropy_loss mse_loss mse_loss_backward any all logsumexp cumsum topk sort")
_reg(OpClass.EMBEDDING, "embedding embedding_dense_backward _embedding_bag _embedding_bag_backward")
_reg(OpClass.COPY, "clone contiguous copy copy_ _to_copy cat stack index index_put index_put_ _index_put_impl_ "
     "index_select gather scatter scatter_add scatter_add_ constant_pad_nd zeros_like ones_like empty_like "
     "full_like new_zeros new_ones new_empty new_full zeros ones full fill fill_ zero_ slice_scatter select_scatter "
     "repeat roll flip tril triu masked_fill index_add")
_reg(OpClass.VIEW, "view _unsafe_view reshape t transpose permute expand expand_as slice select squeeze unsqueeze "
     "split split_with_sizes unbind chunk narrow alias detach as_strided unflatten flatten view_as lift_fresh "
     "lift_fresh_copy _reshape_alias view_as_real view_as_complex numpy_T empty empty_strided sym_size sym_numel "
     "sym_stride sym_storage_offset")
_reg(OpClass.OPTIMIZER, "_fused_adam _fused_adam_ _fused_adamw _fused_adamw_ _fused_sgd _fused_sgd_")


def _packet(target: str) -> tuple[str, str]:
    """Split ``"aten.mm.default"`` / ``"aten::mm"`` / ``"mm"`` into ``("aten", "mm")``."""
    t = target.replace("::", ".")
    parts = t.split(".")
    if len(parts) == 1:
        return "aten", parts[0]
    return parts[0], parts[1]


def classify_aten(target: str) -> OpClass:
    """The op class of an ATen overload name such as ``"aten.mm.default"``.

    ``_foreach_*`` ops are ``optimizer``; ops of other namespaces and unknown
    ATen ops are ``elementwise`` (memory-bound pointwise kernels, the most
    common case left over in a Transformer).
    """
    ns, name = _packet(target)
    if ns != "aten":
        return OpClass.ELEMENTWISE
    cls = _BY_PACKET.get(name)
    if cls is not None:
        return cls
    if name.startswith("_foreach_"):
        return OpClass.OPTIMIZER
    return OpClass.ELEMENTWISE
