// RUN: flint-opt %s -p 'decompose-collectives{algorithm=ring}' | filecheck %s --check-prefix=RING
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=direct}' | filecheck %s --check-prefix=DIRECT
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=halving-doubling}' | filecheck %s --check-prefix=HD
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=tree}' | filecheck %s --check-prefix=TREE
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=ring chunks=2}' | filecheck %s --check-prefix=CHUNKS
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=auto network=switch}' 2>&1 | filecheck %s --check-prefix=AUTO

// An all-reduce over 4 ranks.
shard.grid @mesh(shape = 4)
func.func @ar(%x: tensor<16x4xf32>) -> tensor<16x4xf32> {
  %0 = dist.all_reduce %x on @mesh grid_axes = [0] : tensor<16x4xf32> -> !dist.future<tensor<16x4xf32>>
  %1 = dist.wait %0 : tensor<16x4xf32>
  func.return %1 : tensor<16x4xf32>
}

// Ring: 3 reduce-scatter steps to +1 with an add after each recv, then 3 all-gather steps; sends are
// asynchronous and waited for at the end; the result is assembled for free.
// RING-LABEL: func.func @ar
// RING: aten.op "aten.view.default"(%x) {{.*}}flops = 0
// RING: %[[T0:.*]] = dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 0 : tensor<16xf32> -> !dist.future<none>
// RING-NEXT: %[[R0:.*]] = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 : tensor<16xf32>
// RING: %[[S0:.*]] = aten.op "aten.add.Tensor"(%{{.*}}, %[[R0]])
// RING-NEXT: dist.send %[[S0]] to @mesh grid_axes = [0] offset = 1 tag = 1
// RING: tag = 5
// RING-NOT: tag = 6
// RING: dist.wait %[[T0]]
// RING-NOT: dist.all_reduce
// RING: aten.op "aten.cat.default"{{.*}}flops = 0
// RING: func.return

// Direct: every peer at once, three sends then three recvs per phase.
// DIRECT-LABEL: func.func @ar
// DIRECT: dist.send %{{.*}} offset = 1 tag = 0
// DIRECT: dist.send %{{.*}} offset = 2 tag = 1
// DIRECT: dist.send %{{.*}} offset = 3 tag = 2
// DIRECT: dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0
// DIRECT: aten.op "aten.add.Tensor"

// Halving-doubling: distance 2 then 1 (reduce-scatter), 1 then 2 (all-gather), halving the bytes.
// HD-LABEL: func.func @ar
// HD: dist.send %{{.*}} offset = 2 tag = 0 : tensor<32xf32>
// HD: dist.send %{{.*}} offset = 1 tag = 1 : tensor<16xf32>
// HD: dist.send %{{.*}} offset = -1 tag = 2 : tensor<16xf32>
// HD: dist.send %{{.*}} offset = -2 tag = 3 : tensor<32xf32>

// Tree: two mirrored heap trees; peers per coordinate, 0 where the rank skips; masked adds.
// TREE-LABEL: func.func @ar
// TREE: dist.recv from @mesh grid_axes = [0] offset = 0 peers = array<i64: 1, 2, 0, 0> tag = 0
// TREE: aten.op "aten.add.Tensor"{{.*}}flint.active = array<i64: 1, 1, 0, 0>
// TREE: dist.send %{{.*}} offset = 0 peers = array<i64: 0, -1, 0, -2> tag = 0
// TREE: dist.recv from @mesh grid_axes = [0] offset = 0 peers = array<i64: 0, 0, -2, -1> tag = 2

// CHUNKS-LABEL: func.func @ar
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 0 : tensor<8xf32>
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 1 : tensor<8xf32>
// CHUNKS: tag = 11
// CHUNKS-NOT: tag = 12

// AUTO: decompose-collectives: all_reduce over grid axes [0] (4 ranks, 256 B) on switch: ring 12.0, tree 8.0, direct 4.0, halving-doubling 8.0 us -> direct
// AUTO: func.func @ar
