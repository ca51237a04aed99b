// RUN: flint-opt %s --split-input-file --verify-diagnostics | filecheck %s

shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_gather %x on @grid grid_axes = [2] gather_dim = 0 : tensor<4x8xf32> -> tensor<16x8xf32>
  func.return
}
// CHECK: ops_invalid.mlir:5:3: error: 'dist.all_gather' op grid axis 2 out of range for rank-2 grid @grid

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_gather %x on @grid grid_axes = [] gather_dim = 0 : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.all_gather' op needs at least one grid axis

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_reduce %x on @grid grid_axes = [1, 1] : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.all_reduce' op grid axes [1, 1] repeat an axis

// -----
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_reduce %x on @nowhere grid_axes = [0] : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.all_reduce' op grid @nowhere does not name a 'shard.grid'

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_gather %x on @grid grid_axes = [1] gather_dim = 0 : tensor<4x8xf32> -> tensor<8x8xf32>
  func.return
}
// CHECK: error: 'dist.all_gather' op result shape [8, 8] does not match expected [16, 8] for input [4, 8] over a group of 4

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_gather %x on @grid grid_axes = [1] gather_dim = 2 : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.all_gather' op gather_dim 2 out of range for rank-2 tensor

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_reduce %x on @grid grid_axes = [0] : tensor<4x8xf32> -> tensor<4x8xbf16>
  func.return
}
// CHECK: error: 'dist.all_reduce' op element type bf16 of the result does not match f32 of the input

// -----
shard.grid @grid(shape = 2x3)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.reduce_scatter %x on @grid grid_axes = [1] scatter_dim = 0 : tensor<4x8xf32> -> tensor<1x8xf32>
  func.return
}
// CHECK: error: 'dist.reduce_scatter' op scatter_dim 0 of size 4 is not divisible by the group size 3

// -----
shard.grid @grid(shape = 2x3)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_to_all %x on @grid grid_axes = [1] split_dim = 1 concat_dim = 0 : tensor<4x8xf32> -> tensor<12x2xf32>
  func.return
}
// CHECK: error: 'dist.all_to_all' op split_dim 1 of size 8 is not divisible by the group size 3

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_to_all %x on @grid grid_axes = [1] split_dim = 1 concat_dim = 5 : tensor<4x8xf32> -> tensor<16x2xf32>
  func.return
}
// CHECK: error: 'dist.all_to_all' op concat_dim 5 out of range for rank-2 tensor

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.broadcast %x on @grid grid_axes = [0] root = 2 : tensor<4x8xf32> -> tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.broadcast' op root 2 out of range for a group of 2

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  dist.send %x to @grid grid_axes = [0, 1] offset = 1 tag = 0 : tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.send' op needs exactly one grid axis, got [0, 1]

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  dist.send %x to @grid grid_axes = [1] offset = 4 tag = 0 : tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.send' op offset 4 names the rank itself on an axis of size 4

// -----
shard.grid @grid(shape = 2x4)
func.func @f() {
  %0 = dist.recv from @grid grid_axes = [1] offset = 1 tag = -2 : tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.recv' op tag -2 out of range: Chakra's comm_tag is an int32 (0..2147483647)

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.send %x to @grid grid_axes = [1] offset = 1 tag = 0 : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  func.return
}
// CHECK: error: 'dist.send' op asynchronous result must be !dist.future<none>, got !dist.future<tensor<4x8xf32>>

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.barrier on @grid grid_axes = [0] : !dist.future<tensor<4x8xf32>>
  func.return
}
// CHECK: error: 'dist.barrier' op asynchronous result must be !dist.future<none>, got !dist.future<tensor<4x8xf32>>

// -----
func.func @f(%x: !dist.future<tensor<4x8xf32>>) {
  %0 = "dist.wait"(%x) : (!dist.future<tensor<4x8xf32>>) -> tensor<2x8xf32>
  func.return
}
// CHECK: error: 'dist.wait' op result must be tensor<4x8xf32> to match !dist.future<tensor<4x8xf32>>, got tensor<2x8xf32>

// -----
func.func @f(%x: !dist.future<none>) {
  %0 = "dist.wait"(%x) : (!dist.future<none>) -> tensor<2x8xf32>
  func.return
}
// CHECK: error: 'dist.wait' op waits on !dist.future<none> and must not have a result

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  dist.send %x to @grid grid_axes = [1] offset = 1 tag = 4294967296 : tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.send' op tag 4294967296 out of range: Chakra's comm_tag is an int32 (0..2147483647)

// -----
shard.grid @grid(shape = 2000000x4)
// CHECK: ops_invalid.mlir:{{[0-9]+}}:1: error: 'shard.grid' op @grid shape 2000000x4 has 8,000,000 ranks; the limit is 1,048,576 ranks

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<?x8xf32>) {
  %0 = dist.all_reduce %x on @grid grid_axes = [1] : tensor<?x8xf32> -> tensor<?x8xf32>
  func.return
}
// CHECK: error: 'dist.all_reduce' op input tensor<?x8xf32> has a dynamic dimension; Flint needs static shapes (capture with concrete sizes)

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<8xf32>) {
  %t, %b = dist.steps 4 (%x) : tensor<8xf32> {
  ^bb0(%c: tensor<8xf32>):
    %s = dist.send %c to @grid grid_axes = [1] offset = 1 tag = 0 offset_step = 1 : tensor<8xf32> -> !dist.future<none>
    dist.yield %c : tensor<8xf32>
  }
  dist.wait %t
  func.return
}
// CHECK: error: 'dist.send' op offset at step 3 is 4: the rank itself on an axis of size 4

// -----
shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<8xf32>) {
  %t, %b = dist.steps 2 (%x) : tensor<8xf32> {
  ^bb0(%c: tensor<8xf32>):
    %y = aten.op "aten.view.default"(%c) : (tensor<8xf32>) -> tensor<2x4xf32>
    dist.yield %y : tensor<2x4xf32>
  }
  dist.wait %t
  func.return
}
// CHECK: error: 'dist.steps' op body must end with a 'dist.yield' of the carried values' types
