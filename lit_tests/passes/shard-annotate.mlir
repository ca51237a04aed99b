// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 tp=2}' | filecheck %s
// RUN: flint-opt %s -p 'shard-annotate{tp=2 sp=true}' | filecheck %s --check-prefix=SP
// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2}' | filecheck %s --check-prefix=DP

// CHECK:      flint.plan = {dp_shard = 2 : i64, tp = 2 : i64, world_size = 4 : i64}
// CHECK:      shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard", "tp"]}
// CHECK:      func.func @block_fwd
// CHECK-NEXT: %[[S0:.*]] = shard.sharding @mesh split_axes = {{\[}}[0], [], []] : !shard.sharding
// CHECK-NEXT: %[[X:.*]] = shard.shard %x to %[[S0]] : tensor<4x8x16xf32>
// CHECK-NEXT: %[[S1:.*]] = shard.sharding @mesh split_axes = {{\[}}[0, 1], []] : !shard.sharding
// CHECK-NEXT: %[[W1:.*]] = shard.shard %w1 to %[[S1]] : tensor<32x16xf32>
// CHECK-NEXT: %[[S2:.*]] = shard.sharding @mesh split_axes = {{\[}}[1], []] : !shard.sharding
// CHECK-NEXT: %[[W1C:.*]] = shard.shard %[[W1]] to %[[S2]] annotate_for_users : tensor<32x16xf32>
// CHECK-NEXT: %[[S3:.*]] = shard.sharding @mesh split_axes = {{\[}}[0], [1]] : !shard.sharding
// CHECK:      aten.op "aten.t.default"(%[[W1C]])
// CHECK:      func.return %{{.*}}, %x, %w1, %w2,
// CHECK:      func.func @block_bwd
// CHECK:      shard.shard %{{.*}} to %{{.*}} {flint.param = "layers.0.feed_forward.w1.weight"} : tensor<32x16xf32>

// SP:      shard.grid @mesh(shape = 2) {flint.axis_names = ["tp"]}
// SP:      func.func @block_fwd
// SP-NEXT: shard.sharding @mesh split_axes = {{\[}}[], [0], []]
// SP-NEXT: shard.shard %x

// DP:      shard.grid @mesh(shape = 2) {flint.axis_names = ["dp_replicate"]}
// DP-NEXT: func.func @block_fwd
// DP-NEXT: shard.sharding @mesh split_axes = {{\[}}[0], [], []]
// DP-NEXT: shard.shard %x
// DP-NEXT: shard.sharding @mesh split_axes = {{\[}}[], []]

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<4x8x16xf32> {flint.role = "activation"}, %w1: tensor<32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}) -> (tensor<4x8x16xf32>, tensor<4x8x16xf32>, tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<32x32xf32>, tensor<32x32xf32>) {
    %0 = aten.op "aten.t.default"(%w1) phase = "fwd" module = "feed_forward.w1" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %1 = aten.op "aten.view.default"(%x) phase = "fwd" module = "feed_forward.w1" args = {size = [32 : i64, 16 : i64]} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
    %2 = aten.op "aten.mm.default"(%1, %0) phase = "fwd" module = "feed_forward.w1" : (tensor<32x16xf32>, tensor<16x32xf32>) -> tensor<32x32xf32>
    %3 = aten.op "aten.silu.default"(%2) phase = "fwd" module = "feed_forward" : (tensor<32x32xf32>) -> tensor<32x32xf32>
    %4 = aten.op "aten.t.default"(%w2) phase = "fwd" module = "feed_forward.w2" : (tensor<16x32xf32>) -> tensor<32x16xf32>
    %5 = aten.op "aten.mm.default"(%3, %4) phase = "fwd" module = "feed_forward.w2" : (tensor<32x32xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %6 = aten.op "aten._unsafe_view.default"(%5) phase = "fwd" module = "feed_forward.w2" args = {size = [4 : i64, 8 : i64, 16 : i64]} : (tensor<32x16xf32>) -> tensor<4x8x16xf32>
    %7 = aten.op "aten.add.Tensor"(%x, %6) phase = "fwd" : (tensor<4x8x16xf32>, tensor<4x8x16xf32>) -> tensor<4x8x16xf32>
    func.return %7, %x, %w1, %w2, %1, %3, %2 : tensor<4x8x16xf32>, tensor<4x8x16xf32>, tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<32x32xf32>, tensor<32x32xf32>
  }
  func.func @block_bwd(%x: tensor<4x8x16xf32> {flint.role = "activation"}, %w1: tensor<32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %v: tensor<32x16xf32> {flint.role = "saved"}, %h: tensor<32x32xf32> {flint.role = "saved"}, %m: tensor<32x32xf32> {flint.role = "saved"}, %g: tensor<4x8x16xf32> {flint.role = "tangent"}) -> (tensor<4x8x16xf32>, tensor<32x16xf32>, tensor<16x32xf32>) {
    %0 = aten.op "aten.view.default"(%g) phase = "bwd" args = {size = [32 : i64, 16 : i64]} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
    %1 = aten.op "aten.t.default"(%0) phase = "bwd" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %2 = aten.op "aten.mm.default"(%1, %h) phase = "bwd" : (tensor<16x32xf32>, tensor<32x32xf32>) -> tensor<16x32xf32>
    %3 = aten.op "aten.t.default"(%w2) phase = "bwd" : (tensor<16x32xf32>) -> tensor<32x16xf32>
    %4 = aten.op "aten.t.default"(%3) phase = "bwd" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %5 = aten.op "aten.mm.default"(%0, %4) phase = "bwd" : (tensor<32x16xf32>, tensor<16x32xf32>) -> tensor<32x32xf32>
    %6 = aten.op "aten.silu_backward.default"(%5, %m) phase = "bwd" : (tensor<32x32xf32>, tensor<32x32xf32>) -> tensor<32x32xf32>
    %7 = aten.op "aten.t.default"(%6) phase = "bwd" : (tensor<32x32xf32>) -> tensor<32x32xf32>
    %8 = aten.op "aten.mm.default"(%7, %v) phase = "bwd" : (tensor<32x32xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %9 = aten.op "aten.t.default"(%w1) phase = "bwd" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %10 = aten.op "aten.t.default"(%9) phase = "bwd" : (tensor<16x32xf32>) -> tensor<32x16xf32>
    %11 = aten.op "aten.mm.default"(%6, %10) phase = "bwd" : (tensor<32x32xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %12 = aten.op "aten.view.default"(%11) phase = "bwd" args = {size = [4 : i64, 8 : i64, 16 : i64]} : (tensor<32x16xf32>) -> tensor<4x8x16xf32>
    %13 = aten.op "aten.add.Tensor"(%g, %12) phase = "bwd" : (tensor<4x8x16xf32>, tensor<4x8x16xf32>) -> tensor<4x8x16xf32>
    func.return %13, %8, %2 : tensor<4x8x16xf32>, tensor<32x16xf32>, tensor<16x32xf32>
  }
}
