// RUN: flint-opt %s -p 'fuse-pointwise{parts=block}' | filecheck %s
// RUN: flint-opt %s -p 'fuse-pointwise{parts=block,head}' | filecheck %s --check-prefix=BOTH
// RUN: not flint-opt %s -p 'fuse-pointwise{parts=blocks}' 2>&1 | filecheck %s --check-prefix=UNKNOWN
// flint-opt verifies the module after every pass.

// parts=block: the block's functions are compiled (torchtitan's per-block torch.compile), so its
// neg -> exp chain is one kernel reading x and writing the exp (2 x 1024 B) ...
// CHECK-LABEL: func.func @block_fwd
// CHECK:       aten.op "aten.neg.default"(%x) {fusion_group = "block_fwd:0", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64, fusion_in_kernel}
// CHECK:       aten.op "aten.exp.default"(%{{.*}}) {fusion_group = "block_fwd:0", flops = 0 : i64, bytes = 2048 : i64
// ... and the head runs eagerly: the same chain is two kernels of 2 x 1024 B each, and the target-logit
// gather reads the 8 selected f32 values and the index, not the whole 8 x 64 tensor.
// CHECK-LABEL: func.func @head_fwd
// CHECK:       aten.op "aten.neg.default"(%x) {flops = 0 : i64, bytes = 2048 : i64, duration_us = 3.000000e+00 : f64}
// CHECK-NEXT:  aten.op "aten.exp.default"(%{{.*}}) {flops = 0 : i64, bytes = 2048 : i64, duration_us = 3.000000e+00 : f64}
// CHECK-NEXT:  aten.op "aten._to_copy.default"(%{{.*}}) args = {{.*}} {flops = 0 : i64, bytes = 3072 : i64
// CHECK-NEXT:  aten.op "aten.gather.default"(%{{.*}}, %t) args = {{.*}} {flops = 0 : i64, bytes = 128 : i64
// CHECK-NOT:   fusion_group

// BOTH-LABEL: func.func @head_fwd
// BOTH:       aten.op "aten.neg.default"(%x) {fusion_group = "head_fwd:0"

// UNKNOWN: fuse-pointwise: parts=blocks: 'blocks' is no part of this module; its parts are block, head
func.func @block_fwd(%x: tensor<8x64xbf16>) -> tensor<8x64xbf16> {
  %0 = aten.op "aten.neg.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %1 = aten.op "aten.exp.default"(%0) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  func.return %1 : tensor<8x64xbf16>
}
func.func @head_fwd(%x: tensor<8x64xbf16>, %t: tensor<8x1xi64>) -> tensor<8x1xf32> {
  %0 = aten.op "aten.neg.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %1 = aten.op "aten.exp.default"(%0) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %2 = aten.op "aten._to_copy.default"(%1) args = {dtype = 6 : i64} : (tensor<8x64xbf16>) -> tensor<8x64xf32>
  %3 = aten.op "aten.gather.default"(%2, %t) args = {dim = 1 : i64} : (tensor<8x64xf32>, tensor<8x1xi64>) -> tensor<8x1xf32>
  func.return %3 : tensor<8x1xf32>
}
