// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2},shard-expand' | filecheck %s --check-prefix=FSDP
// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2},shard-expand' | filecheck %s --check-prefix=DDP
// flint-opt verifies the module after every pass.
// Batch norm (rule batch_norm) and max pooling (rule per_sample) split over the batch: a block of a CNN as the
// single-device capture gives it. Each rank normalizes by its own batch's statistics and updates its own running
// statistics (as DDP and FSDP run BatchNorm, not SyncBatchNorm): no collective in the forward but FSDP's gather
// of the weight and bias; their gradients are sums over the batch, reduced with the block's unit (FSDP's
// reduce-scatter, DDP's all-reduce). The forward returns the running statistics' new values first (AOTAutograd's
// mutated buffers), then its output, then what the backward saves: the saved values' layouts are taken from the
// end of the forward's results (they were taken from after its outputs, one per tangent: here the buffers').

// FSDP:      func.func @block_fwd(%x: tensor<2x8x8x8xf32> {{.*}}, %w: tensor<4xf32> {{.*}}, %b: tensor<4xf32> {{.*}}, %rm: tensor<8xf32> {{.*}}, %rv: tensor<8xf32>
// FSDP:      dist.all_gather %{{.*}} on @mesh grid_axes = [0] gather_dim = 0 : tensor<8xf32> -> !dist.future<tensor<16xf32>>
// FSDP:      aten.op "aten._native_batch_norm_legit_functional.default"(%x, %{{.*}}, %{{.*}}, %rm, %rv) {{.*}} : (tensor<2x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> (tensor<2x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>)
// FSDP-NEXT: aten.op "aten.max_pool2d_with_indices.default"(%{{.*}}) {{.*}} : (tensor<2x8x8x8xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x8x4x4xi64>)
// FSDP-NEXT: func.return
// FSDP:      func.func @block_bwd(%x: tensor<2x8x8x8xf32> {{.*}}, %w: tensor<4xf32> {{.*}}, %rm: tensor<8xf32> {{.*}}, %rv: tensor<8xf32> {{.*}}, %mean: tensor<8xf32> {{.*}}, %rstd: tensor<8xf32> {{.*}}, %y: tensor<2x8x8x8xf32> {{.*}}, %idx: tensor<2x8x4x4xi64> {{.*}}, %g: tensor<2x8x4x4xf32>
// FSDP:      dist.all_gather
// FSDP:      aten.op "aten.max_pool2d_with_indices_backward.default"(%g, %y, %idx) {{.*}} -> tensor<2x8x8x8xf32>
// FSDP-NEXT: aten.op "aten.native_batch_norm_backward.default"({{.*}}) {{.*}} -> (tensor<2x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>)
// FSDP:      dist.reduce_scatter %{{.*}} on @mesh grid_axes = [0] scatter_dim = 0 : tensor<16xf32> -> !dist.future<tensor<8xf32>>
// FSDP:      func.return %{{.*}}, %{{.*}}, %{{.*}} : tensor<2x8x8x8xf32>, tensor<4xf32>, tensor<4xf32>

// DDP:       func.func @block_fwd(%x: tensor<2x8x8x8xf32> {{.*}}, %w: tensor<8xf32> {{.*}}, %b: tensor<8xf32>
// DDP-NOT:   dist.
// DDP:       aten.op "aten._native_batch_norm_legit_functional.default"(%x, %w, %b, %rm, %rv)
// DDP-NEXT:  aten.op "aten.max_pool2d_with_indices.default"
// DDP-NEXT:  func.return
// DDP:       func.func @block_bwd
// DDP-NOT:   dist.
// DDP:       aten.op "aten.native_batch_norm_backward.default"(%{{.*}}, %x, %w, %rm, %rv, %mean, %rstd) {{.*}} -> (tensor<2x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>)
// DDP:       dist.all_reduce %{{.*}} on @mesh grid_axes = [0] reduction = average : tensor<16xf32>
// DDP:       func.return %{{.*}}, %{{.*}}, %{{.*}} : tensor<2x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<4x8x8x8xf32> {flint.role = "activation"}, %w: tensor<8xf32> {flint.role = "parameter", flint.param = "layers.0.bn.weight"}, %b: tensor<8xf32> {flint.role = "parameter", flint.param = "layers.0.bn.bias"}, %rm: tensor<8xf32> {flint.role = "buffer", flint.param = "layers.0.bn.running_mean"}, %rv: tensor<8xf32> {flint.role = "buffer", flint.param = "layers.0.bn.running_var"}) -> (tensor<8xf32>, tensor<8xf32>, tensor<4x8x4x4xf32>, tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<4x8x8x8xf32>, tensor<4x8x4x4xi64>) {
    %0, %1, %2, %3, %4 = aten.op "aten._native_batch_norm_legit_functional.default"(%x, %w, %b, %rm, %rv) phase = "fwd" module = "layers.0.bn" args = {training = true, momentum = 1.000000e-01 : f64, eps = 1.000000e-05 : f64} : (tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> (tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>)
    %5, %6 = aten.op "aten.max_pool2d_with_indices.default"(%0) phase = "fwd" module = "layers.0" args = {kernel_size = [2 : i64, 2 : i64]} : (tensor<4x8x8x8xf32>) -> (tensor<4x8x4x4xf32>, tensor<4x8x4x4xi64>)
    func.return %3, %4, %5, %x, %w, %3, %4, %1, %2, %0, %6 : tensor<8xf32>, tensor<8xf32>, tensor<4x8x4x4xf32>, tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<4x8x8x8xf32>, tensor<4x8x4x4xi64>
  }
  func.func @block_bwd(%x: tensor<4x8x8x8xf32> {flint.role = "saved"}, %w: tensor<8xf32> {flint.role = "parameter", flint.param = "layers.0.bn.weight"}, %rm: tensor<8xf32> {flint.role = "saved"}, %rv: tensor<8xf32> {flint.role = "saved"}, %mean: tensor<8xf32> {flint.role = "saved"}, %rstd: tensor<8xf32> {flint.role = "saved"}, %y: tensor<4x8x8x8xf32> {flint.role = "saved"}, %idx: tensor<4x8x4x4xi64> {flint.role = "saved"}, %g: tensor<4x8x4x4xf32> {flint.role = "tangent"}) -> (tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>) {
    %0 = aten.op "aten.max_pool2d_with_indices_backward.default"(%g, %y, %idx) phase = "bwd" module = "layers.0" args = {kernel_size = [2 : i64, 2 : i64], stride = [], padding = [0 : i64, 0 : i64], dilation = [1 : i64, 1 : i64], ceil_mode = false} : (tensor<4x8x4x4xf32>, tensor<4x8x8x8xf32>, tensor<4x8x4x4xi64>) -> tensor<4x8x8x8xf32>
    %1, %2, %3 = aten.op "aten.native_batch_norm_backward.default"(%0, %x, %w, %rm, %rv, %mean, %rstd) phase = "bwd" module = "layers.0.bn" args = {train = true, eps = 1.000000e-05 : f64, output_mask = [true, true, true]} : (tensor<4x8x8x8xf32>, tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) -> (tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>)
    func.return %1, %2, %3 : tensor<4x8x8x8xf32>, tensor<8xf32>, tensor<8xf32>
  }
}
