// RUN: flint-opt %s -p lower-to-chakra | filecheck %s
// RUN: flint-opt %s -p 'lower-to-chakra{merge-compute=false}' | filecheck %s --check-prefix=SEPARATE
// flint-opt verifies the module after every pass.

shard.grid @mesh(shape = 4)

func.func @step(%x: tensor<8x64xbf16> {flint.role = "input"}, %w_shard: tensor<16x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
  %0 = dist.all_gather %w_shard on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
  // relu, neg and exp do not wait for the gather: one node (they overlap it).
  %1 = aten.op "aten.relu.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %2 = aten.op "aten.neg.default"(%1) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %3 = aten.op "aten.exp.default"(%2) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %w = dist.wait %0 : tensor<64x64xbf16>
  // The matmul waits for the gather: a new node, and the add after it joins it.
  %4 = aten.op "aten.mm.default"(%3, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %5 = aten.op "aten.add.Tensor"(%4, %x) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
  // A collective issued in between ends the run: the last relu is its own node.
  %6 = dist.all_reduce %5 on @mesh grid_axes = [0] : tensor<8x64xbf16> -> !dist.future<tensor<8x64xbf16>>
  %7 = aten.op "aten.relu.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %8 = dist.wait %6 : tensor<8x64xbf16>
  // The compute stream waits at dist.wait even for a kernel that does not read the value.
  %9 = aten.op "aten.neg.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  func.return %8 : tensor<8x64xbf16>
}

// CHECK: %[[AG:.*]] = chakra.coll all_gather
// CHECK-NEXT: %[[E:.*]] = chakra.comp "aten.relu.default +2" flops = 0 bytes = 6144 duration_us = {{.*}}{{$}}
// CHECK-NEXT: %[[M:.*]] = chakra.comp "aten.mm.default +1" flops = 65536 bytes = 13312 duration_us = {{.*}} data(%[[E]], %[[AG]])
// CHECK-NEXT: %[[AR:.*]] = chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [0] bytes = 1024 data(%[[M]]) ctrl(%[[AG]])
// CHECK-NEXT: %[[R:.*]] = chakra.comp "aten.relu.default" flops = 0 bytes = 2048 duration_us = {{.*}} ctrl(%[[M]])
// CHECK-NEXT: chakra.comp "aten.neg.default" flops = 0 bytes = 2048 duration_us = {{.*}} ctrl(%[[R]], %[[AR]])
// CHECK-NOT: chakra.comp

// SEPARATE-COUNT-7: chakra.comp
