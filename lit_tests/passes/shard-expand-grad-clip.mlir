// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2},shard-expand' | filecheck %s --check-prefix=FSDP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 tp=2},shard-expand' | filecheck %s --check-prefix=TP
// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2},shard-expand' | filecheck %s --check-prefix=DDP
// flint-opt verifies the module after every pass.
// Gradient-norm clipping (plan field max_norm) on the planned path: the MLP block of shard-expand-zero.mlir,
// captured on one device with clipping. After the backward, @block_norm folds the norms of the block's
// gradients into the running total (role grad_norm), @grad_clip turns the total into the scaling coefficient
// (role clip_coef) and @block_optim scales its gradients by it before the AdamW step. shard-expand keeps each
// norm a norm of this rank's local shard (torch's clip_grad_norm_ on DTensors: a p-norm partial) and makes the
// total global in @grad_clip: over each mesh axis the gradients are split on, in mesh order, the squared total
// all-reduced and its square root taken, as the captured path runs it.
//   FSDP (dp_shard 2): the norms read 16x16 and 8x32 shards; one all-reduce over dp_shard.
//   dp_shard 2 x tp 2: w1 split on its rows by tp, w2 on its columns, both then on dim 0 by dp_shard;
//                      all-reduces over dp_shard, then tp.
//   dp_replicate 2 (DDP): whole gradients, so each rank's norm is already the global one: no all-reduce.

// FSDP:      func.func @block_norm(%total: tensor<f32> {{.*}}, %g1: tensor<16x16xf32> {{.*}}, %g2: tensor<8x32xf32>
// FSDP-NEXT: aten.op "aten.linalg_vector_norm.default"(%g1) {{.*}} : (tensor<16x16xf32>) -> tensor<f32>
// FSDP-NEXT: aten.op "aten.linalg_vector_norm.default"(%g2) {{.*}} : (tensor<8x32xf32>) -> tensor<f32>
// FSDP-NEXT: aten.op "aten.stack.default"
// FSDP-NEXT: aten.op "aten.linalg_vector_norm.default"
// FSDP-NEXT: func.return
// FSDP:      func.func @grad_clip(%total: tensor<f32> {{.*}}) -> tensor<f32> {
// FSDP-NEXT: %[[SQ:.*]] = aten.op "aten.pow.Tensor_Scalar"(%total) phase = "optim" args = {exponent = 2.000000e+00 : f64}
// FSDP-NEXT: %[[AR:.*]] = dist.all_reduce %[[SQ]] on @mesh grid_axes = [0] : tensor<f32> -> !dist.future<tensor<f32>>
// FSDP-NEXT: %[[W:.*]] = dist.wait %[[AR]]
// FSDP-NEXT: %[[N:.*]] = aten.op "aten.pow.Tensor_Scalar"(%[[W]]) phase = "optim" args = {exponent = 5.000000e-01 : f64}
// FSDP-NEXT: aten.op "aten.add.Tensor"(%[[N]])
// FSDP:      func.func @block_optim(
// FSDP:      aten.op "aten.mul_.Tensor"(%g1, %coef) phase = "optim" : (tensor<16x16xf32>, tensor<f32>) -> tensor<16x16xf32>

// TP:        func.func @block_norm(%total: tensor<f32> {{.*}}, %g1: tensor<8x16xf32> {{.*}}, %g2: tensor<8x16xf32>
// TP-NOT:    dist.
// TP:        func.func @grad_clip(
// TP:        dist.all_reduce %{{.*}} on @mesh grid_axes = [0]
// TP:        dist.all_reduce %{{.*}} on @mesh grid_axes = [1]
// TP-NOT:    dist.all_reduce
// TP:        func.func @block_optim(

// DDP:       func.func @grad_clip(%total: tensor<f32> {{.*}}) -> tensor<f32> {
// DDP-NEXT:  aten.op "aten.add.Tensor"(%total)
// DDP-NOT:   dist.
// DDP:       func.func @block_optim(

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64], ["block_norm", 2 : i64], ["grad_clip", 1 : i64], ["block_optim", 2 : i64]]} {
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
  func.func @block_norm(%total: tensor<f32> {flint.role = "grad_norm"}, %g1: tensor<32x16xf32> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w1.weight"}, %g2: tensor<16x32xf32> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w2.weight"}) -> tensor<f32> {
    %0 = aten.op "aten.linalg_vector_norm.default"(%g1) phase = "optim" args = {ord = 2.000000e+00 : f64} : (tensor<32x16xf32>) -> tensor<f32>
    %1 = aten.op "aten.linalg_vector_norm.default"(%g2) phase = "optim" args = {ord = 2.000000e+00 : f64} : (tensor<16x32xf32>) -> tensor<f32>
    %2 = aten.op "aten.stack.default"(%total, %0, %1) phase = "optim" : (tensor<f32>, tensor<f32>, tensor<f32>) -> tensor<3xf32>
    %3 = aten.op "aten.linalg_vector_norm.default"(%2) phase = "optim" args = {ord = 2.000000e+00 : f64} : (tensor<3xf32>) -> tensor<f32>
    func.return %3 : tensor<f32>
  }
  func.func @grad_clip(%total: tensor<f32> {flint.role = "grad_norm"}) -> tensor<f32> {
    %0 = aten.op "aten.add.Tensor"(%total) phase = "optim" args = {other = 1.000000e-06 : f64} : (tensor<f32>) -> tensor<f32>
    %1 = aten.op "aten.reciprocal.default"(%0) phase = "optim" : (tensor<f32>) -> tensor<f32>
    %2 = aten.op "aten.mul.Tensor"(%1) phase = "optim" args = {other = 1.000000e+00 : f64} : (tensor<f32>) -> tensor<f32>
    %3 = aten.op "aten.clamp.default"(%2) phase = "optim" args = {max = 1.000000e+00 : f64} : (tensor<f32>) -> tensor<f32>
    func.return %3 : tensor<f32>
  }
  func.func @block_optim(%w1: tensor<32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %g1: tensor<32x16xf32> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w1.weight"}, %g2: tensor<16x32xf32> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w2.weight"}, %m1: tensor<32x16xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w1.weight"}, %m2: tensor<16x32xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w2.weight"}, %v1: tensor<32x16xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w1.weight"}, %v2: tensor<16x32xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w2.weight"}, %coef: tensor<f32> {flint.role = "clip_coef"}) {
    %s1 = aten.op "aten.mul_.Tensor"(%g1, %coef) phase = "optim" : (tensor<32x16xf32>, tensor<f32>) -> tensor<32x16xf32>
    %s2 = aten.op "aten.mul_.Tensor"(%g2, %coef) phase = "optim" : (tensor<16x32xf32>, tensor<f32>) -> tensor<16x32xf32>
    %0 = aten.op "aten.mul_.Tensor"(%w1) phase = "optim" args = {other = 9.999700e-01 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %1 = aten.op "aten.lerp_.Scalar"(%m1, %s1) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %2 = aten.op "aten.addcdiv_.default"(%0, %1, %v1) phase = "optim" args = {value = -3.000000e-04 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %10 = aten.op "aten.mul_.Tensor"(%w2) phase = "optim" args = {other = 9.999700e-01 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %11 = aten.op "aten.lerp_.Scalar"(%m2, %s2) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %12 = aten.op "aten.addcdiv_.default"(%10, %11, %v2) phase = "optim" args = {value = -3.000000e-04 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    func.return
  }
}
