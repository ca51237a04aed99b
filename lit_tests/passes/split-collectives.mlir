// RUN: flint-opt %s -p 'split-collectives{bytes=512}' | filecheck %s
// RUN: flint-opt %s -p split-collectives 2>&1 | filecheck %s --check-prefix=NONE
// RUN: flint-opt %s -p 'bucket-collectives,split-collectives{bytes=1024}' | filecheck %s --check-prefix=ROUND
// RUN: not flint-opt %s -p 'split-collectives{bytes=0}' 2>&1 | filecheck %s --check-prefix=ZERO
// RUN: not flint-opt %s -p 'split-collectives{bytes=4}' 2>&1 | filecheck %s --check-prefix=TINY
// flint-opt verifies the module after every pass; these RUN lines fail if it does not verify.

shard.grid @mesh(shape = 4x2)

// CHECK-LABEL: func.func @grads
// ROUND-LABEL: func.func @grads
func.func @grads(%g: tensor<64x8xbf16>, %a: tensor<8x32xbf16>, %r: tensor<100xf32>) -> (tensor<16x8xbf16>, tensor<32x32xbf16>, tensor<100xf32>) {
  // A 1024-byte reduce-scatter: every rank's 256-byte slice is cut in two, so
  // piece i of each slice is reduced together.
  // CHECK:      %[[V:.*]] = aten.op "aten.view.default"(%g) args = {size = [4 : i64, 128 : i64]}
  // CHECK-NEXT: %[[P0:[^,]*]], %[[P1:[^ ]*]] = aten.op "aten.split_with_sizes_copy.default"(%[[V]]) args = {split_sizes = [64 : i64, 64 : i64], dim = 1 : i64}
  // CHECK-NEXT: %[[F0:.*]] = aten.op "aten.view.default"(%[[P0]]) args = {size = [256 : i64]}
  // CHECK-NEXT: %[[F1:.*]] = aten.op "aten.view.default"(%[[P1]]) args = {size = [256 : i64]}
  // CHECK-NEXT: %[[S0:.*]] = dist.reduce_scatter %[[F0]] on @mesh grid_axes = [0] scatter_dim = 0 {split_of = 2 : i64} : tensor<256xbf16> -> !dist.future<tensor<64xbf16>>
  // CHECK-NEXT: %[[S1:.*]] = dist.reduce_scatter %[[F1]] on @mesh grid_axes = [0] scatter_dim = 0 {split_of = 2 : i64} : tensor<256xbf16> -> !dist.future<tensor<64xbf16>>
  // A 512-byte all-gather shard fits: unchanged.
  // CHECK-NEXT: %[[AG:.*]] = dist.all_gather %a on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x32xbf16> -> !dist.future<tensor<32x32xbf16>>
  // CHECK-NEXT: %[[W0:.*]] = dist.wait %[[S0]] : tensor<64xbf16>
  // CHECK-NEXT: %[[W1:.*]] = dist.wait %[[S1]] : tensor<64xbf16>
  // CHECK-NEXT: %[[C:.*]] = aten.op "aten.cat.default"(%[[W0]], %[[W1]]) args = {dim = 0 : i64} : (tensor<64xbf16>, tensor<64xbf16>) -> tensor<128xbf16>
  // CHECK-NEXT: %[[GS:.*]] = aten.op "aten.view.default"(%[[C]]) args = {size = [16 : i64, 8 : i64]}
  // A synchronous 400-byte all-reduce fits too.
  // CHECK:      dist.all_reduce %r on @mesh grid_axes = [1] reduction = average : tensor<100xf32> -> tensor<100xf32>
  // After bucketing the two bf16 ones... they differ in kind: nothing fuses, and nothing exceeds 1024 bytes.
  // ROUND-NOT: split_of
  // ROUND-NOT: bucketed
  %0 = dist.reduce_scatter %g on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64x8xbf16> -> !dist.future<tensor<16x8xbf16>>
  %1 = dist.all_gather %a on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x32xbf16> -> !dist.future<tensor<32x32xbf16>>
  %gs = dist.wait %0 : tensor<16x8xbf16>
  %w = dist.wait %1 : tensor<32x32xbf16>
  %2 = dist.all_reduce %r on @mesh grid_axes = [1] reduction = average : tensor<100xf32> -> tensor<100xf32>
  func.return %gs, %w, %2 : tensor<16x8xbf16>, tensor<32x32xbf16>, tensor<100xf32>
}

// CHECK-LABEL: func.func @gather
func.func @gather(%a: tensor<8x64xbf16>, %x: tensor<4x64xbf16>) -> tensor<4x32xbf16> {
  // A 1024-byte shard in two gathers of 512, waited where the original was, copied back.
  // CHECK:      %[[F:.*]] = aten.op "aten.view.default"(%a) args = {size = [512 : i64]}
  // CHECK-NEXT: %[[P0:[^,]*]], %[[P1:[^ ]*]] = aten.op "aten.split_with_sizes.default"(%[[F]]) args = {split_sizes = [256 : i64, 256 : i64], dim = 0 : i64}
  // CHECK-NEXT: %[[S0:.*]] = dist.all_gather %[[P0]] on @mesh grid_axes = [0] gather_dim = 0 {split_of = 2 : i64} : tensor<256xbf16> -> !dist.future<tensor<1024xbf16>>
  // CHECK-NEXT: %[[S1:.*]] = dist.all_gather %[[P1]] on @mesh grid_axes = [0] gather_dim = 0 {split_of = 2 : i64}
  // CHECK-NEXT: aten.op "aten.neg.default"
  // CHECK-NEXT: %[[W0:.*]] = dist.wait %[[S0]] : tensor<1024xbf16>
  // CHECK-NEXT: %[[W1:.*]] = dist.wait %[[S1]] : tensor<1024xbf16>
  // CHECK-NEXT: %[[R0:.*]] = aten.op "aten.view.default"(%[[W0]]) args = {size = [4 : i64, 256 : i64]}
  // CHECK-NEXT: %[[R1:.*]] = aten.op "aten.view.default"(%[[W1]]) args = {size = [4 : i64, 256 : i64]}
  // CHECK-NEXT: %[[C:.*]] = aten.op "aten.cat.default"(%[[R0]], %[[R1]]) args = {dim = 1 : i64} : (tensor<4x256xbf16>, tensor<4x256xbf16>) -> tensor<4x512xbf16>
  // CHECK-NEXT: %[[G:.*]] = aten.op "aten.view.default"(%[[C]]) args = {size = [32 : i64, 64 : i64]}
  // CHECK-NEXT: aten.op "aten.t.default"(%[[G]])
  %0 = dist.all_gather %a on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x64xbf16> -> !dist.future<tensor<32x64xbf16>>
  %n = aten.op "aten.neg.default"(%x) : (tensor<4x64xbf16>) -> tensor<4x64xbf16>
  %w = dist.wait %0 : tensor<32x64xbf16>
  %wt = aten.op "aten.t.default"(%w) : (tensor<32x64xbf16>) -> tensor<64x32xbf16>
  %y = aten.op "aten.mm.default"(%n, %wt) : (tensor<4x64xbf16>, tensor<64x32xbf16>) -> tensor<4x32xbf16>
  func.return %y : tensor<4x32xbf16>
}

// NONE: split-collectives: note: nothing to split: no all_reduce, all_gather or reduce_scatter has more than 26214400 input bytes; the module is unchanged
// NONE-NOT: split_of
// ZERO: flint-opt: error: split-collectives: option bytes must be a positive number of bytes, got 0
// TINY: split-collectives.mlir:{{[0-9]+}}:3: error: split-collectives: bytes=4 is smaller than one element (8 bytes) of 'dist.reduce_scatter' in @grads
