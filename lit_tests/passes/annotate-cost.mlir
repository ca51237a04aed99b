// RUN: flint-opt %s -p annotate-cost | filecheck %s
// RUN: flint-opt %s -p 'annotate-cost{device=a100-80gb}' | filecheck %s --check-prefix=A100
// flint-opt verifies the module after every pass.

// 2*8*64*64 = 65536 FLOPs; bytes = (8*64 + 64*64 + 8*64) * 2 = 10240.
// CHECK: aten.op "aten.mm.default"(%{{.*}}, %{{.*}}) {flops = 65536 : i64, bytes = 10240 : i64, duration_us = [[D:.*]] : f64}
// A100: aten.op "aten.mm.default"(%{{.*}}, %{{.*}}) {flops = 65536 : i64, bytes = 10240 : i64, duration_us = {{.*}} : f64}
// A view moves nothing.
// CHECK: aten.op "aten.view.default"(%{{.*}}) args = {size = [512 : i64]} {flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64}
func.func @f(%x: tensor<8x64xbf16>, %w: tensor<64x64xbf16>) -> tensor<512xbf16> {
  %0 = aten.op "aten.mm.default"(%x, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %1 = aten.op "aten.view.default"(%0) args = {size = [512 : i64]} : (tensor<8x64xbf16>) -> tensor<512xbf16>
  func.return %1 : tensor<512xbf16>
}
