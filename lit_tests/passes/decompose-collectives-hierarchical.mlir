// RUN: flint-opt %s -p 'decompose-collectives{algorithm=hierarchical chunks=2},verify-p2p' | filecheck %s

// Hierarchical over a 2x3 grid (axis 0 outer, axis 1 inner).
shard.grid @mesh(shape = 2x3)

// Broadcast from group rank 4 = (1, 1), in two chunks: for each chunk a chain along the outer axis in
// the root's column only (flint.where = [grid axis 1, coordinate 1]: the other columns skip it), then a
// chain along the inner axis in every row, starting at the root's column. A rank that skips a recv keeps
// its buffer (the masked copy).
// CHECK-LABEL: func.func @bcast
// CHECK: %[[R0:.*]] = dist.recv from @mesh grid_axes = [0] offset = 0 peers = array<i64: -1, 0> tag = 0 {flint.where = array<i64: 1, 1>} : tensor<6xf32>
// CHECK: %[[C0:.*]] = aten.op "aten.copy.default"(%{{.*}}, %[[R0]]) {flint.collective = "hierarchical/broadcast", flint.active = array<i64: 1, 0>, flint.active_axis = 0 : i64, flint.where = array<i64: 1, 1>}
// CHECK-NEXT: dist.send %[[C0]] to @mesh grid_axes = [0] offset = 0 peers = array<i64: 0, 1> tag = 0 {flint.where = array<i64: 1, 1>}
// CHECK-NEXT: %[[R1:.*]] = dist.recv from @mesh grid_axes = [1] offset = 0 peers = array<i64: -1, 0, -1> tag = 1 : tensor<6xf32>
// CHECK-NEXT: %[[C1:.*]] = aten.op "aten.copy.default"(%[[C0]], %[[R1]]) {flint.collective = "hierarchical/broadcast", flint.active = array<i64: 1, 0, 1>, flint.active_axis = 1 : i64}
// CHECK-NEXT: dist.send %[[C1]] to @mesh grid_axes = [1] offset = 0 peers = array<i64: 0, 1, 1> tag = 1 :
// CHECK: dist.recv from @mesh grid_axes = [0] {{.*}} tag = 2 {flint.where = array<i64: 1, 1>}
// CHECK: dist.send {{.*}} grid_axes = [1] {{.*}} tag = 3 :
// CHECK-NOT: dist.broadcast
// CHECK: func.return
func.func @bcast(%x: tensor<12xf32>) -> tensor<12xf32> {
  %0 = dist.broadcast %x on @mesh grid_axes = [0, 1] root = 4 : tensor<12xf32> -> tensor<12xf32>
  func.return %0 : tensor<12xf32>
}

// All-reduce: ring reduce-scatter along the inner axis (two blocks per message: the rank's column of the
// 2x3 blocks), ring all-reduce of the owned block along the outer axis, ring all-gather back inside.
// CHECK-LABEL: func.func @ar
// CHECK: dist.send %{{.*}} to @mesh grid_axes = [1] offset = 1 tag = 4 : tensor<2xf32>
// CHECK: aten.op "aten.add.Tensor"{{.*}} : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
// CHECK: dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 8 : tensor<1xf32>
// CHECK: aten.op "aten.add.Tensor"{{.*}} : (tensor<1xf32>, tensor<1xf32>) -> tensor<1xf32>
// CHECK: dist.send %{{.*}} to @mesh grid_axes = [1] offset = 1 tag = 12 : tensor<2xf32>
// CHECK: dist.recv from @mesh grid_axes = [1] offset = -1 tag = 15 : tensor<2xf32>
// CHECK-NOT: dist.all_reduce
func.func @ar(%x: tensor<12xf32>) -> tensor<12xf32> {
  %0 = dist.all_reduce %x on @mesh grid_axes = [0, 1] : tensor<12xf32> -> tensor<12xf32>
  func.return %0 : tensor<12xf32>
}
