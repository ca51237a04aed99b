// RUN: flint-opt %s --split-input-file -p verify-dist --verify-diagnostics | filecheck %s
// RUN: flint-opt %s --split-input-file -p 'verify-dist{check-p2p=false}' --verify-diagnostics | filecheck %s --check-prefix=NOP2P

// A well-formed ring exchange and an overlapped collective pass unchanged.
// CHECK: func.func @ring
// CHECK-NEXT: dist.send
// CHECK-NEXT: dist.recv
// CHECK-NEXT: dist.all_reduce
// CHECK-NEXT: dist.wait
shard.grid @grid(shape = 2x4)
func.func @ring(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  dist.send %x to @grid grid_axes = [1] offset = 1 tag = 0 : tensor<4x8xf32>
  %0 = dist.recv from @grid grid_axes = [1] offset = -1 tag = 0 : tensor<4x8xf32>
  %1 = dist.all_reduce %0 on @grid grid_axes = [0] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  %2 = dist.wait %1 : tensor<4x8xf32>
  func.return %2 : tensor<4x8xf32>
}

// -----
shard.grid @grid(shape = 2x4)
func.func @never_waited(%x: tensor<4x8xf32>) {
  %0 = dist.all_reduce %x on @grid grid_axes = [0] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  func.return
}
// CHECK: verify-dist.mlir:22:3: error: 'dist.all_reduce' op starts asynchronously but no 'dist.wait' completes it
// NOP2P: error: 'dist.all_reduce' op starts asynchronously but no 'dist.wait' completes it

// -----
shard.grid @grid(shape = 2x4)
func.func @waited_twice(%x: tensor<4x8xf32>) {
  %0 = dist.all_reduce %x on @grid grid_axes = [0] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  %1 = dist.wait %0 : tensor<4x8xf32>
  %2 = dist.wait %0 : tensor<4x8xf32>
  func.return
}
// CHECK: verify-dist.mlir:32:3: error: 'dist.wait' op waits a second time on the future of 'dist.all_reduce'

// -----
func.func @wait_on_argument(%f: !dist.future<tensor<4x8xf32>>) {
  %0 = dist.wait %f : tensor<4x8xf32>
  func.return
}
// CHECK: error: 'dist.wait' op waits on a future that no 'dist' communication op started

// -----
shard.grid @grid(shape = 2x4)
func.func @escapes(%x: tensor<4x8xf32>) -> !dist.future<tensor<4x8xf32>> {
  %0 = dist.all_reduce %x on @grid grid_axes = [0] : tensor<4x8xf32> -> !dist.future<tensor<4x8xf32>>
  func.return %0 : !dist.future<tensor<4x8xf32>>
}
// CHECK: error: 'func.return' op uses the future of 'dist.all_reduce' before a 'dist.wait'

// -----
shard.grid @grid(shape = 2x4)
func.func @unmatched_send(%x: tensor<4x8xf32>) {
  dist.send %x to @grid grid_axes = [1] offset = 1 tag = 0 : tensor<4x8xf32>
  %0 = dist.recv from @grid grid_axes = [1] offset = -1 tag = 5 : tensor<4x8xf32>
  func.return
}
// CHECK: verify-dist.mlir:56:3: error: 'dist.send' op has no matching peer: 1 send(s) at offset 1 and 0 recv(s) at offset -1 on axis 1 of @grid with tag 0 and type tensor<4x8xf32>
// With check-p2p=false the exchange is not checked and the module prints.
// NOP2P: func.func @unmatched_send
