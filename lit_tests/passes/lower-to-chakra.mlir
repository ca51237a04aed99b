// RUN: flint-opt %s -p lower-to-chakra | filecheck %s
// RUN: flint-opt %s -p 'lower-to-chakra{device=b200}' | filecheck %s --check-prefix=B200
// RUN: flint-opt %s -p lower-to-chakra -t 'chakra{out="%t" prefix=step}' | filecheck %s --check-prefix=EMIT
// RUN: flint inspect %t/step --json | filecheck %s --check-prefix=TRACE
// flint-opt verifies the module after every pass.

builtin.module attributes {flint.schedule = [["embed", 1], ["block", 3]]} {
  shard.grid @mesh(shape = 2x2)

  func.func @embed(%x: tensor<8x64xbf16>, %w: tensor<64x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.mm.default"(%x, %w) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %0 : tensor<8x64xbf16>
  }

  func.func @block(%h: tensor<8x64xbf16>, %w_shard: tensor<32x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = dist.all_gather %w_shard on @mesh grid_axes = [0] gather_dim = 0 : tensor<32x64xbf16> -> !dist.future<tensor<64x64xbf16>>
    %1 = aten.op "aten.relu.default"(%h) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %w = dist.wait %0 : tensor<64x64xbf16>
    %2 = aten.op "aten.view.default"(%1) args = {size = [8, 64]} : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %3 = aten.op "aten.mm.default"(%2, %w) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %4 = dist.all_reduce %3 on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>
    %5 = dist.broadcast %4 on @mesh grid_axes = [0] root = 0 : tensor<8x64xbf16> -> tensor<8x64xbf16>
    dist.send %5 to @mesh grid_axes = [0] offset = 1 tag = 7 : tensor<8x64xbf16>
    %6 = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 7 : tensor<8x64xbf16>
    func.return %6 : tensor<8x64xbf16>
  }
}

// CHECK-NOT: func.func
// CHECK: chakra.graph @step {
// The first part runs flat; its matmul is the first compute node.
// CHECK-NEXT: %[[E:.*]] = chakra.comp "aten.mm.default" flops = 65536 bytes = 10240 duration_us = {{.*}}
// The block repeats 3 times, carrying the end of every chain: the last compute node, the
// collective stream and each communicator (a chain first used inside the body starts at
// the issue point, the last compute node).
// CHECK-NEXT: %{{.*}}, %{{.*}}, %{{.*}}, %{{.*}} = chakra.repeat 3 (%[[E]], %[[E]], %[[E]], %[[E]]) {
// CHECK-NEXT: ^{{.*}}(%[[C:.*]]: !chakra.node, %[[CS:.*]]: !chakra.node, %[[G0:.*]]: !chakra.node, %[[G1:.*]]: !chakra.node):
// The weight gather reads a parameter, but it is issued where the program issues it: after
// the compute before it (NCCL's stream waits for the compute stream at enqueue), after the
// previous collective of its stream and of its communicator.
// CHECK-NEXT: %[[AG:.*]] = chakra.coll all_gather "dist.all_gather" on @mesh grid_axes = [0] bytes = 4096 ctrl(%[[CS]], %[[G0]], %[[C]])
// The relu reads the previous part's activation.
// CHECK-NEXT: %[[R:.*]] = chakra.comp "aten.relu.default" flops = 0 bytes = 2048 duration_us = {{.*}} data(%[[C]])
// The view vanished: the matmul depends on the relu and the gathered weight.
// CHECK-NEXT: %[[M:.*]] = chakra.comp "aten.mm.default" flops = 65536 bytes = 10240 duration_us = {{.*}} data(%[[R]], %[[AG]])
// CHECK-NEXT: %[[AR:.*]] = chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [1] bytes = 1024 data(%[[M]]) ctrl(%[[AG]], %[[G1]])
// A broadcast becomes an all-reduce of the same buffer.
// CHECK-NEXT: %[[BC:.*]] = chakra.coll all_reduce "dist.broadcast" on @mesh grid_axes = [0] bytes = 1024 data(%[[AR]]) ctrl(%[[AG]], %[[M]])
// CHECK-NEXT: %[[S:.*]] = chakra.send "dist.send" on @mesh grid_axes = [0] offset = 1 tag = 7 bytes = 1024 data(%[[BC]])
// Sends and recvs are not ordered against each other (every rank sends first).
// CHECK-NEXT: %[[RV:.*]] = chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = -1 tag = 7 bytes = 1024{{$}}
// CHECK-NEXT: chakra.yield %[[M]], %[[BC]], %[[BC]], %[[AR]]
// B200: chakra.comp "aten.mm.default" flops = 65536 bytes = 10240 duration_us

// EMIT: wrote 5 files (4 ranks, 88 nodes, {{[0-9]+}} bytes)

// 1 + 3 x 7 = 22 nodes per rank.
// TRACE: "world_size": 4
