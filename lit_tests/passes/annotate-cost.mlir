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

// gather's backward: new_zeros + a functional scatter_add that nothing else reads the target of runs
// in place, as eager PyTorch's scatter_add_ (ATen gather_backward): it reads 64 int64 indices and 64 f32
// sources and read-modify-writes the 64 f32 elements they hit: 64*8 + 64*4 + 2*64*4 = 1280 bytes, not a
// copy of the 64x1024 f32 target (2 x 262144 bytes).
// CHECK-LABEL: func.func @gather_bwd
// CHECK: aten.op "aten.scatter_add.default"(%{{.*}}, %idx, %src) args = {dim = 1 : i64} {flops = 0 : i64, bytes = 1280 : i64
func.func @gather_bwd(%idx: tensor<64x1xi64>, %src: tensor<64x1xf32>) -> tensor<64x1024xf32> {
  %0 = aten.op "aten.new_zeros.default"(%src) args = {size = [64 : i64, 1024 : i64]} : (tensor<64x1xf32>) -> tensor<64x1024xf32>
  %1 = aten.op "aten.scatter_add.default"(%0, %idx, %src) args = {dim = 1 : i64} : (tensor<64x1024xf32>, tensor<64x1xi64>, tensor<64x1xf32>) -> tensor<64x1024xf32>
  func.return %1 : tensor<64x1024xf32>
}

// A target read again afterwards (here: returned) is copied: all operands and the result,
// 2*262144 + 512 + 256 = 525056 bytes. So is a function argument (the caller may read it).
// CHECK-LABEL: func.func @scatter_keeps_target
// CHECK: aten.op "aten.scatter_add.default"(%{{.*}}, %idx, %src) args = {dim = 1 : i64} {flops = 0 : i64, bytes = 525056 : i64
// CHECK: aten.op "aten.scatter_add.default"(%t, %idx, %src) args = {dim = 1 : i64} {flops = 0 : i64, bytes = 525056 : i64
func.func @scatter_keeps_target(%t: tensor<64x1024xf32>, %idx: tensor<64x1xi64>, %src: tensor<64x1xf32>) -> (tensor<64x1024xf32>, tensor<64x1024xf32>, tensor<64x1024xf32>) {
  %0 = aten.op "aten.new_zeros.default"(%src) args = {size = [64 : i64, 1024 : i64]} : (tensor<64x1xf32>) -> tensor<64x1024xf32>
  %1 = aten.op "aten.scatter_add.default"(%0, %idx, %src) args = {dim = 1 : i64} : (tensor<64x1024xf32>, tensor<64x1xi64>, tensor<64x1xf32>) -> tensor<64x1024xf32>
  %2 = aten.op "aten.scatter_add.default"(%t, %idx, %src) args = {dim = 1 : i64} : (tensor<64x1024xf32>, tensor<64x1xi64>, tensor<64x1xf32>) -> tensor<64x1024xf32>
  func.return %0, %1, %2 : tensor<64x1024xf32>, tensor<64x1024xf32>, tensor<64x1024xf32>
}
