// RUN: flint-opt %s -p fuse-pointwise | filecheck %s
// RUN: flint-opt %s -p 'fuse-pointwise{inline=false}' | filecheck %s --check-prefix=STORED
// flint-opt verifies the module after every pass. The kernels inductor's scheduler forms
// (torch/_inductor/codegen/simd.py can_fuse, scheduler.py; graph.py for what it inlines) in four
// patterns of a block's backward.

// A norm's backward: the weight gradient is a *column* reduction (a sum over the rows, keeping the
// last dim), whose loop runs in an order no row-wise op can share; inductor computes the producers
// only it reads (x * r, g * that) inside it and fuses the row reduction with the row-wise ops around
// it. g = ga + gb has two readers and reads two buffers: inductor inlines it (graph.py's
// should_realize_on_reuse), so both kernels compute it and nothing writes it (fusion_in_kernel:
// the memory model allocates nothing for it).
// Kernel 0 reads ga, gb, x and r: 3 x 1024 + 16 B, writes 128 B.
// Kernel 1 reads ga, gb, w, x, r (4 x 1024 + 128 + 16 B) and writes the input gradient (1024 B).
// CHECK-LABEL: func.func @norm_bwd
// CHECK:       %g = aten.op "aten.add.Tensor"(%ga, %gb) {fusion_group = "norm_bwd:0", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64, fusion_in_kernel, fusion_inlined_in = ["norm_bwd:1"]}
// CHECK-NEXT:  aten.op "aten.mul.Tensor"(%g, %w) {fusion_group = "norm_bwd:1"
// CHECK-NEXT:  aten.op "aten.mul.Tensor"(%x, %r) {fusion_group = "norm_bwd:0"
// CHECK-NEXT:  aten.op "aten.mul.Tensor"(%g, %{{.*}}) {fusion_group = "norm_bwd:0"
// CHECK-NEXT:  aten.op "aten.sum.dim_IntList"(%{{.*}}) args = {dim = [0 : i64]} {fusion_group = "norm_bwd:0", flops = 0 : i64, bytes = 3216 : i64
// CHECK-NEXT:  aten.op "aten.mul.Tensor"(%{{.*}}, %x) {fusion_group = "norm_bwd:1"
// CHECK-NEXT:  aten.op "aten.sum.dim_IntList"(%{{.*}}) args = {dim = [-1 : i64], keepdim = true} {fusion_group = "norm_bwd:1"
// CHECK:       aten.op "aten.sub.Tensor"(%{{.*}}, %{{.*}}) {fusion_group = "norm_bwd:1", flops = 0 : i64, bytes = 4240 : i64
// With inline=false (hand-written kernels) g is stored (so not fusion_in_kernel): kernel 0 reads ga, gb, w, x, r (3216 B) and
// writes the input gradient and g (2 x 1024 B); kernel 1 reads g, x and r (2064 B), writes 128 B.
// STORED-LABEL: func.func @norm_bwd
// STORED:       %g = aten.op "aten.add.Tensor"(%ga, %gb) {fusion_group = "norm_bwd:0", flops = 0 : i64, bytes = 0 : i64, duration_us = 0.000000e+00 : f64}
// STORED-NEXT:  aten.op "aten.mul.Tensor"(%g, %w) {fusion_group = "norm_bwd:0"
// STORED-NEXT:  aten.op "aten.mul.Tensor"(%x, %r) {fusion_group = "norm_bwd:1"
// STORED-NEXT:  aten.op "aten.mul.Tensor"(%g, %{{.*}}) {fusion_group = "norm_bwd:1"
// STORED-NEXT:  aten.op "aten.sum.dim_IntList"(%{{.*}}) args = {dim = [0 : i64]} {fusion_group = "norm_bwd:1", flops = 0 : i64, bytes = 2192 : i64
// STORED:       aten.op "aten.sub.Tensor"(%{{.*}}, %{{.*}}) {fusion_group = "norm_bwd:0", flops = 0 : i64, bytes = 5264 : i64

// Rotary backward: a select_scatter into a fresh tensor iterates over its output and computes each
// half's (smaller) producer where it lands, as a concatenation does: one kernel reading d, e, c
// (3 x 128 B) and writing the 256 B result.
// CHECK-LABEL: func.func @rope_bwd
// CHECK:       aten.op "aten.mul.Tensor"(%d, %c) {fusion_group = "rope_bwd:0"
// CHECK:       aten.op "aten.add.Tensor"(%{{.*}}, %{{.*}}) {fusion_group = "rope_bwd:0", flops = 0 : i64, bytes = 640 : i64

// Two pointwise chains over the same size that read the same GEMM result are one kernel (inductor's
// horizontal fusion: the shared read is loaded once): reads the mm result and u, writes both results.
// CHECK-LABEL: func.func @swiglu_bwd
// CHECK:       aten.op "aten.sigmoid.default"(%{{.*}}) {fusion_group = "swiglu_bwd:0"
// CHECK:       aten.op "aten.neg.default"(%{{.*}}) {fusion_group = "swiglu_bwd:0"
// CHECK-NEXT:  aten.op "aten.mul.Tensor"(%{{.*}}, %u) {fusion_group = "swiglu_bwd:0", flops = 0 : i64, bytes = 4096 : i64

// A dependency through a collective counts: the residual add reads relu's result directly and, through
// the GEMM and the all-reduce, again; fusing relu into the add's kernel would run it after the
// all-reduce its own GEMM feeds. relu stays its own kernel, before the GEMM.
// CHECK-LABEL: func.func @tp_block
// CHECK:       aten.op "aten.relu.default"(%x) {flops = 0 : i64, bytes = 2048 : i64
// CHECK:       dist.all_reduce
// CHECK:       aten.op "aten.add.Tensor"(%{{.*}}, %{{.*}}) {fusion_group = "tp_block:0"
// CHECK-NEXT:  aten.op "aten.neg.default"(%{{.*}}) {fusion_group = "tp_block:0", flops = 0 : i64, bytes = 3072 : i64
builtin.module {
  shard.grid @mesh(shape = 2)
  func.func @norm_bwd(%ga: tensor<8x64xbf16>, %gb: tensor<8x64xbf16>, %x: tensor<8x64xbf16>, %w: tensor<64xbf16>, %r: tensor<8x1xbf16>) -> (tensor<8x64xbf16>, tensor<64xbf16>) {
    %g = aten.op "aten.add.Tensor"(%ga, %gb) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %0 = aten.op "aten.mul.Tensor"(%g, %w) : (tensor<8x64xbf16>, tensor<64xbf16>) -> tensor<8x64xbf16>
    %1 = aten.op "aten.mul.Tensor"(%x, %r) : (tensor<8x64xbf16>, tensor<8x1xbf16>) -> tensor<8x64xbf16>
    %2 = aten.op "aten.mul.Tensor"(%g, %1) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %3 = aten.op "aten.sum.dim_IntList"(%2) args = {dim = [0 : i64]} : (tensor<8x64xbf16>) -> tensor<64xbf16>
    %4 = aten.op "aten.mul.Tensor"(%0, %x) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %5 = aten.op "aten.sum.dim_IntList"(%4) args = {dim = [-1 : i64], keepdim = true} : (tensor<8x64xbf16>) -> tensor<8x1xbf16>
    %6 = aten.op "aten.mul.Tensor"(%0, %r) : (tensor<8x64xbf16>, tensor<8x1xbf16>) -> tensor<8x64xbf16>
    %7 = aten.op "aten.mul.Tensor"(%x, %5) : (tensor<8x64xbf16>, tensor<8x1xbf16>) -> tensor<8x64xbf16>
    %8 = aten.op "aten.sub.Tensor"(%6, %7) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    func.return %8, %3 : tensor<8x64xbf16>, tensor<64xbf16>
  }
  func.func @rope_bwd(%d: tensor<4x16xbf16>, %e: tensor<4x16xbf16>, %c: tensor<4x16xbf16>) -> tensor<4x16x2xbf16> {
    %0 = aten.op "aten.mul.Tensor"(%d, %c) : (tensor<4x16xbf16>, tensor<4x16xbf16>) -> tensor<4x16xbf16>
    %1 = aten.op "aten.mul.Tensor"(%e, %c) : (tensor<4x16xbf16>, tensor<4x16xbf16>) -> tensor<4x16xbf16>
    %2 = aten.op "aten.full.default"() args = {size = [4 : i64, 16 : i64, 2 : i64], fill_value = 0 : i64} : () -> tensor<4x16x2xbf16>
    %3 = aten.op "aten.select_scatter.default"(%2, %0) args = {dim = 2 : i64, index = 0 : i64} : (tensor<4x16x2xbf16>, tensor<4x16xbf16>) -> tensor<4x16x2xbf16>
    %4 = aten.op "aten.select_scatter.default"(%2, %1) args = {dim = 2 : i64, index = 1 : i64} : (tensor<4x16x2xbf16>, tensor<4x16xbf16>) -> tensor<4x16x2xbf16>
    %5 = aten.op "aten.add.Tensor"(%3, %4) : (tensor<4x16x2xbf16>, tensor<4x16x2xbf16>) -> tensor<4x16x2xbf16>
    func.return %5 : tensor<4x16x2xbf16>
  }
  func.func @swiglu_bwd(%a: tensor<8x64xbf16>, %w: tensor<64x64xbf16>, %u: tensor<8x64xbf16>) -> (tensor<8x64xbf16>, tensor<8x64xbf16>) {
    %0 = aten.op "aten.mm.default"(%a, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %1 = aten.op "aten.sigmoid.default"(%0) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %2 = aten.op "aten.mul.Tensor"(%0, %1) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %3 = aten.op "aten.neg.default"(%0) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %4 = aten.op "aten.mul.Tensor"(%3, %u) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    func.return %2, %4 : tensor<8x64xbf16>, tensor<8x64xbf16>
  }
  func.func @tp_block(%x: tensor<8x64xbf16>, %w: tensor<64x64xbf16>) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.relu.default"(%x) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %1 = aten.op "aten.mm.default"(%0, %w) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %2 = dist.all_reduce %1 on @mesh grid_axes = [0] : tensor<8x64xbf16> -> !dist.future<tensor<8x64xbf16>>
    %3 = dist.wait %2 : tensor<8x64xbf16>
    %4 = aten.op "aten.add.Tensor"(%3, %0) : (tensor<8x64xbf16>, tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %5 = aten.op "aten.neg.default"(%4) : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    func.return %5 : tensor<8x64xbf16>
  }
}
