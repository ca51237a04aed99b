// RUN: flint-opt %s -p micro-pipeline-tp 2>%t.err | filecheck %s
// RUN: filecheck %s --check-prefix=REMARK < %t.err
// Every send has one matching recv and no rank can deadlock (4 x 2 grid, each step expanded):
// RUN: flint-opt %s -p 'micro-pipeline-tp,verify-p2p' -o /dev/null 2>/dev/null
// RUN: flint-opt %s -p 'micro-pipeline-tp{all-gather=false}' 2>&1 | filecheck %s --check-prefix=RS
// RUN: flint-opt %s -p 'micro-pipeline-tp{reduce-scatter=false stream=tp}' 2>&1 | filecheck %s --check-prefix=AG
// RUN: not flint-opt %s -p 'micro-pipeline-tp{all-gather=false reduce-scatter=false}' 2>&1 | filecheck %s --check-prefix=NONE
// RUN: not flint-opt %s -p 'micro-pipeline-tp{stream="a b"}' 2>&1 | filecheck %s --check-prefix=STREAM
// RUN: not flint-opt %s -p 'micro-pipeline-tp{all-gather=3}' 2>&1 | filecheck %s --check-prefix=BOOL
// RUN: not flint-opt %s -p 'micro-pipeline-tp{chunks=3}' 2>&1 | filecheck %s --check-prefix=UNKNOWN
// flint-opt verifies the module after every pass; these RUN lines fail if it does not verify.

// A sequence-parallel block on a TP group of 4 (grid axis 0), as DTensor captures it: all-gather of the
// sequence shards (split + cat along dim 1) feeding two GEMMs, then a row-parallel GEMM whose output
// is reduce-scattered along the sequence (split + cat to the front). Left alone: an all-gather along
// the last dim and a reduce-scatter of an add (torch's pass matches neither).

shard.grid @mesh(shape = 4x2)

// REMARK: micro-pipeline-tp: 1 all-gather -> matmul and 1 matmul -> reduce-scatter pipelined; left 1 all-gathers and 1 reduce-scatters unchanged (all-gather along the last dim: 1, reduce-scatter of no matmul: 1)

// CHECK-LABEL: func.func @fwd
// The second GEMM's weight (computed after the first GEMM) moves up, as torch raises it above the fused op.
// CHECK:      %[[T1:.*]] = aten.op "aten.t.default"(%w1)
// CHECK-NEXT: %[[T3:.*]] = aten.op "aten.t.default"(%w1)
// The local shard's GEMMs first, each on 1/4 of the rows (32 of 128), written in place into its output.
// CHECK-NEXT: %[[XS:.*]] = aten.op "aten.view.default"(%x) {{.*}}args = {size = [32 : i64, 32 : i64]} {flops = 0 : i64, bytes = 0 : i64
// CHECK-NEXT: %[[B1:.*]] = aten.op "aten.empty.memory_format"() {{.*}}args = {size = [8192 : i64]}
// CHECK-NEXT: %[[L1:.*]] = aten.op "aten.addmm.default"(%b1, %[[XS]], %[[T1]]) {{.*}}: (tensor<64xbf16>, tensor<32x32xbf16>, tensor<32x64xbf16>) -> tensor<32x64xbf16>
// CHECK-NEXT: %[[F1:.*]] = aten.op "aten.view.default"(%[[L1]])
// CHECK-NEXT: %[[P1:.*]] = aten.op "aten.slice_scatter.default"(%[[B1]], %[[F1]]) {{.*}}start = 0 : i64, end = 2048 : i64} {flops = 0
// CHECK:      %[[L2:.*]] = aten.op "aten.mm.default"(%[[XS]], %[[T3]]) {{.*}}-> tensor<32x64xbf16>
// CHECK:      %[[P2:.*]] = aten.op "aten.slice_scatter.default"
// Then 3 steps: receive the shard of the rank at offset s (s = 1, 2, 3) while the previous one is multiplied.
// CHECK-NEXT: %[[TOK:.*]], %[[O1:.*]], %[[O2:.*]] = dist.steps 3 (%[[P1]], %[[P2]]) : tensor<8192xbf16>, tensor<8192xbf16> attributes {flint.micro_pipeline_tp = "all_gather_matmul"}
// CHECK-NEXT: ^{{.*}}(%[[A1:.*]]: tensor<8192xbf16>, %[[A2:.*]]: tensor<8192xbf16>):
// CHECK-NEXT: dist.send %[[XS]] to @mesh grid_axes = [0] offset = -1 tag = 0 offset_step = -1 tag_step = 1 {stream = "symm_mem"} : tensor<32x32xbf16> -> !dist.future<none>
// CHECK-NEXT: %[[R:.*]] = dist.recv from @mesh grid_axes = [0] offset = 1 tag = 0 offset_step = 1 tag_step = 1 {stream = "symm_mem"} : tensor<32x32xbf16>
// CHECK-NEXT: %[[C1:.*]] = aten.op "aten.addmm.default"(%b1, %[[R]], %[[T1]])
// CHECK-NEXT: %[[CF1:.*]] = aten.op "aten.view.default"(%[[C1]])
// CHECK-NEXT: %[[N1:.*]] = aten.op "aten.slice_scatter.default"(%[[A1]], %[[CF1]]) {{.*}}start = 2048 : i64, end = 4096 : i64} {{{.*}}flint.step_shift = array<i64: 2048, 8192>}
// CHECK-NEXT: %[[C2:.*]] = aten.op "aten.mm.default"(%[[R]], %[[T3]])
// CHECK-NEXT: %[[CF2:.*]] = aten.op "aten.view.default"(%[[C2]])
// CHECK-NEXT: %[[N2:.*]] = aten.op "aten.slice_scatter.default"(%[[A2]], %[[CF2]])
// CHECK-NEXT: dist.yield %[[N1]], %[[N2]]
// CHECK-NEXT: }
// CHECK-NEXT: dist.wait %[[TOK]]
// CHECK-NEXT: %h = aten.op "aten.view.default"(%[[O1]]) {{.*}}-> tensor<128x64xbf16>
// CHECK-NEXT: %h2 = aten.op "aten.view.default"(%[[O2]]) {{.*}}-> tensor<128x64xbf16>
// CHECK-NOT:  dist.all_gather %x
// The row-parallel GEMM: at step s the rows for the rank at offset s are computed and sent; the local rows
// last; one sum over the 4 stacked partials replaces the reduce-scatter.
// CHECK:      %[[AF:.*]] = aten.op "aten.view.default"(%h) {{.*}}args = {size = [8192 : i64]}
// CHECK-NEXT: %[[SB:.*]] = aten.op "aten.empty.memory_format"() {{.*}}args = {size = [4096 : i64]}
// CHECK-NEXT: %[[RT:.*]], %[[RO:.*]] = dist.steps 3 (%[[SB]]) : tensor<4096xbf16> attributes {flint.micro_pipeline_tp = "matmul_reduce_scatter"}
// CHECK-NEXT: ^{{.*}}(%[[RA:.*]]: tensor<4096xbf16>):
// CHECK-NEXT: %[[ROWS:.*]] = aten.op "aten.slice.Tensor"(%[[AF]]) {{.*}}start = 2048 : i64, end = 4096 : i64} {{{.*}}flint.step_shift = array<i64: 2048, 8192>}
// CHECK-NEXT: %[[RV:.*]] = aten.op "aten.view.default"(%[[ROWS]])
// CHECK-NEXT: %[[PART:.*]] = aten.op "aten.mm.default"(%[[RV]], %t2) {{.*}}: (tensor<32x64xbf16>, tensor<64x32xbf16>) -> tensor<32x32xbf16>
// CHECK-NEXT: dist.send %[[PART]] to @mesh grid_axes = [0] offset = 1 tag = 4 offset_step = 1 tag_step = 1 {stream = "symm_mem"}
// CHECK-NEXT: %[[GOT:.*]] = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 4 offset_step = -1 tag_step = 1 {stream = "symm_mem"} : tensor<32x32xbf16>
// CHECK-NEXT: %[[GV:.*]] = aten.op "aten.view.default"(%[[GOT]])
// CHECK-NEXT: %[[PL:.*]] = aten.op "aten.slice_scatter.default"(%[[RA]], %[[GV]]) {{.*}}start = 1024 : i64, end = 2048 : i64} {{{.*}}flint.step_shift = array<i64: 1024, 4096>}
// CHECK-NEXT: dist.yield %[[PL]]
// CHECK-NEXT: }
// CHECK-NEXT: %[[LS:.*]] = aten.op "aten.slice.Tensor"(%[[AF]]) {{.*}}start = 0 : i64, end = 2048 : i64}
// CHECK-NEXT: %[[LV:.*]] = aten.op "aten.view.default"(%[[LS]])
// CHECK-NEXT: %[[LP:.*]] = aten.op "aten.mm.default"(%[[LV]], %t2)
// CHECK-NEXT: %[[LF:.*]] = aten.op "aten.view.default"(%[[LP]])
// CHECK-NEXT: %[[ALL:.*]] = aten.op "aten.slice_scatter.default"(%[[RO]], %[[LF]]) {{.*}}start = 0 : i64, end = 1024 : i64}
// CHECK-NEXT: dist.wait %[[RT]]
// CHECK-NEXT: %[[ST:.*]] = aten.op "aten.view.default"(%[[ALL]]) {{.*}}-> tensor<4x32x32xbf16>
// CHECK-NEXT: %[[SUM:.*]] = aten.op "aten.sum.dim_IntList"(%[[ST]]) {{.*}}args = {dim = [0 : i64]} : (tensor<4x32x32xbf16>) -> tensor<32x32xbf16>
// CHECK-NEXT: %rw = aten.op "aten.view.default"(%[[SUM]]) {{.*}}-> tensor<2x16x32xbf16>
// Unmatched: unchanged.
// CHECK-NEXT: %l = dist.all_gather %y on @mesh grid_axes = [0] gather_dim = 1 : tensor<8x32xbf16> -> tensor<8x128xbf16>
// CHECK-NEXT: %sum = aten.op "aten.add.Tensor"(%h, %h2)
// CHECK-NEXT: %q = dist.reduce_scatter %sum on @mesh grid_axes = [0] scatter_dim = 0 : tensor<128x64xbf16> -> tensor<32x64xbf16>

// RS: 0 all-gather -> matmul and 1 matmul -> reduce-scatter pipelined; left 2 all-gathers and 1 reduce-scatters unchanged (all-gather=false: 2, reduce-scatter of no matmul: 1)
// RS: dist.all_gather %x on @mesh grid_axes = [0] gather_dim = 0
// RS: dist.steps 3 {{.*}}flint.micro_pipeline_tp = "matmul_reduce_scatter"
// RS-NOT: all_gather_matmul

// AG: 1 all-gather -> matmul and 0 matmul -> reduce-scatter pipelined; left 1 all-gathers and 2 reduce-scatters unchanged (all-gather along the last dim: 1, reduce-scatter=false: 2)
// AG: dist.steps 3 {{.*}}flint.micro_pipeline_tp = "all_gather_matmul"
// AG: dist.send {{.*}}{stream = "tp"}
// AG: dist.recv {{.*}}{stream = "tp"}
// AG: %r = dist.reduce_scatter %pc on @mesh
// AG-NOT: matmul_reduce_scatter

// NONE: flint-opt: error: micro-pipeline-tp: options all-gather=false and reduce-scatter=false leave nothing to rewrite; enable at least one
// STREAM: flint-opt: error: micro-pipeline-tp: option stream="a b" is not a stream name (letters, digits, '_' and '-')
// BOOL: flint-opt: error: micro-pipeline-tp: option all-gather=3 must be true or false
// UNKNOWN: flint-opt: error: micro-pipeline-tp: unknown option 'chunks'; options: all-gather=<bool>, reduce-scatter=<bool>, stream=<name>, sms=<int>

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
