// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2},shard-expand' | filecheck %s --check-prefix=DP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2},shard-expand' | filecheck %s --check-prefix=FSDP
// RUN: flint-opt %s -p 'shard-annotate{tp=2},shard-expand' | filecheck %s --check-prefix=TP
// RUN: flint-opt %s -p 'shard-annotate{tp=2 sp=true},shard-expand' | filecheck %s --check-prefix=SP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 tp=2},shard-expand' | filecheck %s --check-prefix=FSDPTP
// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2 dp_shard=2},shard-expand' | filecheck %s --check-prefix=HSDP
// A two-matmul MLP block (w1 column-parallel, w2 row-parallel), forward and backward, on one device,
// expanded to each plan kind. flint-opt verifies the module after every pass.

// DP:      func.func @block_fwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<32x16xf32>
// DP-NOT:  {{= dist\.(all|reduce)}}
// DP:      func.func @block_bwd
// DP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [0] reduction = average : tensor<1024xf32>
// DP-NOT:  {{= dist\.(all|reduce)}}

// FSDP2's copy-in (cat of the shards) and copy-out (split_with_sizes_copy into the unsharded parameters)
// FSDP:      func.func @block_fwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<16x16xf32> {{.*}}, %w2: tensor<8x32xf32>
// FSDP:      aten.op "aten.cat.default"({{.*}} -> tensor<512xf32>
// FSDP-NEXT: dist.all_gather %{{.*}} on @mesh grid_axes = [0] gather_dim = 0 : tensor<512xf32> -> !dist.future<tensor<1024xf32>>
// FSDP:      aten.op "aten.split_with_sizes_copy.default"({{.*}}split_sizes = [256 : i64, 256 : i64], dim = 1 : i64} : (tensor<2x512xf32>) -> (tensor<2x256xf32>, tensor<2x256xf32>)
// FSDP-NOT:  {{= dist\.(all|reduce)}}
// FSDP:      func.func @block_bwd
// FSDP:      dist.all_gather %{{.*}} gather_dim = 0 : tensor<512xf32> -> !dist.future<tensor<1024xf32>>
// FSDP:      dist.reduce_scatter %{{.*}} scatter_dim = 0 : tensor<1024xf32> -> !dist.future<tensor<512xf32>>
// FSDP-NOT:  {{= dist\.(all|reduce)}}

// TP:      func.func @block_fwd(%x: tensor<4x8x16xf32> {{.*}}, %w1: tensor<16x16xf32> {{.*}}, %w2: tensor<16x16xf32>
// TP:      aten.op "aten.mm.default"(%{{.*}}, %{{.*}}) {{.*}} : (tensor<32x16xf32>, tensor<16x16xf32>) -> tensor<32x16xf32>
// TP:      aten.op "aten.mm.default"(%{{.*}}, %{{.*}}) {{.*}} : (tensor<32x16xf32>, tensor<16x16xf32>) -> tensor<32x16xf32>
// TP:      dist.all_reduce %{{.*}} on @mesh grid_axes = [0] : tensor<32x16xf32>
// TP-NOT:  {{= dist\.(all|reduce)}}
// TP:      func.func @block_bwd
// TP:      dist.all_reduce %{{.*}} : tensor<32x16xf32>
// TP-NOT:  {{= dist\.(all|reduce)}}

// The sequence (dim 1) gathered and scattered as PyTorch's functional collectives do it: NCCL works on
// dim 0, a chunk-cat copies after the all-gather and before the reduce-scatter.
// SP:      func.func @block_fwd(%x: tensor<4x4x16xf32>
// SP:      dist.all_gather %x on @mesh grid_axes = [0] gather_dim = 0 : tensor<4x4x16xf32> -> !dist.future<tensor<8x4x16xf32>>
// SP:      aten.op "aten.split.Tensor"({{.*}} : (tensor<8x4x16xf32>) -> (tensor<4x4x16xf32>, tensor<4x4x16xf32>)
// SP-NEXT: aten.op "aten.cat.default"({{.*}} args = {dim = 1 : i64} {{.*}} -> tensor<4x8x16xf32>
// SP:      aten.op "aten.split.Tensor"({{.*}} args = {split_size = 4 : i64, dim = 1 : i64} : (tensor<4x8x16xf32>)
// SP-NEXT: aten.op "aten.cat.default"({{.*}} args = {dim = 0 : i64} {{.*}} -> tensor<8x4x16xf32>
// SP-NEXT: dist.reduce_scatter %{{.*}} scatter_dim = 0 : tensor<8x4x16xf32> -> !dist.future<tensor<4x4x16xf32>>
// SP-NOT:  {{= dist\.(all|reduce)}}
// SP:      func.func @block_bwd
// SP:      dist.all_gather %g on @mesh grid_axes = [0] gather_dim = 0
// SP:      dist.reduce_scatter %{{.*}} scatter_dim = 0
// SP-NOT:  {{= dist\.(all|reduce)}}

// FSDPTP:      shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard", "tp"]}
// FSDPTP:      func.func @block_fwd(%x: tensor<2x8x16xf32> {{.*}}, %w1: tensor<8x16xf32> {{.*}}, %w2: tensor<8x16xf32>
// FSDPTP:      dist.all_gather %{{.*}} grid_axes = [0] gather_dim = 0 : tensor<256xf32> -> !dist.future<tensor<512xf32>>
// FSDPTP:      dist.all_reduce %{{.*}} grid_axes = [1] : tensor<16x16xf32>
// FSDPTP:      func.func @block_bwd
// FSDPTP:      dist.all_gather %{{.*}} grid_axes = [0] gather_dim = 0 : tensor<256xf32>
// FSDPTP:      dist.all_reduce %{{.*}} grid_axes = [1] : tensor<16x16xf32>
// FSDPTP:      dist.reduce_scatter %{{.*}} grid_axes = [0] scatter_dim = 0 : tensor<512xf32> -> !dist.future<tensor<256xf32>>

// HSDP:      func.func @block_bwd
// HSDP:      dist.reduce_scatter %{{.*}} grid_axes = [1] scatter_dim = 0 : tensor<1024xf32>
// HSDP-NEXT: dist.wait
// HSDP-NEXT: dist.all_reduce %{{.*}} grid_axes = [0] reduction = average : tensor<512xf32>

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
