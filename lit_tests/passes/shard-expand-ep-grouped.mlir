// RUN: flint-opt %s -p 'shard-annotate{dp_shard=4},shard-expand' | filecheck %s --check-prefix=FSDP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=4 ep=4},shard-expand' | filecheck %s --check-prefix=EP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=4 ep=2},shard-expand' | filecheck %s --check-prefix=EPFSDP
// RUN: not flint-opt %s -p 'shard-annotate{dp_shard=4 ep=4 capacity_factor=2.0},shard-expand' 2>&1 | filecheck %s --check-prefix=CAP
// Hugging Face's grouped-GEMM experts on one device, as transformers' grouped_mm_experts_forward runs them (4
// experts, top-2, 16 tokens: 32 token-expert pairs): router, sort by expert, gather the rows, histc + cumsum
// offsets, _grouped_mm (gate_up, then down), routing weights, un-sort, sum over top-k; and its backward (the
// grouped GEMMs' input and weight gradients, the un-sort's and the gather's index_put; the router's gradient cut
// short to a gate mm). Under ep it runs as transformers' AllToAllEP. flint-opt verifies after every pass.

// Data parallel only: every rank routes its own 4 tokens (8 pairs) with all 4 experts whole, no all_to_all.
// FSDP:      func.func @block_fwd(%x: tensor<1x4x8xf32>
// FSDP:      dist.all_gather {{.*}} : tensor<296xf32> -> !dist.future<tensor<1184xf32>>
// FSDP-NOT:  dist.all_to_all
// FSDP:      "aten._grouped_mm.default"({{.*}} : (tensor<8x8xf32>, tensor<4x8x24xf32>, tensor<4xi32>) -> tensor<8x24xf32>
// FSDP:      func.func @block_bwd
// FSDP-NOT:  dist.all_to_all
// FSDP:      dist.reduce_scatter {{.*}} : tensor<1184xf32> -> !dist.future<tensor<296xf32>>

// ep = dp_shard = 4: one expert per rank, stored there (no expert gather). Forward: the token counts (then
// each rank's offsets: its expert's received counts), the rows to their experts, the output back; backward: the
// output gradient to the experts (one exchange for both GEMMs), the input gradient back.
// EP:      shard.grid @mesh(shape = 4) {flint.axis_names = ["dp_shard_in_ep"]}
// EP:      func.func @block_fwd(%x: tensor<1x4x8xf32> {{.*}}, %gate: tensor<1x8xf32> {{.*}}, %wgu: tensor<1x24x8xf32> {{.*}}, %wd: tensor<1x8x12xf32>
// EP:      dist.all_gather {{.*}} : tensor<8xf32> -> !dist.future<tensor<32xf32>>
// EP-NOT:  dist.all_gather
// EP:      "aten.histc.default"
// EP-NEXT: dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 0 : tensor<4xi64> -> !dist.future<tensor<4xi64>>
// EP-NEXT: dist.wait
// EP-NEXT: "aten.view.default"({{.*}} : (tensor<4xi64>) -> tensor<4x1xi64>
// EP-NEXT: "aten.sum.dim_IntList"({{.*}} args = {dim = [0 : i64]} : (tensor<4x1xi64>) -> tensor<1xi64>
// EP-NEXT: %[[OFFS:.*]] = aten.op "aten.cumsum.default"({{.*}} : (tensor<1xi64>) -> tensor<1xi32>
// EP-NEXT: dist.all_to_all %{{.*}} on @mesh grid_axes = [0] split_dim = 0 concat_dim = 0 : tensor<8x8xf32> -> !dist.future<tensor<8x8xf32>>
// EP-NEXT: %[[ROWS:.*]] = dist.wait
// EP-NEXT: "aten._grouped_mm.default"(%[[ROWS]], %{{.*}}, %[[OFFS]]) {{.*}} : (tensor<8x8xf32>, tensor<1x8x24xf32>, tensor<1xi32>) -> tensor<8x24xf32>
// EP-NOT:  dist.all_to_all
// EP:      "aten._grouped_mm.default"({{.*}}, %[[OFFS]]) {{.*}} : (tensor<8x12xf32>, tensor<1x12x8xf32>, tensor<1xi32>) -> tensor<8x8xf32>
// EP-NEXT: "aten.unsqueeze.default"
// EP-NEXT: dist.all_to_all %{{.*}} split_dim = 0 concat_dim = 0 : tensor<8x8xf32> -> !dist.future<tensor<8x8xf32>>
// EP-NEXT: dist.wait
// EP-NEXT: "aten.mul.Tensor"
// EP-NOT:  dist.all_to_all
// EP:      func.return
// EP:      func.func @block_bwd({{.*}} %offs: tensor<1xi32> {{.*}} %wgu: tensor<1x24x8xf32> {{.*}}, %wd: tensor<1x8x12xf32>
// EP-NOT:  aten.histc
// EP:      dist.all_to_all %{{.*}} split_dim = 0 concat_dim = 0 : tensor<8x8xf32> -> !dist.future<tensor<8x8xf32>>
// EP-NEXT: %[[G:.*]] = dist.wait
// EP-NEXT: %[[GT:.*]] = aten.op "aten.t.default"(%[[G]])
// EP-NEXT: "aten._grouped_mm.default"(%[[GT]], %act, %offs) {{.*}} -> tensor<1x8x12xf32>
// EP-NEXT: "aten._grouped_mm.default"(%[[G]], %{{.*}}, %offs) {{.*}} -> tensor<8x12xf32>
// EP-NOT:  dist.all_to_all
// EP:      "aten._grouped_mm.default"({{.*}}, %xs, %offs) {{.*}} -> tensor<1x24x8xf32>
// EP-NEXT: "aten._grouped_mm.default"({{.*}} -> tensor<8x8xf32>
// EP-NEXT: dist.all_to_all %{{.*}} split_dim = 0 concat_dim = 0 : tensor<8x8xf32> -> !dist.future<tensor<8x8xf32>>
// EP-NOT:  dist.all_to_all
// EP:      dist.reduce_scatter {{.*}} : tensor<32xf32> -> !dist.future<tensor<8xf32>>
// EP-NOT:  dist.reduce_scatter
// EP:      func.return

// ep = 2 inside dp_shard = 4: two experts per rank, FSDP-sharded over dp_shard_mod_ep (their own gather and
// reduce-scatter of both expert weights: 2 x (24 x 8 + 8 x 12) = 576 elements), exchanges over dp_shard_in_ep.
// EPFSDP:      shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard_mod_ep", "dp_shard_in_ep"]}
// EPFSDP:      func.func @block_fwd
// EPFSDP:      dist.all_gather {{.*}} grid_axes = [0] gather_dim = 0 : tensor<288xf32> -> !dist.future<tensor<576xf32>>
// EPFSDP:      dist.all_gather {{.*}} grid_axes = [0, 1] gather_dim = 0 : tensor<8xf32> -> !dist.future<tensor<32xf32>>
// EPFSDP:      dist.all_to_all %{{.*}} grid_axes = [1] split_dim = 0 concat_dim = 0 : tensor<4xi64>
// EPFSDP:      "aten.cumsum.default"({{.*}} : (tensor<2xi64>) -> tensor<2xi32>
// EPFSDP:      dist.all_to_all %{{.*}} grid_axes = [1] split_dim = 0 concat_dim = 0 : tensor<8x8xf32>
// EPFSDP:      "aten._grouped_mm.default"({{.*}} : (tensor<8x8xf32>, tensor<2x8x24xf32>, tensor<2xi32>) -> tensor<8x24xf32>
// EPFSDP:      func.func @block_bwd
// EPFSDP:      dist.reduce_scatter {{.*}} grid_axes = [0] scatter_dim = 0 : tensor<576xf32> -> !dist.future<tensor<288xf32>>
// EPFSDP:      dist.reduce_scatter {{.*}} grid_axes = [0, 1] scatter_dim = 0 : tensor<32xf32> -> !dist.future<tensor<8xf32>>

// transformers' all-to-all is dropless: a capacity factor is refused by name.
// CAP: error: plan field 'capacity_factor': 2: Hugging Face's grouped-GEMM experts run expert parallelism as transformers' AllToAllEP, which is dropless

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<4x4x8xf32> {flint.role = "activation"}, %gate: tensor<4x8xf32> {flint.role = "parameter", flint.param = "model.layers.0.mlp.gate.weight"}, %wgu: tensor<4x24x8xf32> {flint.role = "parameter", flint.param = "model.layers.0.mlp.experts.gate_up_proj"}, %wd: tensor<4x8x12xf32> {flint.role = "parameter", flint.param = "model.layers.0.mlp.experts.down_proj"}) -> (tensor<4x4x8xf32>, tensor<16x8xf32>, tensor<16x4xf32>, tensor<32xi64>, tensor<32xi64>, tensor<32x8xf32>, tensor<4xi32>, tensor<32x24xf32>, tensor<32x12xf32>, tensor<32x8xf32>, tensor<32x1xf32>) {
    %0 = aten.op "aten.view.default"(%x) phase = "fwd" module = "mlp" args = {size = [16 : i64, 8 : i64]} : (tensor<4x4x8xf32>) -> tensor<16x8xf32>
    %1 = aten.op "aten.t.default"(%gate) phase = "fwd" module = "mlp.gate" : (tensor<4x8xf32>) -> tensor<8x4xf32>
    %2 = aten.op "aten.mm.default"(%0, %1) phase = "fwd" module = "mlp.gate" : (tensor<16x8xf32>, tensor<8x4xf32>) -> tensor<16x4xf32>
    %3 = aten.op "aten._softmax.default"(%2) phase = "fwd" module = "mlp.gate" args = {dim = -1 : i64, half_to_float = false} : (tensor<16x4xf32>) -> tensor<16x4xf32>
    %4, %5 = aten.op "aten.topk.default"(%3) phase = "fwd" module = "mlp.gate" args = {k = 2 : i64} : (tensor<16x4xf32>) -> (tensor<16x2xf32>, tensor<16x2xi64>)
    %6 = aten.op "aten.view.default"(%5) phase = "fwd" module = "mlp.experts" args = {size = [-1 : i64]} : (tensor<16x2xi64>) -> tensor<32xi64>
    %7, %8 = aten.op "aten.sort.default"(%6) phase = "fwd" module = "mlp.experts" : (tensor<32xi64>) -> (tensor<32xi64>, tensor<32xi64>)
    %9 = aten.op "aten.floor_divide.default"(%8) phase = "fwd" module = "mlp.experts" args = {other = 2 : i64} : (tensor<32xi64>) -> tensor<32xi64>
    %10 = aten.op "aten.index.Tensor"(%0, %9) phase = "fwd" module = "mlp.experts" : (tensor<16x8xf32>, tensor<32xi64>) -> tensor<32x8xf32>
    %11 = aten.op "aten.view.default"(%4) phase = "fwd" module = "mlp.experts" args = {size = [-1 : i64]} : (tensor<16x2xf32>) -> tensor<32xf32>
    %12 = aten.op "aten.index.Tensor"(%11, %8) phase = "fwd" module = "mlp.experts" : (tensor<32xf32>, tensor<32xi64>) -> tensor<32xf32>
    %13 = aten.op "aten._to_copy.default"(%7) phase = "fwd" module = "mlp.experts" args = {dtype = "torch.int32"} : (tensor<32xi64>) -> tensor<32xi32>
    %14 = aten.op "aten.histc.default"(%13) phase = "fwd" module = "mlp.experts" args = {bins = 4 : i64, min = 0 : i64, max = 3 : i64} : (tensor<32xi32>) -> tensor<4xi32>
    %15 = aten.op "aten.cumsum.default"(%14) phase = "fwd" module = "mlp.experts" args = {dim = 0 : i64, dtype = "torch.int32"} : (tensor<4xi32>) -> tensor<4xi32>
    %16 = aten.op "aten.transpose.int"(%wgu) phase = "fwd" module = "mlp.experts" args = {dim0 = -2 : i64, dim1 = -1 : i64} : (tensor<4x24x8xf32>) -> tensor<4x8x24xf32>
    %17 = aten.op "aten._grouped_mm.default"(%10, %16, %15) phase = "fwd" module = "mlp.experts" : (tensor<32x8xf32>, tensor<4x8x24xf32>, tensor<4xi32>) -> tensor<32x24xf32>
    %18, %19 = aten.op "aten.split.Tensor"(%17) phase = "fwd" module = "mlp.experts" args = {split_size = 12 : i64, dim = -1 : i64} : (tensor<32x24xf32>) -> (tensor<32x12xf32>, tensor<32x12xf32>)
    %20 = aten.op "aten.silu.default"(%18) phase = "fwd" module = "mlp.experts" : (tensor<32x12xf32>) -> tensor<32x12xf32>
    %21 = aten.op "aten.mul.Tensor"(%20, %19) phase = "fwd" module = "mlp.experts" : (tensor<32x12xf32>, tensor<32x12xf32>) -> tensor<32x12xf32>
    %22 = aten.op "aten.transpose.int"(%wd) phase = "fwd" module = "mlp.experts" args = {dim0 = -2 : i64, dim1 = -1 : i64} : (tensor<4x8x12xf32>) -> tensor<4x12x8xf32>
    %23 = aten.op "aten._grouped_mm.default"(%21, %22, %15) phase = "fwd" module = "mlp.experts" : (tensor<32x12xf32>, tensor<4x12x8xf32>, tensor<4xi32>) -> tensor<32x8xf32>
    %24 = aten.op "aten.unsqueeze.default"(%12) phase = "fwd" module = "mlp.experts" args = {dim = -1 : i64} : (tensor<32xf32>) -> tensor<32x1xf32>
    %25 = aten.op "aten.mul.Tensor"(%23, %24) phase = "fwd" module = "mlp.experts" : (tensor<32x8xf32>, tensor<32x1xf32>) -> tensor<32x8xf32>
    %26 = aten.op "aten.empty_like.default"(%8) phase = "fwd" module = "mlp.experts" : (tensor<32xi64>) -> tensor<32xi64>
    %27 = aten.op "aten.arange.default"() phase = "fwd" module = "mlp.experts" args = {end = 32 : i64} : () -> tensor<32xi64>
    %28 = aten.op "aten.index_put.default"(%26, %8, %27) phase = "fwd" module = "mlp.experts" : (tensor<32xi64>, tensor<32xi64>, tensor<32xi64>) -> tensor<32xi64>
    %29 = aten.op "aten.index.Tensor"(%25, %28) phase = "fwd" module = "mlp.experts" : (tensor<32x8xf32>, tensor<32xi64>) -> tensor<32x8xf32>
    %30 = aten.op "aten.view.default"(%29) phase = "fwd" module = "mlp.experts" args = {size = [16 : i64, 2 : i64, 8 : i64]} : (tensor<32x8xf32>) -> tensor<16x2x8xf32>
    %31 = aten.op "aten.sum.dim_IntList"(%30) phase = "fwd" module = "mlp.experts" args = {dim = [1 : i64]} : (tensor<16x2x8xf32>) -> tensor<16x8xf32>
    %32 = aten.op "aten.view.default"(%31) phase = "fwd" module = "mlp" args = {size = [4 : i64, 4 : i64, 8 : i64]} : (tensor<16x8xf32>) -> tensor<4x4x8xf32>
    func.return %32, %0, %3, %9, %28, %10, %15, %17, %21, %23, %24 : tensor<4x4x8xf32>, tensor<16x8xf32>, tensor<16x4xf32>, tensor<32xi64>, tensor<32xi64>, tensor<32x8xf32>, tensor<4xi32>, tensor<32x24xf32>, tensor<32x12xf32>, tensor<32x8xf32>, tensor<32x1xf32>
  }
  func.func @block_bwd(%flat: tensor<16x8xf32> {flint.role = "saved"}, %scores: tensor<16x4xf32> {flint.role = "saved"}, %tok: tensor<32xi64> {flint.role = "saved"}, %inv: tensor<32xi64> {flint.role = "saved"}, %xs: tensor<32x8xf32> {flint.role = "saved"}, %offs: tensor<4xi32> {flint.role = "saved"}, %gu: tensor<32x24xf32> {flint.role = "saved"}, %act: tensor<32x12xf32> {flint.role = "saved"}, %down: tensor<32x8xf32> {flint.role = "saved"}, %wu: tensor<32x1xf32> {flint.role = "saved"}, %wgu: tensor<4x24x8xf32> {flint.role = "parameter", flint.param = "model.layers.0.mlp.experts.gate_up_proj"}, %wd: tensor<4x8x12xf32> {flint.role = "parameter", flint.param = "model.layers.0.mlp.experts.down_proj"}, %g: tensor<4x4x8xf32> {flint.role = "tangent"}) -> (tensor<4x4x8xf32>, tensor<4x8xf32>, tensor<4x24x8xf32>, tensor<4x8x12xf32>) {
    %0 = aten.op "aten.view.default"(%g) phase = "bwd" args = {size = [16 : i64, 8 : i64]} : (tensor<4x4x8xf32>) -> tensor<16x8xf32>
    %1 = aten.op "aten.unsqueeze.default"(%0) phase = "bwd" args = {dim = 1 : i64} : (tensor<16x8xf32>) -> tensor<16x1x8xf32>
    %2 = aten.op "aten.expand.default"(%1) phase = "bwd" args = {size = [16 : i64, 2 : i64, 8 : i64]} : (tensor<16x1x8xf32>) -> tensor<16x2x8xf32>
    %3 = aten.op "aten.clone.default"(%2) phase = "bwd" : (tensor<16x2x8xf32>) -> tensor<16x2x8xf32>
    %4 = aten.op "aten._unsafe_view.default"(%3) phase = "bwd" args = {size = [32 : i64, 8 : i64]} : (tensor<16x2x8xf32>) -> tensor<32x8xf32>
    %5 = aten.op "aten.new_zeros.default"(%4) phase = "bwd" args = {size = [32 : i64, 8 : i64]} : (tensor<32x8xf32>) -> tensor<32x8xf32>
    %6 = aten.op "aten.index_put.default"(%5, %inv, %4) phase = "bwd" args = {accumulate = true} : (tensor<32x8xf32>, tensor<32xi64>, tensor<32x8xf32>) -> tensor<32x8xf32>
    %7 = aten.op "aten.mul.Tensor"(%6, %down) phase = "bwd" : (tensor<32x8xf32>, tensor<32x8xf32>) -> tensor<32x8xf32>
    %8 = aten.op "aten.mul.Tensor"(%6, %wu) phase = "bwd" : (tensor<32x8xf32>, tensor<32x1xf32>) -> tensor<32x8xf32>
    %9 = aten.op "aten.sum.dim_IntList"(%7) phase = "bwd" args = {dim = [1 : i64], keepdim = true} : (tensor<32x8xf32>) -> tensor<32x1xf32>
    %10 = aten.op "aten.t.default"(%8) phase = "bwd" : (tensor<32x8xf32>) -> tensor<8x32xf32>
    %11 = aten.op "aten._grouped_mm.default"(%10, %act, %offs) phase = "bwd" : (tensor<8x32xf32>, tensor<32x12xf32>, tensor<4xi32>) -> tensor<4x8x12xf32>
    %12 = aten.op "aten._grouped_mm.default"(%8, %wd, %offs) phase = "bwd" : (tensor<32x8xf32>, tensor<4x8x12xf32>, tensor<4xi32>) -> tensor<32x12xf32>
    %13, %14 = aten.op "aten.split.Tensor"(%gu) phase = "bwd" args = {split_size = 12 : i64, dim = -1 : i64} : (tensor<32x24xf32>) -> (tensor<32x12xf32>, tensor<32x12xf32>)
    %15 = aten.op "aten.silu.default"(%13) phase = "bwd" : (tensor<32x12xf32>) -> tensor<32x12xf32>
    %16 = aten.op "aten.mul.Tensor"(%12, %15) phase = "bwd" : (tensor<32x12xf32>, tensor<32x12xf32>) -> tensor<32x12xf32>
    %17 = aten.op "aten.mul.Tensor"(%12, %14) phase = "bwd" : (tensor<32x12xf32>, tensor<32x12xf32>) -> tensor<32x12xf32>
    %18 = aten.op "aten.silu_backward.default"(%17, %13) phase = "bwd" : (tensor<32x12xf32>, tensor<32x12xf32>) -> tensor<32x12xf32>
    %19 = aten.op "aten.cat.default"(%18, %16) phase = "bwd" args = {dim = 1 : i64} : (tensor<32x12xf32>, tensor<32x12xf32>) -> tensor<32x24xf32>
    %20 = aten.op "aten.t.default"(%19) phase = "bwd" : (tensor<32x24xf32>) -> tensor<24x32xf32>
    %21 = aten.op "aten._grouped_mm.default"(%20, %xs, %offs) phase = "bwd" : (tensor<24x32xf32>, tensor<32x8xf32>, tensor<4xi32>) -> tensor<4x24x8xf32>
    %22 = aten.op "aten._grouped_mm.default"(%19, %wgu, %offs) phase = "bwd" : (tensor<32x24xf32>, tensor<4x24x8xf32>, tensor<4xi32>) -> tensor<32x8xf32>
    %23 = aten.op "aten.new_zeros.default"(%22) phase = "bwd" args = {size = [16 : i64, 8 : i64]} : (tensor<32x8xf32>) -> tensor<16x8xf32>
    %24 = aten.op "aten.index_put.default"(%23, %tok, %22) phase = "bwd" args = {accumulate = true} : (tensor<16x8xf32>, tensor<32xi64>, tensor<32x8xf32>) -> tensor<16x8xf32>
    %25 = aten.op "aten.view.default"(%24) phase = "bwd" args = {size = [4 : i64, 4 : i64, 8 : i64]} : (tensor<16x8xf32>) -> tensor<4x4x8xf32>
    %26 = aten.op "aten.t.default"(%scores) phase = "bwd" : (tensor<16x4xf32>) -> tensor<4x16xf32>
    %27 = aten.op "aten.mm.default"(%26, %flat) phase = "bwd" : (tensor<4x16xf32>, tensor<16x8xf32>) -> tensor<4x8xf32>
    func.return %25, %27, %21, %11 : tensor<4x4x8xf32>, tensor<4x8xf32>, tensor<4x24x8xf32>, tensor<4x8x12xf32>
  }
}
