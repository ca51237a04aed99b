// RUN: flint-opt %s -p 'shard-annotate{tp=2 sp=true},shard-expand' | filecheck %s --check-prefix=SP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 tp=2 sp=true},shard-expand' | filecheck %s --check-prefix=FSDPSP
// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2 tp=2 sp=true},shard-expand' | filecheck %s --check-prefix=DDPSP
// flint-opt verifies the module after every pass.
// The MLP block of shard-expand.mlir behind a norm's scale (x * wn, a weight of 16 the TP rules leave
// replicated). Under sequence parallelism x is split on its sequence (dim 1) over tp, so wn's gradient, the
// sum of g * x over batch and sequence, is a pending sum over tp.
//   tp 2 + sp: it leaves backward partial, for the optimizer to all-reduce (DTensor's Partial gradient): no
//              all-reduce in @block_bwd.
//   dp_shard 2 x tp 2 + sp: FSDP2 redistributes it to wn's Replicate before its reduce-scatter: one all-reduce
//              of the whole 16 over tp in backward, then the reduce-scatter of the flat gradients over dp_shard.
//   dp_replicate 2 x tp 2 + sp: the same all-reduce before replicate's all-reduce over dp_replicate.
// In all three, the MLP's input gradient (partial over tp) is reduce-scattered to the sequence shard before
// the norm's backward reads it, as DTensor's backward of the forward's all-gather does, though its first
// reader (the multiply by wn) has no sequence-split operand: no all-reduce and slice of it.

// SP:      func.func @block_bwd
// SP:      dist.reduce_scatter %{{.*}} on @mesh grid_axes = [0] scatter_dim = 0 : tensor<8x4x16xf32>
// SP-NEXT: %[[GX:.*]] = dist.wait
// SP-NEXT: aten.op "aten.mul.Tensor"(%[[GX]], %wn) {{.*}} : (tensor<4x4x16xf32>, tensor<16xf32>) -> tensor<4x4x16xf32>
// SP-NOT:  aten.slice
// SP:      aten.op "aten.mul.Tensor"(%[[GX]], %x) {{.*}} -> tensor<4x4x16xf32>
// SP-NEXT: aten.op "aten.sum.dim_IntList"({{.*}} : (tensor<4x4x16xf32>) -> tensor<16xf32>
// SP-NOT:  dist.all_reduce
// SP:      func.return

// FSDPSP:      func.func @block_bwd
// FSDPSP:      dist.reduce_scatter %{{.*}} on @mesh grid_axes = [1] scatter_dim = 0 : tensor<4x4x16xf32>
// FSDPSP-NOT:  aten.slice
// FSDPSP:      %[[GW:.*]] = aten.op "aten.sum.dim_IntList"({{.*}} : (tensor<2x4x16xf32>) -> tensor<16xf32>
// FSDPSP-NOT:  dist.reduce_scatter
// FSDPSP:      dist.all_reduce %[[GW]] on @mesh grid_axes = [1] : tensor<16xf32> -> !dist.future<tensor<16xf32>>
// FSDPSP:      dist.reduce_scatter %{{.*}} on @mesh grid_axes = [0] scatter_dim = 0
// FSDPSP-NOT:  dist.all_reduce
// FSDPSP:      func.return

// DDPSP:      func.func @block_bwd
// DDPSP:      dist.reduce_scatter %{{.*}} on @mesh grid_axes = [1] scatter_dim = 0 : tensor<4x4x16xf32>
// DDPSP-NOT:  aten.slice
// DDPSP:      %[[GW:.*]] = aten.op "aten.sum.dim_IntList"({{.*}} : (tensor<2x4x16xf32>) -> tensor<16xf32>
// DDPSP:      dist.all_reduce %[[GW]] on @mesh grid_axes = [1] : tensor<16xf32> -> !dist.future<tensor<16xf32>>
// DDPSP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [0] reduction = average
// DDPSP-NOT:  dist.all_reduce
// DDPSP:      func.return

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<4x8x16xf32> {flint.role = "activation"}, %wn: tensor<16xf32> {flint.role = "parameter", flint.param = "layers.0.ffn_norm.weight"}, %w1: tensor<32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}) -> (tensor<4x8x16xf32>, tensor<4x8x16xf32>, tensor<16xf32>, tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<32x32xf32>, tensor<32x32xf32>) {
    %n = aten.op "aten.mul.Tensor"(%x, %wn) phase = "fwd" module = "ffn_norm" : (tensor<4x8x16xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
    %0 = aten.op "aten.t.default"(%w1) phase = "fwd" module = "feed_forward.w1" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %1 = aten.op "aten.view.default"(%n) phase = "fwd" module = "feed_forward.w1" args = {size = [32 : i64, 16 : i64]} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
    %2 = aten.op "aten.mm.default"(%1, %0) phase = "fwd" module = "feed_forward.w1" : (tensor<32x16xf32>, tensor<16x32xf32>) -> tensor<32x32xf32>
    %3 = aten.op "aten.silu.default"(%2) phase = "fwd" module = "feed_forward" : (tensor<32x32xf32>) -> tensor<32x32xf32>
    %4 = aten.op "aten.t.default"(%w2) phase = "fwd" module = "feed_forward.w2" : (tensor<16x32xf32>) -> tensor<32x16xf32>
    %5 = aten.op "aten.mm.default"(%3, %4) phase = "fwd" module = "feed_forward.w2" : (tensor<32x32xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %6 = aten.op "aten._unsafe_view.default"(%5) phase = "fwd" module = "feed_forward.w2" args = {size = [4 : i64, 8 : i64, 16 : i64]} : (tensor<32x16xf32>) -> tensor<4x8x16xf32>
    %7 = aten.op "aten.add.Tensor"(%x, %6) phase = "fwd" : (tensor<4x8x16xf32>, tensor<4x8x16xf32>) -> tensor<4x8x16xf32>
    func.return %7, %x, %wn, %w1, %w2, %1, %3, %2 : tensor<4x8x16xf32>, tensor<4x8x16xf32>, tensor<16xf32>, tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<32x32xf32>, tensor<32x32xf32>
  }
  func.func @block_bwd(%x: tensor<4x8x16xf32> {flint.role = "activation"}, %wn: tensor<16xf32> {flint.role = "parameter", flint.param = "layers.0.ffn_norm.weight"}, %w1: tensor<32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %v: tensor<32x16xf32> {flint.role = "saved"}, %h: tensor<32x32xf32> {flint.role = "saved"}, %m: tensor<32x32xf32> {flint.role = "saved"}, %g: tensor<4x8x16xf32> {flint.role = "tangent"}) -> (tensor<4x8x16xf32>, tensor<16xf32>, tensor<32x16xf32>, tensor<16x32xf32>) {
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
    %13 = aten.op "aten.mul.Tensor"(%12, %wn) phase = "bwd" module = "ffn_norm" : (tensor<4x8x16xf32>, tensor<16xf32>) -> tensor<4x8x16xf32>
    %14 = aten.op "aten.add.Tensor"(%g, %13) phase = "bwd" : (tensor<4x8x16xf32>, tensor<4x8x16xf32>) -> tensor<4x8x16xf32>
    %15 = aten.op "aten.mul.Tensor"(%12, %x) phase = "bwd" module = "ffn_norm" : (tensor<4x8x16xf32>, tensor<4x8x16xf32>) -> tensor<4x8x16xf32>
    %16 = aten.op "aten.sum.dim_IntList"(%15) phase = "bwd" module = "ffn_norm" args = {dim = [0 : i64, 1 : i64], keepdim = false} : (tensor<4x8x16xf32>) -> tensor<16xf32>
    func.return %14, %16, %8, %2 : tensor<4x8x16xf32>, tensor<16xf32>, tensor<32x16xf32>, tensor<16x32xf32>
  }
}
