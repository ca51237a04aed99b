// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=gpipe}' | filecheck %s
// RUN: flint-opt %s -p 'pipeline-split{stages=1 microbatches=2}' | filecheck %s --check-prefix=ACCUM
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=gpipe},lower-to-chakra' | filecheck %s --check-prefix=LOWER
// flint-opt verifies the module after every pass.

// Gradient-norm clipping (plan field max_norm): after the backward, each part's @<part>_norm folds its
// gradients' norms into the running total, @grad_clip all-reduces the total over pp (the stages' norms) and
// turns it into the scaling coefficient, and each @<part>_optim takes that coefficient. Each pipeline rank
// runs the norms of the parts its stages hold (rank 0: embed and its 2 blocks; rank 1: its 2 blocks and the
// head), then @grad_clip once, then the same parts' optimizers.
// CHECK:      flint.stage_schedules = {{\[\[}}["embed_fwd", 1 : i64],
// CHECK-SAME: ["embed_bwd", 1 : i64], ["embed_norm", 1 : i64], ["block_norm", 2 : i64], ["grad_clip", 1 : i64], ["embed_optim", 1 : i64], ["block_optim", 2 : i64]], {{\[}}["pp_recv_f_m1", 1 : i64, {tag = 0 : i64}],
// CHECK-SAME: ["pp_send_b_m1", 1 : i64, {tag = 3 : i64}], ["block_norm", 2 : i64], ["head_norm", 1 : i64], ["grad_clip", 1 : i64], ["block_optim", 2 : i64], ["head_optim", 1 : i64]]]

// One stage: the captured order after the last microbatch's backward.
// ACCUM:      ["embed_bwd", 1 : i64], ["embed_norm", 1 : i64], ["block_norm", 4 : i64], ["head_norm", 1 : i64], ["grad_clip", 1 : i64], ["embed_optim", 1 : i64], ["block_optim", 4 : i64], ["head_optim", 1 : i64]]]

// Lowered, each pipeline rank runs its norms, then the pp all-reduce of the squared norm (4 bytes, fp32)
// once, which the optimizer's gradient scaling waits for.
// LOWER:      chakra.graph @step_pp0
// LOWER:      chakra.comp "aten.linalg_vector_norm.default +2"
// LOWER:      chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [0] bytes = 4
// LOWER-NEXT: chakra.comp "aten.pow.Tensor_Scalar +1"
// LOWER-NEXT: chakra.comp "aten.mul_.Tensor"
// LOWER:      chakra.graph @step_pp1
// LOWER:      chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [0] bytes = 4

builtin.module attributes {flint.schedule = [["embed_fwd", 1], ["block_fwd", 4], ["head_fwd", 1], ["head_bwd", 1], ["block_bwd", 4], ["embed_bwd", 1], ["embed_norm", 1], ["block_norm", 4], ["head_norm", 1], ["grad_clip", 1], ["embed_optim", 1], ["block_optim", 4], ["head_optim", 1]], flint.plan = {dp_shard = 2 : i64, pp = 2 : i64, microbatches = 2 : i64, max_norm = 1.0 : f64, world_size = 4 : i64}} {
  shard.grid @mesh(shape = 2x2) {flint.axis_names = ["pp", "dp_shard"]}
  func.func @embed_fwd(%t: tensor<2x8xi64> {flint.role = "input"}, %w: tensor<32x16xf32> {flint.role = "parameter"}) -> tensor<2x8x16xf32> {
    %y = aten.op "aten.embedding.default"(%w, %t) : (tensor<32x16xf32>, tensor<2x8xi64>) -> tensor<2x8x16xf32>
    func.return %y : tensor<2x8x16xf32>
  }
  func.func @embed_bwd(%g: tensor<2x8x16xf32> {flint.role = "tangent"}) -> tensor<32x16xf32> {
    %d = aten.op "aten.zeros.default"() {args = {size = [32, 16]}} : () -> tensor<32x16xf32>
    func.return %d : tensor<32x16xf32>
  }
  func.func @block_fwd(%x: tensor<2x8x16xf32> {flint.role = "activation"}, %w: tensor<16x16xf32> {flint.role = "parameter"}) -> (tensor<2x8x16xf32>, tensor<2x8x16xf32>) {
    %y = aten.op "aten.matmul.default"(%x, %w) : (tensor<2x8x16xf32>, tensor<16x16xf32>) -> tensor<2x8x16xf32>
    func.return %y, %x : tensor<2x8x16xf32>, tensor<2x8x16xf32>
  }
  func.func @block_bwd(%x: tensor<2x8x16xf32> {flint.role = "saved"}, %g: tensor<2x8x16xf32> {flint.role = "tangent"}) -> tensor<2x8x16xf32> {
    func.return %g : tensor<2x8x16xf32>
  }
  func.func @head_fwd(%x: tensor<2x8x16xf32> {flint.role = "activation"}) -> tensor<2x8x16xf32> {
    %y = aten.op "aten.relu.default"(%x) : (tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
    func.return %y : tensor<2x8x16xf32>
  }
  func.func @head_bwd(%g: tensor<2x8x16xf32> {flint.role = "tangent"}) -> tensor<2x8x16xf32> {
    func.return %g : tensor<2x8x16xf32>
  }
  func.func @embed_norm(%total: tensor<f32> {flint.role = "grad_norm"}, %g: tensor<32x16xf32> {flint.role = "gradient"}) -> tensor<f32> {
    %n = aten.op "aten.linalg_vector_norm.default"(%g) phase = "optim" : (tensor<32x16xf32>) -> tensor<f32>
    %s = aten.op "aten.stack.default"(%total, %n) phase = "optim" : (tensor<f32>, tensor<f32>) -> tensor<2xf32>
    %t = aten.op "aten.linalg_vector_norm.default"(%s) phase = "optim" : (tensor<2xf32>) -> tensor<f32>
    func.return %t : tensor<f32>
  }
  func.func @block_norm(%total: tensor<f32> {flint.role = "grad_norm"}, %g: tensor<16x16xf32> {flint.role = "gradient"}) -> tensor<f32> {
    %n = aten.op "aten.linalg_vector_norm.default"(%g) phase = "optim" : (tensor<16x16xf32>) -> tensor<f32>
    %s = aten.op "aten.stack.default"(%total, %n) phase = "optim" : (tensor<f32>, tensor<f32>) -> tensor<2xf32>
    %t = aten.op "aten.linalg_vector_norm.default"(%s) phase = "optim" : (tensor<2xf32>) -> tensor<f32>
    func.return %t : tensor<f32>
  }
  func.func @head_norm(%total: tensor<f32> {flint.role = "grad_norm"}) -> tensor<f32> {
    func.return %total : tensor<f32>
  }
  func.func @grad_clip(%total: tensor<f32> {flint.role = "grad_norm"}) -> tensor<f32> {
    %sq = aten.op "aten.pow.Tensor_Scalar"(%total) phase = "optim" args = {exponent = 2.0 : f64} : (tensor<f32>) -> tensor<f32>
    %f = dist.all_reduce %sq on @mesh grid_axes = [0] : tensor<f32> -> !dist.future<tensor<f32>>
    %r = dist.wait %f : tensor<f32>
    %n = aten.op "aten.pow.Tensor_Scalar"(%r) phase = "optim" args = {exponent = 0.5 : f64} : (tensor<f32>) -> tensor<f32>
    %c = aten.op "aten.clamp.default"(%n) phase = "optim" args = {max = 1.0 : f64} : (tensor<f32>) -> tensor<f32>
    func.return %c : tensor<f32>
  }
  func.func @embed_optim(%w: tensor<32x16xf32> {flint.role = "parameter"}, %g: tensor<32x16xf32> {flint.role = "gradient"}, %c: tensor<f32> {flint.role = "clip_coef"}) {
    %s = aten.op "aten.mul_.Tensor"(%g, %c) phase = "optim" : (tensor<32x16xf32>, tensor<f32>) -> tensor<32x16xf32>
    func.return
  }
  func.func @block_optim(%w: tensor<16x16xf32> {flint.role = "parameter"}, %g: tensor<16x16xf32> {flint.role = "gradient"}, %c: tensor<f32> {flint.role = "clip_coef"}) {
    %s = aten.op "aten.mul_.Tensor"(%g, %c) phase = "optim" : (tensor<16x16xf32>, tensor<f32>) -> tensor<16x16xf32>
    func.return
  }
  func.func @head_optim(%c: tensor<f32> {flint.role = "clip_coef"}) {
    func.return
  }
}
