// RUN: flint-opt %s -p 'decompose-collectives{algorithm=ring}' | filecheck %s --check-prefix=RING
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=direct}' | filecheck %s --check-prefix=DIRECT
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=halving-doubling}' | filecheck %s --check-prefix=HD
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=tree}' | filecheck %s --check-prefix=TREE
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=ring chunks=2 channels=2}' | filecheck %s --check-prefix=CHUNKS
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=auto network=switch}' 2>&1 | filecheck %s --check-prefix=AUTO

// An asynchronous all-reduce over 4 ranks, with independent compute between its start and its wait,
// and the same all-reduce synchronous.
shard.grid @mesh(shape = 4)
func.func @ar(%x: tensor<16x4xf32>, %w: tensor<4x4xf32>) -> (tensor<16x4xf32>, tensor<4x4xf32>) {
  %0 = dist.all_reduce %x on @mesh grid_axes = [0] : tensor<16x4xf32> -> !dist.future<tensor<16x4xf32>>
  %y = aten.op "aten.mm.default"(%w, %w) : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %1 = dist.wait %0 : tensor<16x4xf32>
  func.return %1, %y : tensor<16x4xf32>, tensor<4x4xf32>
}
func.func @ar_sync(%x: tensor<16x4xf32>) -> tensor<16x4xf32> {
  %0 = dist.all_reduce %x on @mesh grid_axes = [0] : tensor<16x4xf32> -> tensor<16x4xf32>
  func.return %0 : tensor<16x4xf32>
}

// Ring: 3 reduce-scatter steps to +1 with an add after each recv, then 3 all-gather steps. The
// asynchronous collective's steps start where it started, on channel ch0 with their adds (not in the
// compute stream's order); the compute in between follows them; the waits on the sends and the result
// (assembled for free) sit where its wait was. The synchronous one stays in place on the default queues.
// RING-LABEL: func.func @ar
// RING: aten.op "aten.view.default"(%x) {{.*}}flops = 0
// RING: %[[T0:.*]] = dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 0 {stream = "ch0"} : tensor<16xf32> -> !dist.future<none>
// RING-NEXT: %[[R0:.*]] = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 {stream = "ch0"} : tensor<16xf32>
// RING: %[[S0:.*]] = aten.op "aten.add.Tensor"(%{{.*}}, %[[R0]]) {flint.collective = "ring/all_reduce", stream = "ch0"}
// RING-NEXT: dist.send %[[S0]] to @mesh grid_axes = [0] offset = 1 tag = 1 {stream = "ch0"}
// RING: tag = 5
// RING-NOT: tag = 6
// RING: %y = aten.op "aten.mm.default"
// RING-NEXT: dist.wait %[[T0]]
// RING-NOT: dist.all_reduce
// RING: aten.op "aten.cat.default"{{.*}}flops = 0
// RING: func.return
// RING-LABEL: func.func @ar_sync
// RING: dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 6 : tensor<16xf32> -> !dist.future<none>
// RING: aten.op "aten.add.Tensor"(%{{.*}}, %{{.*}}) {flint.collective = "ring/all_reduce"} :
// RING: tag = 11
// RING-NOT: dist.all_reduce

// Direct: every peer at once, three sends then three recvs per phase.
// DIRECT-LABEL: func.func @ar
// DIRECT: dist.send %{{.*}} offset = 1 tag = 0
// DIRECT: dist.send %{{.*}} offset = 2 tag = 1
// DIRECT: dist.send %{{.*}} offset = 3 tag = 2
// DIRECT: dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0
// DIRECT: aten.op "aten.add.Tensor"

// Halving-doubling: distance 2 then 1 (reduce-scatter), 1 then 2 (all-gather), halving the bytes.
// HD-LABEL: func.func @ar
// HD: dist.send %{{.*}} offset = 2 tag = 0 {{.*}}: tensor<32xf32>
// HD: dist.send %{{.*}} offset = 1 tag = 1 {{.*}}: tensor<16xf32>
// HD: dist.send %{{.*}} offset = -1 tag = 2 {{.*}}: tensor<16xf32>
// HD: dist.send %{{.*}} offset = -2 tag = 3 {{.*}}: tensor<32xf32>

// Tree: two mirrored heap trees; peers per coordinate, 0 where the rank skips; masked adds. Each tree's
// reduce (up) and broadcast (down) runs on channels of its own, one per child (as NCCL's split tree:
// both children at once): tree 0 on ch0-ch3, tree 1 on ch4-ch7.
// TREE-LABEL: func.func @ar
// TREE: dist.recv from @mesh grid_axes = [0] offset = 0 peers = array<i64: 1, 2, 0, 0> tag = 0 {stream = "ch0"}
// TREE: aten.op "aten.add.Tensor"{{.*}}stream = "ch0", flint.active = array<i64: 1, 1, 0, 0>
// TREE: dist.recv from @mesh grid_axes = [0] offset = 0 peers = array<i64: 2, 0, 0, 0> tag = 1 {stream = "ch1"}
// TREE: dist.send %{{.*}} offset = 0 peers = array<i64: 0, -1, 0, -2> tag = 0 {stream = "ch0"}
// TREE: dist.recv from @mesh grid_axes = [0] offset = 0 peers = array<i64: 0, 0, -2, -1> tag = 2 {stream = "ch4"}

// Chunks 2 on channels 2: chunk j on channel ch<j mod 2>.
// CHUNKS-LABEL: func.func @ar
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 0 {stream = "ch0"} : tensor<8xf32>
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 1 {stream = "ch1"} : tensor<8xf32>
// CHUNKS: tag = 11
// CHUNKS-NOT: tag = 12 {stream
// CHUNKS-LABEL: func.func @ar_sync
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 12 {stream = "ch0"} : tensor<8xf32>

// AUTO: decompose-collectives: all_reduce over grid axes [0] (4 ranks, 256 B) on switch: ring 12.0, tree 8.0, direct 4.0, halving-doubling 8.0 us -> direct
// AUTO: func.func @ar
