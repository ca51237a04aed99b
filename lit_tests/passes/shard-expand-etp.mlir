// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 tp=2},shard-expand' | filecheck %s --check-prefix=TP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=4 tp=2 ep=4 etp=2},shard-expand' | filecheck %s --check-prefix=ETP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=4 tp=2 ep=4},shard-expand' | filecheck %s --check-prefix=EPTP
// The mixture-of-experts feed-forward of shard-expand-ep.mlir (8 experts, top-2, 32 tokens, hidden 16, expert
// hidden 32) under tensor parallelism, as torchtitan's apply_moe_ep_tp: the router replicated over tp, the tp
// partial sums carried through the combine to ONE all_reduce at the MoE output (and one of the input gradient).

// ep = 1 (torchtitan's TensorParallel for the experts): w1 column-parallel, w2 row-parallel on the expert hidden
// dim; no all_to_all.
// TP:      shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard", "tp"]}
// TP:      func.func @block_fwd(%x: tensor<4x4x16xf32> {{.*}}, %gate: tensor<4x16xf32> {{.*}}, %w1: tensor<4x16x16xf32> {{.*}}, %w2: tensor<4x16x16xf32>
// TP-NOT:  dist.all_to_all
// TP:      "aten.sort.stable"({{.*}} : (tensor<32xi64>) -> (tensor<32xi64>, tensor<32xi64>)
// TP:      "aten.bmm.default"({{.*}} : (tensor<8x4x16xf32>, tensor<8x16x16xf32>) -> tensor<8x4x16xf32>
// TP-NOT:  dist.all_reduce
// TP:      "aten.bmm.default"({{.*}} : (tensor<8x4x16xf32>, tensor<8x16x16xf32>) -> tensor<8x4x16xf32>
// TP-NOT:  dist.all_reduce
// TP:      "aten.index_add.default"({{.*}} : (tensor<16x16xf32>, tensor<32xi64>, tensor<32x16xf32>) -> tensor<16x16xf32>
// TP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [1] : tensor<16x16xf32>
// TP:      func.func @block_bwd
// TP-NOT:  dist.all_reduce
// TP:      "aten.index_put.default"({{.*}} : (tensor<16x16xf32>, tensor<32xi64>, tensor<32x16xf32>) -> tensor<16x16xf32>
// TP-NOT:  dist.all_to_all
// TP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [1] : tensor<16x16xf32>
// TP:      dist.reduce_scatter {{.*}} grid_axes = [0]

// etp = tp (torchtitan's ExpertTensorParallel): experts split over ep (4) and their hidden dim over tp; every tp
// rank dispatches the same tokens; the combine all_to_all carries the tp partial sums.
// ETP:      shard.grid @mesh(shape = 4x2) {flint.axis_names = ["dp_shard_in_ep", "tp"]}
// ETP:      func.func @block_fwd(%x: tensor<2x4x16xf32> {{.*}}, %gate: tensor<2x16xf32> {{.*}}, %w1: tensor<2x16x16xf32> {{.*}}, %w2: tensor<2x16x16xf32>
// ETP:      "aten.histc.default"({{.*}} : (tensor<16xi64>) -> tensor<8xi64>
// ETP-NEXT: dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 0 : tensor<8xi64>
// ETP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 1 : tensor<8x2x16xf32> -> !dist.future<tensor<2x8x16xf32>>
// ETP:      "aten.bmm.default"({{.*}} : (tensor<2x8x16xf32>, tensor<2x16x16xf32>) -> tensor<2x8x16xf32>
// ETP:      "aten.bmm.default"({{.*}} : (tensor<2x8x16xf32>, tensor<2x16x16xf32>) -> tensor<2x8x16xf32>
// ETP-NEXT: dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 1 concat_dim = 0 : tensor<2x8x16xf32> -> !dist.future<tensor<8x2x16xf32>>
// ETP-NOT:  dist.all_reduce
// ETP:      "aten.index_add.default"
// ETP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [1] : tensor<8x16xf32>
// ETP:      func.func @block_bwd
// ETP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 1 : tensor<8x2x16xf32>
// ETP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 1 concat_dim = 0 : tensor<2x8x16xf32>
// ETP-NOT:  dist.all_reduce
// ETP:      "aten.index_put.default"
// ETP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [1] : tensor<8x16xf32>

// etp = 1: ep = 4 borrows dp_shard_in_ep x tp; each tp rank slices its half of the (replicated) tokens and
// routes it (torchtitan's token dispatcher with sp_size = tp; the slices are views, no clone), the combine
// scatters it into zeros: a tp partial sum. Experts are whole (2 per rank), FSDP-sharded over dp_shard_mod_ep.
// EPTP:      shard.grid @mesh(shape = 2x2x2) {flint.axis_names = ["dp_shard_mod_ep", "dp_shard_in_ep", "tp"]}
// EPTP:      func.func @block_fwd(%x: tensor<2x4x16xf32> {{.*}}, %gate: tensor<2x16xf32> {{.*}}, %w1: tensor<1x16x32xf32> {{.*}}, %w2: tensor<1x32x16xf32>
// EPTP:      dist.all_gather %{{.*}} on @mesh grid_axes = [0] gather_dim = 0 : tensor<1024xf32> -> !dist.future<tensor<2048xf32>>
// EPTP:      "aten.slice.Tensor"({{.*}} args = {dim = 0 : i64, start = 0 : i64, end = 4 : i64} : (tensor<8x2xi64>) -> tensor<4x2xi64>
// EPTP-NOT:  "aten.clone.default"
// EPTP:      "aten.sort.stable"({{.*}} : (tensor<8xi64>) -> (tensor<8xi64>, tensor<8xi64>)
// EPTP-NOT:  "aten.clone.default"
// EPTP:      "aten.index.Tensor"({{.*}} : (tensor<4x16xf32>, tensor<8xi64>) -> tensor<8x16xf32>
// EPTP:      "aten.histc.default"({{.*}} : (tensor<8xi64>) -> tensor<8xi64>
// EPTP-NEXT: dist.all_to_all %{{.*}} on @mesh grid_axes = [1, 2] split_dim = 0 concat_dim = 0 : tensor<8xi64>
// EPTP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [1, 2] split_dim = 0 concat_dim = 1 : tensor<8x1x16xf32> -> !dist.future<tensor<2x4x16xf32>>
// EPTP:      "aten.bmm.default"({{.*}} : (tensor<2x4x16xf32>, tensor<2x16x32xf32>) -> tensor<2x4x32xf32>
// EPTP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [1, 2] split_dim = 1 concat_dim = 0 : tensor<2x4x16xf32> -> !dist.future<tensor<8x1x16xf32>>
// EPTP:      "aten.index_add.default"({{.*}} : (tensor<8x16xf32>, tensor<8xi64>, tensor<8x16xf32>) -> tensor<8x16xf32>
// EPTP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [2] : tensor<8x16xf32>
// EPTP:      func.func @block_bwd
// EPTP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [1, 2] split_dim = 0 concat_dim = 1 : tensor<8x1x16xf32>
// EPTP:      dist.all_to_all %{{.*}} on @mesh grid_axes = [1, 2] split_dim = 1 concat_dim = 0 : tensor<2x4x16xf32>
// EPTP:      "aten.index_put.default"({{.*}} : (tensor<8x16xf32>, tensor<8xi64>, tensor<8x16xf32>) -> tensor<8x16xf32>
// EPTP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [2] : tensor<8x16xf32>
// EPTP:      dist.reduce_scatter %{{.*}} on @mesh grid_axes = [0] scatter_dim = 0 : tensor<2048xf32> -> !dist.future<tensor<1024xf32>>

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
