// RUN: flint-opt %s -p 'shard-annotate{dp_shard=8},shard-expand' | filecheck %s --check-prefix=FSDP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=8 ep=8},shard-expand' | filecheck %s --check-prefix=EP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=8 ep=4},shard-expand' | filecheck %s --check-prefix=EPFSDP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=8 ep=8 capacity_factor=2.0},shard-expand' | filecheck %s --check-prefix=CAP
// A mixture-of-experts feed-forward on one device (8 experts, top-2, 32 tokens: 64 assignments, 8 rows per
// expert): gate, softmax, topk, sort, index (dispatch), expert bmm, index_add (combine), and its backward
// (index_select, the expert bmm gradients, index_put; the router's gradient is cut short to a gate mm).
// flint-opt verifies the module after every pass.

// Data parallel only: every rank routes its own 4 tokens to all 8 experts (1 row each), no all_to_all.
// FSDP:      func.func @block_fwd(%x: tensor<1x4x16xf32>
// FSDP:      dist.all_gather {{.*}} gather_dim = 0
// FSDP:      "aten.sort.stable"({{.*}} : (tensor<8xi64>) -> (tensor<8xi64>, tensor<8xi64>)
// FSDP:      "aten.index.Tensor"({{.*}} : (tensor<4x16xf32>, tensor<8xi64>) -> tensor<8x16xf32>
// FSDP:      "aten.bmm.default"({{.*}} : (tensor<8x1x16xf32>, tensor<8x16x32xf32>) -> tensor<8x1x32xf32>
// FSDP-NOT:  dist.all_to_all
// FSDP:      "aten.index_add.default"({{.*}}) {{.*}} : (tensor<4x16xf32>, tensor<8xi64>, tensor<8x16xf32>) -> tensor<4x16xf32>
// FSDP:      func.func @block_bwd
// FSDP-NOT:  dist.all_to_all
// FSDP:      dist.reduce_scatter

// ep = dp_shard = 8: one expert per rank. Forward: token counts, dispatch, combine; backward: two.
// EP:      shard.grid @mesh(shape = 8) {flint.axis_names = ["dp_shard_in_ep"]}
// EP:      func.func @block_fwd(%x: tensor<1x4x16xf32> {{.*}}, %gate: tensor<1x16xf32> {{.*}}, %w1: tensor<1x16x32xf32> {{.*}}, %w2: tensor<1x32x16xf32>
// EP:      dist.all_gather {{.*}} : tensor<16xf32> -> !dist.future<tensor<128xf32>>
// EP-NOT:  dist.all_gather
// EP:      "aten.histc.default"(%{{.*}}) {{.*}} args = {bins = 8 : i64, min = 0 : i64, max = 8 : i64} : (tensor<8xi64>) -> tensor<8xi64>
// EP-NEXT: dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 0 : tensor<8xi64> -> !dist.future<tensor<8xi64>>
// EP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 1 : tensor<8x1x16xf32> -> !dist.future<tensor<1x8x16xf32>>
// EP:      "aten.bmm.default"({{.*}} : (tensor<1x8x16xf32>, tensor<1x16x32xf32>) -> tensor<1x8x32xf32>
// EP:      "aten.bmm.default"({{.*}} : (tensor<1x8x32xf32>, tensor<1x32x16xf32>) -> tensor<1x8x16xf32>
// EP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 1 concat_dim = 0 : tensor<1x8x16xf32> -> !dist.future<tensor<8x1x16xf32>>
// EP-NOT:  dist.all_to_all
// EP:      func.func @block_bwd
// EP-NOT:  aten.histc
// EP:      dist.all_to_all %{{.*}} split_dim = 0 concat_dim = 1 : tensor<8x1x16xf32> -> !dist.future<tensor<1x8x16xf32>>
// EP:      dist.all_to_all %{{.*}} split_dim = 1 concat_dim = 0 : tensor<1x8x16xf32> -> !dist.future<tensor<8x1x16xf32>>
// EP-NOT:  dist.all_to_all
// EP:      dist.reduce_scatter {{.*}} : tensor<128xf32> -> !dist.future<tensor<16xf32>>
// EP-NOT:  dist.reduce_scatter
// EP:      func.return

// ep = 4 inside dp_shard = 8: experts FSDP-sharded over dp_shard_mod_ep (their own gather and reduce-scatter).
// EPFSDP:      shard.grid @mesh(shape = 2x4) {flint.axis_names = ["dp_shard_mod_ep", "dp_shard_in_ep"]}
// EPFSDP:      func.func @block_fwd(%x: tensor<1x4x16xf32> {{.*}}, %gate: tensor<1x16xf32> {{.*}}, %w1: tensor<1x16x32xf32>
// EPFSDP:      dist.all_gather {{.*}} grid_axes = [0] gather_dim = 0 : tensor<1024xf32> -> !dist.future<tensor<2048xf32>>
// EPFSDP:      dist.all_gather {{.*}} grid_axes = [0, 1] gather_dim = 0 : tensor<16xf32> -> !dist.future<tensor<128xf32>>
// EPFSDP:      dist.all_to_all %{{.*}} grid_axes = [1] split_dim = 0 concat_dim = 0 : tensor<8xi64>
// EPFSDP:      dist.all_to_all %{{.*}} grid_axes = [1] split_dim = 0 concat_dim = 1 : tensor<8x1x16xf32> -> !dist.future<tensor<2x4x16xf32>>
// EPFSDP:      "aten.bmm.default"({{.*}} : (tensor<2x4x16xf32>, tensor<2x16x32xf32>) -> tensor<2x4x32xf32>
// EPFSDP:      dist.all_to_all %{{.*}} grid_axes = [1] split_dim = 1 concat_dim = 0 : tensor<2x4x16xf32> -> !dist.future<tensor<8x1x16xf32>>
// EPFSDP:      func.func @block_bwd
// EPFSDP:      dist.reduce_scatter {{.*}} grid_axes = [0] scatter_dim = 0 : tensor<2048xf32> -> !dist.future<tensor<1024xf32>>
// EPFSDP:      dist.reduce_scatter {{.*}} grid_axes = [0, 1] scatter_dim = 0 : tensor<128xf32> -> !dist.future<tensor<16xf32>>

// capacity_factor = 2: each rank pads its row per expert to 2 before the all_to_all and drops the padding after.
// CAP:      "aten.constant_pad_nd.default"(%{{.*}}) {{.*}} args = {pad = [0 : i64, 0 : i64, 0 : i64, 1 : i64]} : (tensor<8x1x16xf32>) -> tensor<8x2x16xf32>
// CAP-NEXT: dist.all_to_all %{{.*}} split_dim = 0 concat_dim = 1 : tensor<8x2x16xf32> -> !dist.future<tensor<1x16x16xf32>>
// CAP-NEXT: dist.wait
// CAP-NEXT: "aten.slice.Tensor"(%{{.*}}) {{.*}} args = {dim = 1 : i64, start = 0 : i64, end = 8 : i64} : (tensor<1x16x16xf32>) -> tensor<1x8x16xf32>
// CAP:      "aten.constant_pad_nd.default"(%{{.*}}) {{.*}} : (tensor<1x8x16xf32>) -> tensor<1x16x16xf32>
// CAP-NEXT: dist.all_to_all %{{.*}} split_dim = 1 concat_dim = 0 : tensor<1x16x16xf32> -> !dist.future<tensor<8x2x16xf32>>

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<8x4x16xf32> {flint.role = "activation"}, %gate: tensor<8x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.gate.weight"}, %w1: tensor<8x16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1"}, %w2: tensor<8x32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2"}) -> (tensor<8x4x16xf32>, tensor<32x16xf32>, tensor<32x8xf32>, tensor<64xi64>, tensor<64x1xf32>, tensor<8x8x16xf32>, tensor<8x8x32xf32>, tensor<8x8x32xf32>) {
    %0 = aten.op "aten.view.default"(%x) phase = "fwd" module = "feed_forward" args = {size = [-1 : i64, 16 : i64]} : (tensor<8x4x16xf32>) -> tensor<32x16xf32>
    %1 = aten.op "aten.t.default"(%gate) phase = "fwd" module = "feed_forward.gate" : (tensor<8x16xf32>) -> tensor<16x8xf32>
    %2 = aten.op "aten.mm.default"(%0, %1) phase = "fwd" module = "feed_forward.gate" : (tensor<32x16xf32>, tensor<16x8xf32>) -> tensor<32x8xf32>
    %3 = aten.op "aten._softmax.default"(%2) phase = "fwd" module = "feed_forward" args = {dim = -1 : i64, half_to_float = false} : (tensor<32x8xf32>) -> tensor<32x8xf32>
    %4, %5 = aten.op "aten.topk.default"(%3) phase = "fwd" module = "feed_forward" args = {k = 2 : i64} : (tensor<32x8xf32>) -> (tensor<32x2xf32>, tensor<32x2xi64>)
    %6 = aten.op "aten.view.default"(%5) phase = "fwd" module = "feed_forward" args = {size = [64 : i64]} : (tensor<32x2xi64>) -> tensor<64xi64>
    %7, %8 = aten.op "aten.sort.stable"(%6) phase = "fwd" module = "feed_forward" args = {stable = true} : (tensor<64xi64>) -> (tensor<64xi64>, tensor<64xi64>)
    %9 = aten.op "aten.floor_divide.default"(%8) phase = "fwd" module = "feed_forward" args = {other = 2 : i64} : (tensor<64xi64>) -> tensor<64xi64>
    %10 = aten.op "aten.index.Tensor"(%0, %9) phase = "fwd" module = "feed_forward" : (tensor<32x16xf32>, tensor<64xi64>) -> tensor<64x16xf32>
    %11 = aten.op "aten.view.default"(%10) phase = "fwd" module = "feed_forward" args = {size = [8 : i64, 8 : i64, 16 : i64]} : (tensor<64x16xf32>) -> tensor<8x8x16xf32>
    %12 = aten.op "aten.bmm.default"(%11, %w1) phase = "fwd" module = "feed_forward" : (tensor<8x8x16xf32>, tensor<8x16x32xf32>) -> tensor<8x8x32xf32>
    %13 = aten.op "aten.silu.default"(%12) phase = "fwd" module = "feed_forward" : (tensor<8x8x32xf32>) -> tensor<8x8x32xf32>
    %14 = aten.op "aten.bmm.default"(%13, %w2) phase = "fwd" module = "feed_forward" : (tensor<8x8x32xf32>, tensor<8x32x16xf32>) -> tensor<8x8x16xf32>
    %15 = aten.op "aten.view.default"(%14) phase = "fwd" module = "feed_forward" args = {size = [-1 : i64, 16 : i64]} : (tensor<8x8x16xf32>) -> tensor<64x16xf32>
    %16 = aten.op "aten.view.default"(%4) phase = "fwd" module = "feed_forward" args = {size = [64 : i64]} : (tensor<32x2xf32>) -> tensor<64xf32>
    %17 = aten.op "aten.index.Tensor"(%16, %8) phase = "fwd" module = "feed_forward" : (tensor<64xf32>, tensor<64xi64>) -> tensor<64xf32>
    %18 = aten.op "aten.unsqueeze.default"(%17) phase = "fwd" module = "feed_forward" args = {dim = -1 : i64} : (tensor<64xf32>) -> tensor<64x1xf32>
    %19 = aten.op "aten.mul.Tensor"(%15, %18) phase = "fwd" module = "feed_forward" : (tensor<64x16xf32>, tensor<64x1xf32>) -> tensor<64x16xf32>
    %20 = aten.op "aten.zeros_like.default"(%0) phase = "fwd" module = "feed_forward" : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %21 = aten.op "aten.index_add.default"(%20, %9, %19) phase = "fwd" module = "feed_forward" args = {dim = 0 : i64} : (tensor<32x16xf32>, tensor<64xi64>, tensor<64x16xf32>) -> tensor<32x16xf32>
    %22 = aten.op "aten.view.default"(%21) phase = "fwd" module = "feed_forward" args = {size = [8 : i64, 4 : i64, 16 : i64]} : (tensor<32x16xf32>) -> tensor<8x4x16xf32>
    func.return %22, %0, %3, %9, %18, %11, %12, %13 : tensor<8x4x16xf32>, tensor<32x16xf32>, tensor<32x8xf32>, tensor<64xi64>, tensor<64x1xf32>, tensor<8x8x16xf32>, tensor<8x8x32xf32>, tensor<8x8x32xf32>
  }
  func.func @block_bwd(%flat: tensor<32x16xf32> {flint.role = "saved"}, %scores: tensor<32x8xf32> {flint.role = "saved"}, %tok: tensor<64xi64> {flint.role = "saved"}, %wu: tensor<64x1xf32> {flint.role = "saved"}, %xs: tensor<8x8x16xf32> {flint.role = "saved"}, %h: tensor<8x8x32xf32> {flint.role = "saved"}, %a: tensor<8x8x32xf32> {flint.role = "saved"}, %w1: tensor<8x16x32xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1"}, %w2: tensor<8x32x16xf32> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2"}, %g: tensor<8x4x16xf32> {flint.role = "tangent"}) -> (tensor<8x4x16xf32>, tensor<8x16xf32>, tensor<8x16x32xf32>, tensor<8x32x16xf32>) {
    %0 = aten.op "aten.view.default"(%g) phase = "bwd" args = {size = [32 : i64, 16 : i64]} : (tensor<8x4x16xf32>) -> tensor<32x16xf32>
    %1 = aten.op "aten.index_select.default"(%0, %tok) phase = "bwd" args = {dim = 0 : i64} : (tensor<32x16xf32>, tensor<64xi64>) -> tensor<64x16xf32>
    %2 = aten.op "aten.mul.Tensor"(%1, %wu) phase = "bwd" : (tensor<64x16xf32>, tensor<64x1xf32>) -> tensor<64x16xf32>
    %3 = aten.op "aten.view.default"(%2) phase = "bwd" args = {size = [8 : i64, 8 : i64, 16 : i64]} : (tensor<64x16xf32>) -> tensor<8x8x16xf32>
    %4 = aten.op "aten.transpose.int"(%a) phase = "bwd" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<8x8x32xf32>) -> tensor<8x32x8xf32>
    %5 = aten.op "aten.bmm.default"(%4, %3) phase = "bwd" : (tensor<8x32x8xf32>, tensor<8x8x16xf32>) -> tensor<8x32x16xf32>
    %6 = aten.op "aten.transpose.int"(%w2) phase = "bwd" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<8x32x16xf32>) -> tensor<8x16x32xf32>
    %7 = aten.op "aten.bmm.default"(%3, %6) phase = "bwd" : (tensor<8x8x16xf32>, tensor<8x16x32xf32>) -> tensor<8x8x32xf32>
    %8 = aten.op "aten.silu_backward.default"(%7, %h) phase = "bwd" : (tensor<8x8x32xf32>, tensor<8x8x32xf32>) -> tensor<8x8x32xf32>
    %9 = aten.op "aten.transpose.int"(%xs) phase = "bwd" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<8x8x16xf32>) -> tensor<8x16x8xf32>
    %10 = aten.op "aten.bmm.default"(%9, %8) phase = "bwd" : (tensor<8x16x8xf32>, tensor<8x8x32xf32>) -> tensor<8x16x32xf32>
    %11 = aten.op "aten.transpose.int"(%w1) phase = "bwd" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<8x16x32xf32>) -> tensor<8x32x16xf32>
    %12 = aten.op "aten.bmm.default"(%8, %11) phase = "bwd" : (tensor<8x8x32xf32>, tensor<8x32x16xf32>) -> tensor<8x8x16xf32>
    %13 = aten.op "aten.view.default"(%12) phase = "bwd" args = {size = [64 : i64, 16 : i64]} : (tensor<8x8x16xf32>) -> tensor<64x16xf32>
    %14 = aten.op "aten.new_zeros.default"(%13) phase = "bwd" args = {size = [32 : i64, 16 : i64]} : (tensor<64x16xf32>) -> tensor<32x16xf32>
    %15 = aten.op "aten.index_put.default"(%14, %tok, %13) phase = "bwd" args = {accumulate = true} : (tensor<32x16xf32>, tensor<64xi64>, tensor<64x16xf32>) -> tensor<32x16xf32>
    %16 = aten.op "aten.t.default"(%scores) phase = "bwd" : (tensor<32x8xf32>) -> tensor<8x32xf32>
    %18 = aten.op "aten.mm.default"(%16, %flat) phase = "bwd" : (tensor<8x32xf32>, tensor<32x16xf32>) -> tensor<8x16xf32>
    %19 = aten.op "aten.view.default"(%15) phase = "bwd" args = {size = [8 : i64, 4 : i64, 16 : i64]} : (tensor<32x16xf32>) -> tensor<8x4x16xf32>
    func.return %19, %18, %10, %5 : tensor<8x4x16xf32>, tensor<8x16xf32>, tensor<8x16x32xf32>, tensor<8x32x16xf32>
  }
}
