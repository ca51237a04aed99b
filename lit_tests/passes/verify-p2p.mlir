// RUN: flint-opt %s --split-input-file --verify-diagnostics -p 'decompose-collectives{algorithm=tree chunks=2},verify-p2p' | filecheck %s

// A decomposed double-binary-tree all-reduce over 6 ranks verifies.
shard.grid @mesh(shape = 6)
func.func @ok(%x: tensor<24xf32>) -> tensor<24xf32> {
  %0 = dist.all_reduce %x on @mesh grid_axes = [0] : tensor<24xf32> -> tensor<24xf32>
  func.return %0 : tensor<24xf32>
}
// CHECK-LABEL: func.func @ok
// CHECK: dist.recv
// CHECK-NOT: dist.all_reduce

// -----
// CHECK: error: 'dist.send' op on rank 0 can never complete
// CHECK: note: the other op: 'dist.send'
shard.grid @mesh(shape = 4)
func.func @cycle(%x: tensor<8xf32>) -> tensor<8xf32> {
  %r = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 3 : tensor<8xf32>
  %y = aten.op "aten.add.Tensor"(%x, %r) : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
  dist.send %y to @mesh grid_axes = [0] offset = 1 tag = 3 : tensor<8xf32>
  func.return %r : tensor<8xf32>
}

// -----
// CHECK: error: 'dist.recv' op on rank 1 from rank 0 with tag 3 has no matching 'dist.send' on rank 0
// CHECK: note: the other op: 'dist.send'
shard.grid @mesh(shape = 4)
func.func @unmatched(%x: tensor<8xf32>) -> tensor<8xf32> {
  %r = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 3 : tensor<8xf32>
  dist.send %x to @mesh grid_axes = [0] offset = 1 tag = 4 : tensor<8xf32>
  func.return %r : tensor<8xf32>
}

// -----
// A `dist.steps` loop is checked step by step: here the ring's tags move on together and it verifies.
// CHECK-LABEL: func.func @steps_ok
// CHECK: dist.steps 3
shard.grid @mesh(shape = 4)
func.func @steps_ok(%x: tensor<8xf32>) -> tensor<8xf32> {
  %t, %b = dist.steps 3 (%x) : tensor<8xf32> {
  ^bb0(%c: tensor<8xf32>):
    %s = dist.send %c to @mesh grid_axes = [0] offset = 1 tag = 3 tag_step = 1 : tensor<8xf32> -> !dist.future<none>
    %r = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 3 tag_step = 1 : tensor<8xf32>
    dist.yield %r : tensor<8xf32>
  }
  dist.wait %t
  func.return %b : tensor<8xf32>
}

// -----
// The recv's tag moves on by 2 per step, the send's by 1: step 1 sends tag 4, which no recv takes.
// CHECK: error: 'dist.send' op on rank 0 to rank 1 with tag 4 has no matching 'dist.recv' on rank 1
// CHECK: note: the other op: 'dist.recv'
shard.grid @mesh(shape = 4)
func.func @steps_bad(%x: tensor<8xf32>) -> tensor<8xf32> {
  %t, %b = dist.steps 3 (%x) : tensor<8xf32> {
  ^bb0(%c: tensor<8xf32>):
    %s = dist.send %c to @mesh grid_axes = [0] offset = 1 tag = 3 tag_step = 1 : tensor<8xf32> -> !dist.future<none>
    %r = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 3 tag_step = 2 : tensor<8xf32>
    dist.yield %r : tensor<8xf32>
  }
  dist.wait %t
  func.return %b : tensor<8xf32>
}
