// RUN: flint-opt %s -p 'annotate-cost' | filecheck %s --check-prefix=FLASH
// RUN: flint-opt %s -p 'attention-kernel,annotate-cost' 2>%t.err | filecheck %s --check-prefix=CUDNN
// RUN: filecheck %s --check-prefix=REMARK < %t.err
// RUN: flint-opt %s -p 'annotate-cost,attention-kernel{kernel=cudnn},annotate-cost' 2>/dev/null | filecheck %s --check-prefix=CUDNN
// RUN: flint-opt %s -p 'attention-kernel,attention-kernel{kernel=flash},annotate-cost' 2>/dev/null | filecheck %s --check-prefix=FLASH
// RUN: not flint-opt %s -p 'attention-kernel,annotate-cost{device=a100-80gb}' 2>&1 | filecheck %s --check-prefix=NOTABLE
// RUN: not flint-opt %s -p 'attention-kernel{kernel=fa3}' 2>&1 | filecheck %s --check-prefix=KERNEL
// flint-opt verifies the module after every pass.

// A causal attention forward, 16 heads x 2,048 tokens, head dim 128, on the H100 SXM (annotate-cost's
// default). Unmarked it is PyTorch's default flash backend, FlashAttention-2: 58.5 us. Marked cudnn it
// uses the calibration's [cudnn_attention] rates: 36.8 us, 1.59x faster (Transformer Engine's measured
// ratio). Marking after a pricing pass drops the old annotation, so the next pricing pass redoes it;
// kernel=flash removes the mark. Other ops are left alone.
// FLASH:      aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) args = {{.*}} {flops = 34359738368 : i64, bytes = 33685504 : i64, duration_us = 58.46482{{[0-9]*}} : f64}
// FLASH-NOT:  flint.attention_kernel
// CUDNN:      aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) args = {{.*}} {flint.attention_kernel = "cudnn", flops = 34359738368 : i64, bytes = 33685504 : i64, duration_us = 36.77626{{[0-9]*}} : f64}
// CUDNN-NEXT: aten.op "aten.neg.default"(%o) {flops = 0 : i64
// The same kernel with dropout (dropout_p = 0.1): cuDNN's takes its table's dropout_overhead longer,
// 3.4% (38.03 us; TransformerEngine issue 3312, H200); FlashAttention-2 has no measured overhead on
// Hopper, so it is priced as without.
// FLASH:      aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) args = {dropout_p = 1.000000e-01 : f64, is_causal = true} {flops = 34359738368 : i64, bytes = 33685504 : i64, duration_us = 58.46482{{[0-9]*}} : f64}
// CUDNN:      aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) args = {dropout_p = 1.000000e-01 : f64, is_causal = true} {flint.attention_kernel = "cudnn", flops = 34359738368 : i64, bytes = 33685504 : i64, duration_us = 38.02665{{[0-9]*}} : f64}
// REMARK: attention-kernel: 2 fused attention ops priced as the cudnn kernel

// A device whose calibration has no cuDNN attention rates (the A100: none sourced) refuses the mark.
// NOTABLE: error: device 'a100-80gb' has no [cudnn_attention] in its calibration
// KERNEL: flint-opt: error: attention-kernel: option kernel=fa3 is not a kernel Flint prices; kernels: flash, cudnn

func.func @block_fwd(%q: tensor<1x16x2048x128xbf16>, %k: tensor<1x16x2048x128xbf16>, %v: tensor<1x16x2048x128xbf16>) -> tensor<1x16x2048x128xbf16> {
  %o, %lse = aten.op "aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) args = {dropout_p = 0.000000e+00 : f64, is_causal = true} : (tensor<1x16x2048x128xbf16>, tensor<1x16x2048x128xbf16>, tensor<1x16x2048x128xbf16>) -> (tensor<1x16x2048x128xbf16>, tensor<1x16x2048xf32>)
  %n = aten.op "aten.neg.default"(%o) : (tensor<1x16x2048x128xbf16>) -> tensor<1x16x2048x128xbf16>
  func.return %n : tensor<1x16x2048x128xbf16>
}

func.func @block_fwd_dropout(%q: tensor<1x16x2048x128xbf16>, %k: tensor<1x16x2048x128xbf16>, %v: tensor<1x16x2048x128xbf16>) -> tensor<1x16x2048x128xbf16> {
  %o, %lse = aten.op "aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) args = {dropout_p = 1.000000e-01 : f64, is_causal = true} : (tensor<1x16x2048x128xbf16>, tensor<1x16x2048x128xbf16>, tensor<1x16x2048x128xbf16>) -> (tensor<1x16x2048x128xbf16>, tensor<1x16x2048xf32>)
  func.return %o : tensor<1x16x2048x128xbf16>
}
