// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=1},shard-expand' | filecheck %s --check-prefix=Z1
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=2},shard-expand' | filecheck %s --check-prefix=Z2
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=3},shard-expand' | filecheck %s --check-prefix=Z3
// The ZeRO stages of dp_shard on a two-matmul MLP block with its AdamW step (forward, backward,
// optimizer), one RUN line per stage:
//   ZeRO-1 (DDP + ZeroRedundancyOptimizer): whole parameters and gradients; DDP all-reduces (averages)
//          the gradients; each rank steps its shard of every parameter (sharded exp_avg / exp_avg_sq),
//          then the updated shards are all-gathered back into the whole parameters.
//   ZeRO-2 (FSDP2 reshard_after_forward=False): one unit all-gather in forward, none in backward (the
//          gathered parameters are kept), gradients reduce-scattered, optimizer on shards.
//   ZeRO-3 (FSDP2): gathered in forward and again in backward, gradients reduce-scattered.

// Z1:      func.func @block_fwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<32x16xf32> {{.*}}, %w2: tensor<16x32xf32>
// Z1-NOT:  {{= dist\.(all|reduce)}}
// Z1:      func.func @block_bwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<32x16xf32> {{.*}}, %w2: tensor<16x32xf32>
// Z1:      dist.all_reduce %{{.*}} on @mesh grid_axes = [0] reduction = average : tensor<1024xf32>
// Z1-NOT:  {{= dist\.(all|reduce)}}
// Z1:      func.func @block_optim(%w1: tensor<32x16xf32> {{.*}}, %w2: tensor<16x32xf32> {{.*}}, %g1: tensor<32x16xf32> {{.*}}, %g2: tensor<16x32xf32> {{.*}}, %m1: tensor<16x16xf32> {{.*}}, %m2: tensor<8x32xf32> {{.*}}, %v1: tensor<16x16xf32> {{.*}}, %v2: tensor<8x32xf32>
// Z1:      %[[P1:.*]] = aten.op "aten.slice.Tensor"(%w1) args = {dim = 0 : i64, start = 0 : i64, end = 16 : i64}
// Z1:      aten.op "aten.mul_.Tensor"(%[[P1]]) {{.*}} : (tensor<16x16xf32>) -> tensor<16x16xf32>
// Z1:      %[[U1:.*]] = aten.op "aten.addcdiv_.default"{{.*}} -> tensor<16x16xf32>
// Z1:      %[[U2:.*]] = aten.op "aten.addcdiv_.default"{{.*}} -> tensor<8x32xf32>
// Z1:      dist.all_gather %{{.*}} on @mesh grid_axes = [0] gather_dim = 0 : tensor<512xf32> -> !dist.future<tensor<1024xf32>>
// Z1:      aten.op "aten.copy_.default"(%w1, %{{.*}}) : (tensor<32x16xf32>, tensor<32x16xf32>)
// Z1:      aten.op "aten.copy_.default"(%w2, %{{.*}}) : (tensor<16x32xf32>, tensor<16x32xf32>)

// Z2:      func.func @block_fwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<16x16xf32> {{.*}}, %w2: tensor<8x32xf32>
// Z2:      dist.all_gather %{{.*}} grid_axes = [0] gather_dim = 0 : tensor<512xf32> -> !dist.future<tensor<1024xf32>>
// Z2-NOT:  {{= dist\.(all|reduce)}}
// Z2:      func.func @block_bwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<32x16xf32> {{.*}}, %w2: tensor<16x32xf32>
// Z2-NOT:  dist.all_gather
// Z2:      dist.reduce_scatter %{{.*}} grid_axes = [0] scatter_dim = 0 : tensor<1024xf32> -> !dist.future<tensor<512xf32>>
// Z2-NOT:  {{= dist\.(all|reduce)}}
// Z2:      func.func @block_optim(%w1: tensor<16x16xf32> {{.*}}, %w2: tensor<8x32xf32> {{.*}}, %g1: tensor<16x16xf32> {{.*}}, %g2: tensor<8x32xf32> {{.*}}, %m1: tensor<16x16xf32>
// Z2-NOT:  {{= dist\.(all|reduce)}}

// Z3:      func.func @block_fwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<16x16xf32>
// Z3:      dist.all_gather %{{.*}} tensor<512xf32> -> !dist.future<tensor<1024xf32>>
// Z3:      func.func @block_bwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<16x16xf32>
// Z3:      dist.all_gather %{{.*}} tensor<512xf32> -> !dist.future<tensor<1024xf32>>
// Z3:      dist.reduce_scatter %{{.*}} tensor<1024xf32> -> !dist.future<tensor<512xf32>>
// Z3:      func.func @block_optim(%w1: tensor<16x16xf32>
// Z3-NOT:  {{= dist\.(all|reduce)}}

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64], ["block_optim", 2 : i64]]} {
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
  func.func @block_optim(%w1: tensor<32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %g1: tensor<32x16xf32> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w1.weight"}, %g2: tensor<16x32xf32> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w2.weight"}, %m1: tensor<32x16xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w1.weight"}, %m2: tensor<16x32xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w2.weight"}, %v1: tensor<32x16xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w1.weight"}, %v2: tensor<16x32xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w2.weight"}, %step: tensor<f32> {flint.role = "step"}) {
    %0 = aten.op "aten.mul_.Tensor"(%w1) phase = "optim" args = {other = 9.999700e-01 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %1 = aten.op "aten.lerp_.Scalar"(%m1, %g1) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %2 = aten.op "aten.mul_.Tensor"(%v1) phase = "optim" args = {other = 9.500000e-01 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %3 = aten.op "aten.addcmul_.default"(%2, %g1, %g1) phase = "optim" args = {value = 5.000000e-02 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %4 = aten.op "aten.sqrt.default"(%3) phase = "optim" : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %5 = aten.op "aten.add_.Tensor"(%4) phase = "optim" args = {other = 1.000000e-08 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %6 = aten.op "aten.addcdiv_.default"(%0, %1, %5) phase = "optim" args = {value = -3.000000e-04 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %10 = aten.op "aten.mul_.Tensor"(%w2) phase = "optim" args = {other = 9.999700e-01 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %11 = aten.op "aten.lerp_.Scalar"(%m2, %g2) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %12 = aten.op "aten.mul_.Tensor"(%v2) phase = "optim" args = {other = 9.500000e-01 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %13 = aten.op "aten.addcmul_.default"(%12, %g2, %g2) phase = "optim" args = {value = 5.000000e-02 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %14 = aten.op "aten.sqrt.default"(%13) phase = "optim" : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %15 = aten.op "aten.add_.Tensor"(%14) phase = "optim" args = {other = 1.000000e-08 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %16 = aten.op "aten.addcdiv_.default"(%10, %11, %15) phase = "optim" args = {value = -3.000000e-04 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    func.return
  }
}
