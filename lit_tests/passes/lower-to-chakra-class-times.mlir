// RUN: flint-opt %s -p 'lower-to-chakra{class-times=true}' | filecheck %s
// RUN: flint-opt %s -p 'fuse-pointwise,lower-to-chakra{class-times=true}' | filecheck %s --check-prefix=FUSED
// RUN: flint-opt %s -p 'lower-to-chakra{class-times=true merge-compute=false}' | filecheck %s --check-prefix=SEPARATE
// RUN: flint-opt %s -p lower-to-chakra | filecheck %s --check-prefix=PLAIN
// flint-opt verifies the module after every pass.

// class-times=true: every compute node also says what it holds per op class, [time_us, FLOPs, bytes,
// kernels] (flint estimate's breakdown, flint/sim/breakdown.py). The merged node of mm, relu and mul holds
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
// CHECK-SAME: {flint.class_times = {gemm = array<f64: 5.55900{{[0-9]*}}, 5.242880e+05, 2.457600e+04, 1.000000e+00>, elementwise = array<f64: 6.000000e+00, 0.000000e+00, 4.096000e+04, 2.000000e+00>}}
// CHECK-NEXT: chakra.coll all_reduce
// CHECK-NEXT: chakra.comp "aten.exp.default" {{.*}} {flint.class_times = {elementwise = array<f64: 3.000000e+00, 0.000000e+00, 1.638400e+04, 1.000000e+00>}}

// FUSED:      chakra.comp "aten.mm.default +1"
// FUSED-SAME: {flint.class_times = {gemm = array<f64: 5.55900{{[0-9]*}}, 5.242880e+05, 2.457600e+04, 1.000000e+00>, "fused pointwise" = array<f64: 3.000000e+00, 0.000000e+00, 2.457600e+04, 1.000000e+00>}}

// SEPARATE:      chakra.comp "aten.mm.default" {{.*}} {flint.class_times = {gemm = array<f64: 5.55900{{[0-9]*}}, 5.242880e+05, 2.457600e+04, 1.000000e+00>}}
// SEPARATE-NEXT: chakra.comp "aten.relu.default" {{.*}} {flint.class_times = {elementwise = array<f64: 3.000000e+00, 0.000000e+00, 1.638400e+04, 1.000000e+00>}}
// SEPARATE-NEXT: chakra.comp "aten.mul.Tensor" {{.*}} {flint.class_times = {elementwise = array<f64: 3.000000e+00, 0.000000e+00, 2.457600e+04, 1.000000e+00>}}

// PLAIN-NOT: flint.class_times
