// RUN: flint-opt %s -p fuse-pointwise | filecheck %s
// RUN: flint-opt %s -p 'fuse-pointwise{device=a100-80gb}' | filecheck %s --check-prefix=A100
// flint-opt verifies the module after every pass.

// An RMSNorm chain (cast, square, mean, +eps, rsqrt, scale, cast, weight) is one kernel: it reads
// x (8*64*2 = 1024 B) and g (128 B) and writes its result (1024 B) once, 2176 B; the members before
// the last carry no bytes and no time, and their values never leave the kernel (fusion_in_kernel:
// nothing allocates them); the last member writes its value, so it has no fusion_in_kernel.
// CHECK:      aten.op "aten._to_copy.default"(%x) {fusion_group = "block:0", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64, fusion_in_kernel}
// CHECK:      aten.op "aten.mean.dim"(%{{.*}}) args = {{.*}} {fusion_group = "block:0", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64, fusion_in_kernel}
// CHECK:      %[[N:.*]] = aten.op "aten.mul.Tensor"(%{{.*}}, %g) {fusion_group = "block:0", flops = 0 : i64, bytes = 2176 : i64, duration_us = 3.000000e+00 : f64}
// A GEMM ends the group and is priced on its own.
// CHECK-NEXT: aten.op "aten.mm.default"(%[[N]], %w) {flops = 65536 : i64, bytes = 10240 : i64, duration_us = {{.*}} : f64}
// relu, two views and the residual add: one kernel reading the mm result and x, writing the sum (3 x 1024 B).
// The relu stays in the kernel; a view allocates nothing in any case and is not marked.
// CHECK:      aten.op "aten.relu.default"(%{{.*}}) {fusion_group = "block:1", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64, fusion_in_kernel}
// CHECK:      aten.op "aten.view.default"(%{{.*}}) args = {{.*}} {fusion_group = "block:1", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64}
// CHECK:      aten.op "aten.add.Tensor"(%{{.*}}, %x) {fusion_group = "block:1", flops = 0 : i64, bytes = 3072 : i64, duration_us = 3.000000e+00 : f64}
// A100 kernel floor: 3.5 us.
// A100:       aten.op "aten.add.Tensor"(%{{.*}}, %x) {fusion_group = "block:1", flops = 0 : i64, bytes = 3072 : i64, duration_us = 3.500000e+00 : f64}

// A lone pointwise op is not a group: it keeps its own cost.
// CHECK-LABEL: func.func @lone
// CHECK:       aten.op "aten.neg.default"(%a) {flops = 0 : i64, bytes = 64 : i64, duration_us = 3.000000e+00 : f64}
// CHECK-NOT:   fusion_group
func.func @block(%x: tensor<8x64xbf16>, %w: tensor<64x64xbf16>, %g: tensor<64xbf16>) -> tensor<8x64xbf16> {
  %0 = aten.op "aten._to_copy.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xf32>
  %1 = aten.op "aten.pow.Tensor_Scalar"(%0) args = {exponent = 2 : i64} : (tensor<8x64xf32>) -> tensor<8x64xf32>
  %2 = aten.op "aten.mean.dim"(%1) args = {dim = [-1 : i64], keepdim = true} : (tensor<8x64xf32>) -> tensor<8x1xf32>
  %3 = aten.op "aten.add.Scalar"(%2) args = {other = 1.0e-05 : f64} : (tensor<8x1xf32>) -> tensor<8x1xf32>
  %4 = aten.op "aten.rsqrt.default"(%3) : (tensor<8x1xf32>) -> tensor<8x1xf32>
  %5 = aten.op "aten.mul.Tensor"(%0, %4) : (tensor<8x64xf32>, tensor<8x1xf32>) -> tensor<8x64xf32>
  %6 = aten.op "aten._to_copy.default"(%5) : (tensor<8x64xf32>) -> tensor<8x64xbf16>
  %7 = aten.op "aten.mul.Tensor"(%6, %g) : (tensor<8x64xbf16>, tensor<64xbf16>) -> tensor<8x64xbf16>
  %8 = aten.op "aten.mm.default"(%7, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %9 = aten.op "aten.relu.default"(%8) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %10 = aten.op "aten.view.default"(%9) args = {size = [512 : i64]} : (tensor<8x64xbf16>) -> tensor<512xbf16>
  %11 = aten.op "aten.view.default"(%10) args = {size = [8 : i64, 64 : i64]} : (tensor<512xbf16>) -> tensor<8x64xbf16>
  %12 = aten.op "aten.add.Tensor"(%11, %x) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
  func.return %12 : tensor<8x64xbf16>
}
func.func @lone(%a: tensor<4x4xf16>, %b: tensor<4x4xf16>) -> tensor<4x4xf16> {
  %0 = aten.op "aten.neg.default"(%a) : (tensor<4x4xf16>) -> tensor<4x4xf16>
  %1 = aten.op "aten.mm.default"(%0, %b) : (tensor<4x4xf16>, tensor<4x4xf16>) -> tensor<4x4xf16>
  func.return %1 : tensor<4x4xf16>
}
