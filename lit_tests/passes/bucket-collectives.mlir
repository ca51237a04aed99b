// RUN: flint-opt %s -p bucket-collectives | filecheck %s
// RUN: flint-opt %s -p 'bucket-collectives{bytes=3072}' | filecheck %s --check-prefix=SMALL
// RUN: flint-opt %s -p 'bucket-collectives{bytes=500}' 2>&1 | filecheck %s --check-prefix=NONE
// RUN: not flint-opt %s -p 'bucket-collectives{bytes=0}' 2>&1 | filecheck %s --check-prefix=ZERO
// RUN: not flint-opt %s -p 'bucket-collectives{bytes=-8}' 2>&1 | filecheck %s --check-prefix=NEG
// flint-opt verifies the module after every pass; these RUN lines fail if it does not verify.

shard.grid @mesh(shape = 4x2)

// DDP: gradient all-reduces issued as each gradient is ready. One bucket is
// issued once its last gradient is ready, and waited where the first was.
// CHECK-LABEL: func.func @ddp_grads
// SMALL-LABEL: func.func @ddp_grads
func.func @ddp_grads(%x: tensor<32x8xbf16>, %dy: tensor<8x32xbf16>, %g0: tensor<32x16xbf16>) -> (tensor<32x32xbf16>, tensor<32x16xbf16>, tensor<32x32xbf16>) {
  // CHECK:      %[[G1:.*]] = aten.op "aten.mm.default"
  // CHECK-NEXT: %[[G2:.*]] = aten.op "aten.mm.default"
  // CHECK-NEXT: %[[F1:.*]] = aten.op "aten.view.default"(%[[G1]]) args = {size = [1024 : i64]} : (tensor<32x32xbf16>) -> tensor<1024xbf16>
  // CHECK-NEXT: %[[F0:.*]] = aten.op "aten.view.default"(%g0) args = {size = [512 : i64]} : (tensor<32x16xbf16>) -> tensor<512xbf16>
  // CHECK-NEXT: %[[F2:.*]] = aten.op "aten.view.default"(%[[G2]]) args = {size = [1024 : i64]}
  // CHECK-NEXT: %[[B:.*]] = aten.op "aten.cat.default"(%[[F1]], %[[F0]], %[[F2]]) args = {dim = 0 : i64} : (tensor<1024xbf16>, tensor<512xbf16>, tensor<1024xbf16>) -> tensor<2560xbf16>
  // CHECK-NEXT: %[[S:.*]] = dist.all_reduce %[[B]] on @mesh grid_axes = [0] reduction = average {bucketed = 3 : i64} : tensor<2560xbf16> -> !dist.future<tensor<2560xbf16>>
  // CHECK-NEXT: %[[W:.*]] = dist.wait %[[S]] : tensor<2560xbf16>
  // CHECK-NEXT: %[[P0:[^,]*]], %[[P1:[^,]*]], %[[P2:[^ ]*]] = aten.op "aten.split_with_sizes.default"(%[[W]]) args = {split_sizes = [1024 : i64, 512 : i64, 1024 : i64], dim = 0 : i64}
  // CHECK-NEXT: %[[R1:.*]] = aten.op "aten.view.default"(%[[P0]]) args = {size = [32 : i64, 32 : i64]}
  // CHECK-NEXT: %[[R0:.*]] = aten.op "aten.view.default"(%[[P1]]) args = {size = [32 : i64, 16 : i64]}
  // CHECK-NEXT: %[[R2:.*]] = aten.op "aten.view.default"(%[[P2]]) args = {size = [32 : i64, 32 : i64]}
  // CHECK-NEXT: func.return %[[R1]], %[[R0]], %[[R2]]
  // 3072 bytes: the first two (2048 + 1024 bytes) fit together; the third stays alone.
  // SMALL:      aten.op "aten.cat.default"(%{{.*}}, %{{.*}}) args = {dim = 0 : i64} : (tensor<1024xbf16>, tensor<512xbf16>) -> tensor<1536xbf16>
  // SMALL-NEXT: dist.all_reduce %{{.*}} {bucketed = 2 : i64} : tensor<1536xbf16> -> !dist.future<tensor<1536xbf16>>
  // SMALL:      dist.all_reduce %g2 on @mesh grid_axes = [0] reduction = average : tensor<32x32xbf16> -> !dist.future<tensor<32x32xbf16>>
  %g1 = aten.op "aten.mm.default"(%x, %dy) phase = "bwd" module = "l1" : (tensor<32x8xbf16>, tensor<8x32xbf16>) -> tensor<32x32xbf16>
  %0 = dist.all_reduce %g1 on @mesh grid_axes = [0] reduction = average : tensor<32x32xbf16> -> !dist.future<tensor<32x32xbf16>>
  %1 = dist.all_reduce %g0 on @mesh grid_axes = [0] reduction = average : tensor<32x16xbf16> -> !dist.future<tensor<32x16xbf16>>
  %g2 = aten.op "aten.mm.default"(%x, %dy) phase = "bwd" module = "l2" : (tensor<32x8xbf16>, tensor<8x32xbf16>) -> tensor<32x32xbf16>
  %2 = dist.all_reduce %g2 on @mesh grid_axes = [0] reduction = average : tensor<32x32xbf16> -> !dist.future<tensor<32x32xbf16>>
  %r1 = dist.wait %0 : tensor<32x32xbf16>
  %r0 = dist.wait %1 : tensor<32x16xbf16>
  %r2 = dist.wait %2 : tensor<32x32xbf16>
  func.return %r1, %r0, %r2 : tensor<32x32xbf16>, tensor<32x16xbf16>, tensor<32x32xbf16>
}

// FSDP: one parameter group's gathers become one gather of the flattened
// shards (FSDP2's copy-in), copied out per parameter.
// CHECK-LABEL: func.func @fsdp_group
func.func @fsdp_group(%wq: tensor<8x32xbf16>, %wk: tensor<4x32xbf16>, %x: tensor<8x32xbf16>) -> (tensor<8x32xbf16>, tensor<8x16xbf16>) {
  // CHECK:      %[[C:.*]] = aten.op "aten.cat.default"(%{{.*}}, %{{.*}}) args = {dim = 0 : i64} : (tensor<256xbf16>, tensor<128xbf16>) -> tensor<384xbf16>
  // CHECK-NEXT: %[[S:.*]] = dist.all_gather %[[C]] on @mesh grid_axes = [0] gather_dim = 0 {bucketed = 2 : i64} : tensor<384xbf16> -> !dist.future<tensor<1536xbf16>>
  // CHECK-NEXT: %[[W:.*]] = dist.wait %[[S]] : tensor<1536xbf16>
  // CHECK-NEXT: %[[V:.*]] = aten.op "aten.view.default"(%[[W]]) args = {size = [4 : i64, 384 : i64]}
  // CHECK-NEXT: %[[P0:[^,]*]], %[[P1:[^ ]*]] = aten.op "aten.split_with_sizes_copy.default"(%[[V]]) args = {split_sizes = [256 : i64, 128 : i64], dim = 1 : i64} : (tensor<4x384xbf16>) -> (tensor<4x256xbf16>, tensor<4x128xbf16>)
  // CHECK-NEXT: %[[Q:.*]] = aten.op "aten.view.default"(%[[P0]]) args = {size = [32 : i64, 32 : i64]}
  // CHECK-NEXT: %[[K:.*]] = aten.op "aten.view.default"(%[[P1]]) args = {size = [16 : i64, 32 : i64]}
  // CHECK-NEXT: aten.op "aten.mm.default"(%x, %[[Q]])
  %0 = dist.all_gather %wq on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x32xbf16> -> !dist.future<tensor<32x32xbf16>>
  %q = dist.wait %0 : tensor<32x32xbf16>
  %1 = dist.all_gather %wk on @mesh grid_axes = [0] gather_dim = 0 : tensor<4x32xbf16> -> !dist.future<tensor<16x32xbf16>>
  %k = dist.wait %1 : tensor<16x32xbf16>
  %yq = aten.op "aten.mm.default"(%x, %q) phase = "fwd" : (tensor<8x32xbf16>, tensor<32x32xbf16>) -> tensor<8x32xbf16>
  %kt = aten.op "aten.t.default"(%k) phase = "fwd" : (tensor<16x32xbf16>) -> tensor<32x16xbf16>
  %yk = aten.op "aten.mm.default"(%x, %kt) phase = "fwd" : (tensor<8x32xbf16>, tensor<32x16xbf16>) -> tensor<8x16xbf16>
  func.return %yq, %yk : tensor<8x32xbf16>, tensor<8x16xbf16>
}

// Left alone: different reductions, a barrier in between, a gather along dim 1,
// and a gather whose result is used before the next gather's input exists.
// CHECK-LABEL: func.func @incompatible
// CHECK-NOT: bucketed
// CHECK: func.return
func.func @incompatible(%a: tensor<16xf32>, %b: tensor<16xf32>, %c: tensor<4x8xf32>, %d: tensor<4x8xf32>) -> (tensor<16xf32>, tensor<16xf32>, tensor<16xf32>, tensor<16xf32>, tensor<4x32xf32>, tensor<16x8xf32>, tensor<16x8xf32>) {
  %0 = dist.all_reduce %a on @mesh grid_axes = [0] reduction = sum : tensor<16xf32> -> tensor<16xf32>
  %1 = dist.all_reduce %b on @mesh grid_axes = [0] reduction = max : tensor<16xf32> -> tensor<16xf32>
  dist.barrier on @mesh grid_axes = [0]
  %2 = dist.all_reduce %a on @mesh grid_axes = [0] reduction = max : tensor<16xf32> -> tensor<16xf32>
  %3 = dist.all_reduce %b on @mesh grid_axes = [1] reduction = max : tensor<16xf32> -> tensor<16xf32>
  %4 = dist.all_gather %c on @mesh grid_axes = [0] gather_dim = 1 : tensor<4x8xf32> -> tensor<4x32xf32>
  %5 = dist.all_gather %c on @mesh grid_axes = [0] gather_dim = 0 : tensor<4x8xf32> -> tensor<16x8xf32>
  %6 = aten.op "aten.slice.Tensor"(%5) args = {dim = 0 : i64, start = 0 : i64, end = 4 : i64} : (tensor<16x8xf32>) -> tensor<4x8xf32>
  %7 = dist.all_gather %6 on @mesh grid_axes = [0] gather_dim = 0 : tensor<4x8xf32> -> tensor<16x8xf32>
  func.return %0, %1, %2, %3, %4, %5, %7 : tensor<16xf32>, tensor<16xf32>, tensor<16xf32>, tensor<16xf32>, tensor<4x32xf32>, tensor<16x8xf32>, tensor<16x8xf32>
}

// NONE: bucket-collectives: note: nothing to bucket: no two consecutive compatible collectives fit in 500 bytes
// NONE-SAME: 'dist.all_gather' gathers along dim 1 (packing needs gather_dim = 0, FSDP's Shard(0))
// NONE-SAME: the module is unchanged
// NONE-NOT: bucketed
// ZERO: flint-opt: error: bucket-collectives: option bytes must be a positive number of bytes, got 0
// NEG: flint-opt: error: bucket-collectives: option bytes must be a positive number of bytes, got -8
