// RUN: flint-opt %s -p 'lower-to-chakra{class-times=true}' | filecheck %s
// RUN: flint-opt %s -p 'fuse-pointwise,lower-to-chakra{class-times=true}' | filecheck %s --check-prefix=FUSED
// RUN: flint-opt %s -p 'lower-to-chakra{class-times=true merge-compute=false}' | filecheck %s --check-prefix=SEPARATE
// RUN: flint-opt %s -p lower-to-chakra | filecheck %s --check-prefix=PLAIN
// RUN: flint-opt %s -p 'lower-to-chakra{class-times=true}' | flint-opt | filecheck %s
// flint-opt verifies the module after every pass.

// class-times=true: every compute node also says what it holds per op class, [time_us : f64,
// array<i64: FLOPs, bytes, kernels>] (flint estimate's breakdown, flint/sim/breakdown.py). The merged node of mm, relu and mul holds
// one GEMM and two elementwise kernels; fused by fuse-pointwise, relu and mul are one fused kernel.

shard.grid @mesh(shape = 2)

func.func @step(%x: tensor<64x64xbf16> {flint.role = "input"}, %w: tensor<64x64xbf16> {flint.role = "parameter"}) -> tensor<64x64xbf16> {
  %0 = aten.op "aten.mm.default"(%x, %w) : (tensor<64x64xbf16>, tensor<64x64xbf16>) -> tensor<64x64xbf16>
  %1 = aten.op "aten.relu.default"(%0) : (tensor<64x64xbf16>) -> tensor<64x64xbf16>
  %2 = aten.op "aten.mul.Tensor"(%1, %x) : (tensor<64x64xbf16>, tensor<64x64xbf16>) -> tensor<64x64xbf16>
  %3 = dist.all_reduce %2 on @mesh grid_axes = [0] : tensor<64x64xbf16> -> tensor<64x64xbf16>
  %4 = aten.op "aten.exp.default"(%3) : (tensor<64x64xbf16>) -> tensor<64x64xbf16>
  func.return %4 : tensor<64x64xbf16>
}

// CHECK:      chakra.comp "aten.mm.default +2" flops = 524288 bytes = 65536 duration_us = 11.559009
// CHECK-SAME: {flint.class_times = {gemm = [5.55900{{[0-9]*}} : f64, array<i64: 524288, 24576, 1>], elementwise = [6.000000e+00 : f64, array<i64: 0, 40960, 2>]}}
// CHECK-NEXT: chakra.coll all_reduce
// CHECK-NEXT: chakra.comp "aten.exp.default" {{.*}} {flint.class_times = {elementwise = [3.000000e+00 : f64, array<i64: 0, 16384, 1>]}}

// FUSED:      chakra.comp "aten.mm.default +1"
// FUSED-SAME: {flint.class_times = {gemm = [5.55900{{[0-9]*}} : f64, array<i64: 524288, 24576, 1>], "fused pointwise" = [3.000000e+00 : f64, array<i64: 0, 24576, 1>]}}

// SEPARATE:      chakra.comp "aten.mm.default" {{.*}} {flint.class_times = {gemm = [5.55900{{[0-9]*}} : f64, array<i64: 524288, 24576, 1>]}}
// SEPARATE-NEXT: chakra.comp "aten.relu.default" {{.*}} {flint.class_times = {elementwise = [3.000000e+00 : f64, array<i64: 0, 16384, 1>]}}
// SEPARATE-NEXT: chakra.comp "aten.mul.Tensor" {{.*}} {flint.class_times = {elementwise = [3.000000e+00 : f64, array<i64: 0, 24576, 1>]}}

// PLAIN-NOT: flint.class_times
