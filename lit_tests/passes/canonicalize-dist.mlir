// RUN: flint-opt %s -p canonicalize-dist | filecheck %s
// RUN: flint-opt %s -p 'canonicalize-dist{fold-waits=false}' | filecheck %s --check-prefix=NOFOLD
// RUN: flint-opt %s -p 'canonicalize-dist{drop-single-rank=false}' | filecheck %s --check-prefix=KEEP
// flint-opt verifies the module after every pass; these RUN lines fail if it does not verify.

shard.grid @grid(shape = 1x4)

// CHECK-LABEL: func.func @single_rank_group
// NOFOLD-LABEL: func.func @single_rank_group
// KEEP-LABEL: func.func @single_rank_group
func.func @single_rank_group(%x: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  // Axis 0 has one rank: the collective, its wait and the barrier go away.
  // CHECK-NOT: dist.
  // CHECK: func.return %{{.*}}, %{{.*}} : tensor<4x8xf32>, tensor<4x8xf32>
  // NOFOLD-NOT: dist.
  // KEEP: dist.all_reduce %{{.*}} on @grid grid_axes = [0] : tensor<4x8xf32> -> tensor<4x8xf32>
  // KEEP: dist.barrier on @grid grid_axes = [0]
  %0 = dist.all_reduce %x on @grid grid_axes = [0] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  %1 = dist.wait %0 : tensor<4x8xf32>
  dist.barrier on @grid grid_axes = [0]
  %2 = dist.all_gather %x on @grid grid_axes = [0] gather_dim = 1 : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return %1, %2 : tensor<4x8xf32>, tensor<4x8xf32>
}

// CHECK-LABEL: func.func @fold_waits
// NOFOLD-LABEL: func.func @fold_waits
func.func @fold_waits(%x: tensor<4x8xf32>) -> (tensor<16x8xf32>, tensor<16x8xf32>) {
  // A wait right after its start becomes the synchronous form ...
  // CHECK: %[[A:.*]] = dist.all_gather %{{.*}} on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> tensor<16x8xf32>
  // NOFOLD: dist.all_gather %{{.*}} on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> !dist.future<tensor<16x8xf32>>
  // NOFOLD-NEXT: dist.wait
  %0 = dist.all_gather %x on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> !dist.future<tensor<16x8xf32>>
  %1 = dist.wait %0 : tensor<16x8xf32>
  // ... but one with work in between keeps its overlap.
  // CHECK: %[[F:.*]] = dist.all_gather %{{.*}} on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> !dist.future<tensor<16x8xf32>>
  // CHECK-NEXT: aten.op "aten.relu.default"
  // CHECK-NEXT: %[[B:.*]] = dist.wait %[[F]] : tensor<16x8xf32>
  // CHECK: func.return %[[A]], %[[B]]
  %2 = dist.all_gather %x on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> !dist.future<tensor<16x8xf32>>
  %3 = aten.op "aten.relu.default"(%x) : (tensor<4x8xf32>) -> tensor<4x8xf32>
  %4 = dist.wait %2 : tensor<16x8xf32>
  func.return %1, %4 : tensor<16x8xf32>, tensor<16x8xf32>
}
