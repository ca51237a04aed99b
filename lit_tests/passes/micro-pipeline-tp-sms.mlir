// RUN: flint-opt %s -p 'micro-pipeline-tp{sms=16}' 2>/dev/null | filecheck %s
// RUN: flint-opt %s -p 'micro-pipeline-tp{sms=16},lower-to-chakra' 2>/dev/null | filecheck %s --check-prefix=LOWERED
// RUN: not flint-opt %s -p 'micro-pipeline-tp{sms=-1}' 2>&1 | filecheck %s --check-prefix=RANGE
// RUN: not flint-opt %s -p 'micro-pipeline-tp{sms=true}' 2>&1 | filecheck %s --check-prefix=BOOL
// flint-opt verifies the module after every pass.

// sms=16: Transformer Engine's userbuffers overlap (Megatron's --tp-comm-overlap) runs its reduce-scatters
// as kernels on 16 SMs and its ring-exchange all-gathers on the copy engines. The pipelined
// reduce-scatter's sends carry flint.sms = 16; the all-gather's sends carry nothing (the same input as
// micro-pipeline-tp.mlir).

shard.grid @mesh(shape = 4x2)

// CHECK:      dist.steps 3 {{.*}}flint.micro_pipeline_tp = "all_gather_matmul"
// CHECK:      dist.send {{.*}} offset = -1 tag = 0 offset_step = -1 tag_step = 1 {stream = "symm_mem"} :
// CHECK:      dist.steps 3 {{.*}}flint.micro_pipeline_tp = "matmul_reduce_scatter"
// CHECK:      dist.send {{.*}} offset = 1 tag = 4 offset_step = 1 tag_step = 1 {stream = "symm_mem", flint.sms = 16 : i64} :
// CHECK-NOT:  flint.sms

// Lowered, each of the reduce-scatter's 3 sends holds 16 SMs (the simulator slows the rank's compute
// while it is in flight); the all-gather's sends and every recv hold none.
// LOWERED-COUNT-3: chakra.send {{.*}}offset = -{{[123]}} stream = "symm_mem" tag
// LOWERED-COUNT-3: chakra.send {{.*}}offset = {{[123]}} stream = "symm_mem" sms = 16 tag
// LOWERED-NOT: sms =

// RANGE: flint-opt: error: micro-pipeline-tp: option sms=-1 must be an SM count, 0 <= sms <= 1024
// BOOL: flint-opt: error: micro-pipeline-tp: option sms=true must be an SM count, 0 <= sms <= 1024

func.func @fwd(%x: tensor<2x16x32xbf16>, %w1: tensor<64x32xbf16>, %b1: tensor<64xbf16>, %w2: tensor<32x64xbf16>, %y: tensor<8x32xbf16>) -> (tensor<2x16x32xbf16>, tensor<8x128xbf16>, tensor<32x64xbf16>) {
  %g = dist.all_gather %x on @mesh grid_axes = [0] gather_dim = 0 : tensor<2x16x32xbf16> -> !dist.future<tensor<8x16x32xbf16>>
  %gw = dist.wait %g : tensor<8x16x32xbf16>
  %s0, %s1, %s2, %s3 = aten.op "aten.split.Tensor"(%gw) phase = "fwd" args = {split_size = 2 : i64} : (tensor<8x16x32xbf16>) -> (tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>)
  %c = aten.op "aten.cat.default"(%s0, %s1, %s2, %s3) phase = "fwd" args = {dim = 1 : i64} : (tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>) -> tensor<2x64x32xbf16>
  %v = aten.op "aten.view.default"(%c) phase = "fwd" module = "w1" args = {size = [128 : i64, 32 : i64]} : (tensor<2x64x32xbf16>) -> tensor<128x32xbf16>
  %t1 = aten.op "aten.t.default"(%w1) phase = "fwd" module = "w1" : (tensor<64x32xbf16>) -> tensor<32x64xbf16>
  %h = aten.op "aten.addmm.default"(%b1, %v, %t1) phase = "fwd" module = "w1" : (tensor<64xbf16>, tensor<128x32xbf16>, tensor<32x64xbf16>) -> tensor<128x64xbf16>
  %t3 = aten.op "aten.t.default"(%w1) phase = "fwd" module = "w3" : (tensor<64x32xbf16>) -> tensor<32x64xbf16>
  %h2 = aten.op "aten.mm.default"(%v, %t3) phase = "fwd" module = "w3" : (tensor<128x32xbf16>, tensor<32x64xbf16>) -> tensor<128x64xbf16>
  %t2 = aten.op "aten.t.default"(%w2) phase = "fwd" module = "w2" : (tensor<32x64xbf16>) -> tensor<64x32xbf16>
  %o = aten.op "aten.mm.default"(%h, %t2) phase = "fwd" module = "w2" : (tensor<128x64xbf16>, tensor<64x32xbf16>) -> tensor<128x32xbf16>
  %ov = aten.op "aten.view.default"(%o) phase = "fwd" module = "w2" args = {size = [2 : i64, 64 : i64, 32 : i64]} : (tensor<128x32xbf16>) -> tensor<2x64x32xbf16>
  %p0, %p1, %p2, %p3 = aten.op "aten.split.Tensor"(%ov) phase = "fwd" args = {split_size = 16 : i64, dim = 1 : i64} : (tensor<2x64x32xbf16>) -> (tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>)
  %pc = aten.op "aten.cat.default"(%p0, %p1, %p2, %p3) phase = "fwd" : (tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>, tensor<2x16x32xbf16>) -> tensor<8x16x32xbf16>
  %r = dist.reduce_scatter %pc on @mesh grid_axes = [0] scatter_dim = 0 : tensor<8x16x32xbf16> -> !dist.future<tensor<2x16x32xbf16>>
  %rw = dist.wait %r : tensor<2x16x32xbf16>
  %l = dist.all_gather %y on @mesh grid_axes = [0] gather_dim = 1 : tensor<8x32xbf16> -> tensor<8x128xbf16>
  %sum = aten.op "aten.add.Tensor"(%h, %h2) phase = "fwd" : (tensor<128x64xbf16>, tensor<128x64xbf16>) -> tensor<128x64xbf16>
  %q = dist.reduce_scatter %sum on @mesh grid_axes = [0] scatter_dim = 0 : tensor<128x64xbf16> -> tensor<32x64xbf16>
  func.return %rw, %l, %q : tensor<2x16x32xbf16>, tensor<8x128xbf16>, tensor<32x64xbf16>
}
