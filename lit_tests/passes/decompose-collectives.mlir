// RUN: flint-opt %s -p 'decompose-collectives{algorithm=ring}' | filecheck %s --check-prefix=RING
// RUN: flint-opt %s -p 'decompose-collectives{algorithm=ring loops=false}' | filecheck %s --check-prefix=UNROLLED
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

// Ring (loops, the default): the 3 reduce-scatter steps are one `dist.steps` whose body is one step: the
// buffer is carried, the block sent / reduced moves back one block (16 elements) per step
// (flint.step_shift), the tag moves on by one (tag_step); then the 3 all-gather steps, the same way.
// The asynchronous collective's steps start where it started, on channel ch0 with their adds; the waits
// (on each loop's sends) and the result sit where its wait was.
// RING-LABEL: func.func @ar
// RING: %[[B:.*]] = aten.op "aten.view.default"(%x) {{.*}}flops = 0
// RING: %[[T0:.*]], %[[B1:.*]] = dist.steps 3 (%[[B]]) : tensor<64xf32> attributes {flint.collective = "ring/all_reduce"} {
// RING-NEXT: ^bb0(%[[C:.*]]: tensor<64xf32>):
// RING-NEXT: %[[SS:.*]] = aten.op "aten.slice.Tensor"(%[[C]]) args = {dim = 0 : i64, start = 48 : i64, end = 64 : i64} {{.*}}flint.step_shift = array<i64: -16, 64>}
// RING-NEXT: dist.send %[[SS]] to @mesh grid_axes = [0] offset = 1 tag = 0 tag_step = 1 {stream = "ch0"} : tensor<16xf32> -> !dist.future<none>
// RING-NEXT: %[[R0:.*]] = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 tag_step = 1 {stream = "ch0"} : tensor<16xf32>
// RING-NEXT: %[[RS:.*]] = aten.op "aten.slice.Tensor"(%[[C]]) args = {dim = 0 : i64, start = 32 : i64, end = 48 : i64} {{.*}}flint.step_shift = array<i64: -16, 64>}
// RING-NEXT: %[[A:.*]] = aten.op "aten.add.Tensor"(%[[RS]], %[[R0]]) {flint.collective = "ring/all_reduce", stream = "ch0"}
// RING-NEXT: %[[N:.*]] = aten.op "aten.slice_scatter.default"(%[[C]], %[[A]]) args = {dim = 0 : i64, start = 32 : i64, end = 48 : i64} {{.*}}flint.step_shift = array<i64: -16, 64>}
// RING-NEXT: dist.yield %[[N]] : tensor<64xf32>
// RING-NEXT: }
// RING-NEXT: %[[T1:.*]], %[[B2:.*]] = dist.steps 3 (%[[B1]]) : tensor<64xf32>
// RING: dist.send %{{.*}} offset = 1 tag = 3 tag_step = 1 {stream = "ch0"}
// RING-NOT: aten.add.Tensor
// RING: dist.yield
// RING: %y = aten.op "aten.mm.default"
// RING-NEXT: dist.wait %[[T0]]
// RING-NEXT: dist.wait %[[T1]]
// RING-NEXT: aten.op "aten.view.default"(%[[B2]])
// RING-NOT: dist.all_reduce
// RING: func.return
// RING-LABEL: func.func @ar_sync
// RING: dist.steps 3
// RING: dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 6 tag_step = 1 : tensor<16xf32> -> !dist.future<none>
// RING: aten.op "aten.add.Tensor"(%{{.*}}, %{{.*}}) {flint.collective = "ring/all_reduce"} :
// RING: dist.steps 3
// RING: tag = 9 tag_step = 1
// RING-NOT: dist.all_reduce

// Ring with loops=false: 3 reduce-scatter steps to +1 with an add after each recv, then 3 all-gather steps. The
// asynchronous collective's steps start where it started, on channel ch0 with their adds (not in the
// compute stream's order); the compute in between follows them; the waits on the sends and the result
// (assembled for free) sit where its wait was. The synchronous one stays in place on the default queues.
// UNROLLED-LABEL: func.func @ar
// UNROLLED: aten.op "aten.view.default"(%x) {{.*}}flops = 0
// UNROLLED: %[[T0:.*]] = dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 0 {stream = "ch0"} : tensor<16xf32> -> !dist.future<none>
// UNROLLED-NEXT: %[[R0:.*]] = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 {stream = "ch0"} : tensor<16xf32>
// UNROLLED: %[[S0:.*]] = aten.op "aten.add.Tensor"(%{{.*}}, %[[R0]]) {flint.collective = "ring/all_reduce", stream = "ch0"}
// UNROLLED-NEXT: dist.send %[[S0]] to @mesh grid_axes = [0] offset = 1 tag = 1 {stream = "ch0"}
// UNROLLED: tag = 5
// UNROLLED-NOT: tag = 6
// UNROLLED: %y = aten.op "aten.mm.default"
// UNROLLED-NEXT: dist.wait %[[T0]]
// UNROLLED-NOT: dist.all_reduce
// UNROLLED: aten.op "aten.cat.default"{{.*}}flops = 0
// UNROLLED: func.return
// UNROLLED-LABEL: func.func @ar_sync
// UNROLLED: dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 6 : tensor<16xf32> -> !dist.future<none>
// UNROLLED: aten.op "aten.add.Tensor"(%{{.*}}, %{{.*}}) {flint.collective = "ring/all_reduce"} :
// UNROLLED: tag = 11
// UNROLLED-NOT: dist.all_reduce

// Direct: every peer at once, three sends then three recvs per phase: a loop of sends whose peer moves
// on by one (offset_step), then a loop of recvs, each adding into the rank's own block.
// DIRECT-LABEL: func.func @ar
// DIRECT: dist.steps 3
// DIRECT: dist.send %{{.*}} offset = 1 tag = 0 offset_step = 1 tag_step = 1
// DIRECT: dist.steps 3
// DIRECT: dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 offset_step = -1 tag_step = 1
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

// Chunks 2 on channels 2: chunk j on channel ch<j mod 2>; a loop body is one step of both chunks.
// CHUNKS-LABEL: func.func @ar
// CHUNKS: dist.steps 3
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 0 tag_step = 2 {stream = "ch0"} : tensor<8xf32>
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 1 tag_step = 2 {stream = "ch1"} : tensor<8xf32>
// CHUNKS: dist.steps 3
// CHUNKS: tag = 7 tag_step = 2
// CHUNKS-LABEL: func.func @ar_sync
// CHUNKS: dist.send %{{.*}} offset = 1 tag = 12 tag_step = 2 {stream = "ch0"} : tensor<8xf32>

// AUTO: decompose-collectives: all_reduce over grid axes [0] (4 ranks, 256 B) on switch: ring 12.0, tree 8.0, direct 4.0, halving-doubling 8.0 us -> direct
// AUTO: func.func @ar
