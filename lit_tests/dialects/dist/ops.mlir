// RUN: flint-opt %s | filecheck %s
// RUN: flint-opt %s --print-op-generic | filecheck %s --check-prefix=GENERIC
// RUN: flint-opt %s --print-op-generic | flint-opt | filecheck %s

shard.grid @grid(shape = 2x4)

// CHECK-LABEL: func.func @collectives
func.func @collectives(%x: tensor<4x8xf32>) -> tensor<16x8xf32> {
  // CHECK: %[[AG:.*]] = dist.all_gather %{{.*}} on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> tensor<16x8xf32>
  // GENERIC: "dist.all_gather"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 1>, gather_dim = 0 : i64}> : (tensor<4x8xf32>) -> tensor<16x8xf32>
  %0 = dist.all_gather %x on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> tensor<16x8xf32>
  // CHECK: %[[F:.*]] = dist.all_reduce %{{.*}} on @grid grid_axes = [0, 1] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  // GENERIC: "dist.all_reduce"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 0, 1>, reduction = #shard<partial sum>}> : (tensor<4x8xf32>) -> !dist.future<tensor<4x8xf32>>
  %1 = dist.all_reduce %x on @grid grid_axes = [0, 1] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  // CHECK-NEXT: dist.wait %[[F]] : tensor<4x8xf32>
  // GENERIC: "dist.wait"(%{{.*}}) : (!dist.future<tensor<4x8xf32>>) -> tensor<4x8xf32>
  %2 = dist.wait %1 : tensor<4x8xf32>
  // CHECK: dist.all_reduce %{{.*}} on @grid grid_axes = [0] reduction = max : tensor<4x8xf32> -> tensor<4x8xf32>
  %3 = dist.all_reduce %x on @grid grid_axes = [0] reduction = max : tensor<4x8xf32> -> tensor<4x8xf32>
  // CHECK: dist.reduce_scatter %{{.*}} on @grid grid_axes = [1] scatter_dim = 0 : tensor<4x8xf32> -> tensor<1x8xf32>
  // GENERIC: "dist.reduce_scatter"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 1>, scatter_dim = 0 : i64, reduction = #shard<partial sum>}>
  %4 = dist.reduce_scatter %x on @grid grid_axes = [1] scatter_dim = 0 : tensor<4x8xf32> -> tensor<1x8xf32>
  // CHECK: dist.all_to_all %{{.*}} on @grid grid_axes = [1] split_dim = 1 concat_dim = 0 : tensor<4x8xf32> -> tensor<16x2xf32>
  // GENERIC: "dist.all_to_all"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 1>, split_dim = 1 : i64, concat_dim = 0 : i64}>
  %5 = dist.all_to_all %x on @grid grid_axes = [1] split_dim = 1 concat_dim = 0 : tensor<4x8xf32> -> tensor<16x2xf32>
  // CHECK: dist.broadcast %{{.*}} on @grid grid_axes = [0] root = 1 : tensor<4x8xf32> -> tensor<4x8xf32>
  // GENERIC: "dist.broadcast"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 0>, root = 1 : i64}>
  %6 = dist.broadcast %x on @grid grid_axes = [0] root = 1 : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return %0 : tensor<16x8xf32>
}

// CHECK-LABEL: func.func @sync_points
func.func @sync_points(%x: tensor<4x8xbf16>) {
  // CHECK: dist.barrier on @grid grid_axes = [0]
  // GENERIC: "dist.barrier"() <{grid = @grid, grid_axes = array<i16: 0>}> : () -> ()
  dist.barrier on @grid grid_axes = [0]
  // CHECK: %[[B:.*]] = dist.barrier on @grid grid_axes = [0, 1] : !dist.future<none>
  %0 = dist.barrier on @grid grid_axes = [0, 1] : !dist.future<none>
  // CHECK-NEXT: dist.wait %[[B]]
  // GENERIC: "dist.wait"(%{{.*}}) : (!dist.future<none>) -> ()
  dist.wait %0
  // CHECK: dist.send %{{.*}} to @grid grid_axes = [1] offset = 1 tag = 0 : tensor<4x8xbf16>
  // GENERIC: "dist.send"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 1>, offset = 1 : i64, tag = 0 : i64}> : (tensor<4x8xbf16>) -> ()
  dist.send %x to @grid grid_axes = [1] offset = 1 tag = 0 : tensor<4x8xbf16>
  // CHECK: %[[S:.*]] = dist.send %{{.*}} to @grid grid_axes = [1] offset = -1 tag = 3 : tensor<4x8xbf16> -> !dist.future<none>
  %1 = dist.send %x to @grid grid_axes = [1] offset = -1 tag = 3 : tensor<4x8xbf16> -> !dist.future<none>
  dist.wait %1
  // CHECK: dist.recv from @grid grid_axes = [1] offset = -1 tag = 0 : tensor<4x8xbf16>
  // GENERIC: "dist.recv"() <{grid = @grid, grid_axes = array<i16: 1>, offset = -1 : i64, tag = 0 : i64}> : () -> tensor<4x8xbf16>
  %2 = dist.recv from @grid grid_axes = [1] offset = -1 tag = 0 : tensor<4x8xbf16>
  // CHECK: %[[R:.*]] = dist.recv from @grid grid_axes = [1] offset = 1 tag = 3 : !dist.future<tensor<4x8xbf16>>
  %3 = dist.recv from @grid grid_axes = [1] offset = 1 tag = 3 : !dist.future<tensor<4x8xbf16>>
  // CHECK-NEXT: dist.wait %[[R]] : tensor<4x8xbf16>
  %4 = dist.wait %3 : tensor<4x8xbf16>
  // A step loop: one body, the peer and the tag affine in the step index, the buffer carried.
  // CHECK: %[[T:.*]], %[[O:.*]] = dist.steps 3 (%{{.*}}) : tensor<4x8xbf16> {
  // CHECK-NEXT: ^bb0(%[[C:.*]]: tensor<4x8xbf16>):
  // CHECK-NEXT: dist.send %[[C]] to @grid grid_axes = [1] offset = 1 tag = 5 offset_step = 1 tag_step = 1 : tensor<4x8xbf16> -> !dist.future<none>
  // CHECK-NEXT: %[[V:.*]] = dist.recv from @grid grid_axes = [1] offset = -1 tag = 5 offset_step = -1 tag_step = 1 : tensor<4x8xbf16>
  // CHECK-NEXT: dist.yield %[[V]] : tensor<4x8xbf16>
  // CHECK-NEXT: }
  // CHECK-NEXT: dist.wait %[[T]]
  // GENERIC: "dist.steps"(%{{.*}}) <{count = 3 : i64}> ({
  // GENERIC: "dist.send"(%{{.*}}) <{grid = @grid, grid_axes = array<i16: 1>, offset = 1 : i64, tag = 5 : i64, offset_step = 1 : i64, tag_step = 1 : i64}>
  %5, %6 = dist.steps 3 (%2) : tensor<4x8xbf16> {
  ^bb0(%c: tensor<4x8xbf16>):
    %7 = dist.send %c to @grid grid_axes = [1] offset = 1 tag = 5 offset_step = 1 tag_step = 1 : tensor<4x8xbf16> -> !dist.future<none>
    %8 = dist.recv from @grid grid_axes = [1] offset = -1 tag = 5 offset_step = -1 tag_step = 1 : tensor<4x8xbf16>
    dist.yield %8 : tensor<4x8xbf16>
  }
  dist.wait %5
  func.return
}
