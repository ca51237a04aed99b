// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=gpipe}' | filecheck %s
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=1f1b layers=3,1 grad-sync=microbatch}' | filecheck %s --check-prefix=SPLIT
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=interleaved-1f1b virtual=2}' | filecheck %s --check-prefix=INTER
// RUN: flint-opt %s -p 'pipeline-split{stages=1 microbatches=3}' | filecheck %s --check-prefix=ACCUM
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=zbv-zero-bubble virtual=2}' | filecheck %s --check-prefix=ZBV
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=interleaved-zero-bubble virtual=2}' | filecheck %s --check-prefix=IZB
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=gpipe},lower-to-chakra' | filecheck %s --check-prefix=LOWER
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=interleaved-1f1b virtual=2 p2p=blocking},verify-p2p,lower-to-chakra' | filecheck %s --check-prefix=BLOCK
// RUN: flint-opt %s -p 'pipeline-split{stages=2 microbatches=2 schedule=interleaved-1f1b virtual=2 p2p=overlap}' | filecheck %s --check-prefix=OVER
// flint-opt verifies the module after every pass.

// GPipe, 2 pipeline ranks, 2 microbatches, 4 layers split 2 + 2. Rank 0 runs embed + 2 blocks and
// sends each microbatch's activation to +1 along pp (tags 0, 1), then waits for each gradient from
// +1 (tags 2, 3) before its backward; gradients sync only in the last microbatch's backward.
// CHECK:      flint.stage_schedules = {{\[\[}}["embed_fwd", 1 : i64], ["block_fwd", 2 : i64], ["pp_send_f_p1", 1 : i64, {tag = 0 : i64}], ["embed_fwd", 1 : i64], ["block_fwd", 2 : i64], ["pp_send_f_p1", 1 : i64, {tag = 1 : i64}], ["pp_recv_b_p1", 1 : i64, {tag = 2 : i64}], ["block_bwd", 2 : i64, {nosync = ["dp_shard"]}], ["embed_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["pp_recv_b_p1", 1 : i64, {tag = 3 : i64}], ["block_bwd", 2 : i64], ["embed_bwd", 1 : i64], ["block_optim", 2 : i64]],
// Rank 1: receives from -1 (tags 0, 1), runs 2 blocks + head, sends gradients back to -1 (tags 2, 3).
// CHECK-SAME: {{\[}}["pp_recv_f_m1", 1 : i64, {tag = 0 : i64}], ["block_fwd", 2 : i64], ["head_fwd", 1 : i64], ["pp_recv_f_m1", 1 : i64, {tag = 1 : i64}], ["block_fwd", 2 : i64], ["head_fwd", 1 : i64], ["head_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["block_bwd", 2 : i64, {nosync = ["dp_shard"]}], ["pp_send_b_m1", 1 : i64, {tag = 2 : i64}], ["head_bwd", 1 : i64], ["block_bwd", 2 : i64], ["pp_send_b_m1", 1 : i64, {tag = 3 : i64}], ["block_optim", 2 : i64]]]
// CHECK-SAME: flint.pipeline = {axis = "pp", ranks = 2 : i64, stages = 2 : i64, schedule = "gpipe", microbatches = 2 : i64, stage_ranks = [0 : i64, 1 : i64], layers = [2 : i64, 2 : i64], grad_sync = "step"}
// CHECK-NOT:  flint.schedule
// The function bodies are untouched; one function per (direction, offset) holds the send / recv.
// CHECK:      func.func @block_fwd(
// CHECK:      func.func @pp_send_f_p1(%x: tensor<2x8x16xbf16> {flint.role = "activation"}) {
// CHECK-NEXT:   dist.send %x to @mesh grid_axes = [0] offset = 1 tag = 0 : tensor<2x8x16xbf16>
// CHECK:      func.func @pp_recv_b_p1() -> tensor<2x8x16xbf16> {
// CHECK-NEXT:   %{{.*}} = dist.recv from @mesh grid_axes = [0] offset = 1 tag = 0 : tensor<2x8x16xbf16>
// CHECK:      func.func @pp_recv_f_m1() -> tensor<2x8x16xbf16> {
// CHECK-NEXT:   %{{.*}} = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 : tensor<2x8x16xbf16>
// CHECK:      func.func @pp_send_b_m1(%x: tensor<2x8x16xbf16> {flint.role = "tangent"}) {
// CHECK-NEXT:   dist.send %x to @mesh grid_axes = [0] offset = -1 tag = 0 : tensor<2x8x16xbf16>

// An explicit split (3 + 1 layers) under 1F1B, gradients reduced every microbatch (no nosync).
// SPLIT:      flint.stage_schedules = {{\[\[}}["embed_fwd", 1 : i64], ["block_fwd", 3 : i64], ["pp_send_f_p1", 1 : i64, {tag = 0 : i64}]
// SPLIT-NOT:  nosync
// SPLIT:      ["block_optim", 3 : i64]], {{\[}}["pp_recv_f_m1", 1 : i64, {tag = 0 : i64}], ["block_fwd", 1 : i64], ["head_fwd", 1 : i64], ["head_bwd", 1 : i64], ["block_bwd", 1 : i64]
// SPLIT-SAME: ["block_optim", 1 : i64]]]
// SPLIT-SAME: schedule = "1f1b", microbatches = 2 : i64, stage_ranks = [0 : i64, 1 : i64], layers = [3 : i64, 1 : i64], grad_sync = "microbatch"

// Interleaved 1F1B, 2 stages per rank: stage 2 on rank 0 receives from rank 1 (offset +1 wraps
// around the pp axis), tags 4 + microbatch for boundary 1 -> 2; each rank optimizes its 2 layers.
// A multi-stage schedule runs in torch's _PipelineScheduleRuntime: each recv is posted at torch's
// RECV action (asynchronous) and the consuming forward / backward waits for it (wait = [tag]);
// sends are asynchronous too (torch waits for them after the last action).
// INTER:      flint.stage_schedules = {{\[\[}}["embed_fwd", 1 : i64], ["block_fwd", 1 : i64], ["pp_send_f_p1", 1 : i64, {tag = 0 : i64}], ["pp_recv_f_p1", 1 : i64, {tag = 4 : i64}], ["embed_fwd", 1 : i64], ["block_fwd", 1 : i64], ["pp_send_f_p1", 1 : i64, {tag = 1 : i64}], ["pp_recv_f_p1", 1 : i64, {tag = 5 : i64}], ["block_fwd", 1 : i64, {wait = [4 : i64]}]
// INTER-SAME: ["block_optim", 2 : i64]]
// INTER-SAME: stages = 4 : i64, schedule = "interleaved-1f1b", microbatches = 2 : i64, stage_ranks = [0 : i64, 1 : i64, 0 : i64, 1 : i64], layers = [1 : i64, 1 : i64, 1 : i64, 1 : i64]
// p2p=overlap (Megatron's overlap_p2p_comm) is what torch's multi-stage runtime runs: the same entries.
// OVER:       ["pp_send_f_p1", 1 : i64, {tag = 0 : i64}], ["pp_recv_f_p1", 1 : i64, {tag = 4 : i64}], ["embed_fwd", 1 : i64], ["block_fwd", 1 : i64], ["pp_send_f_p1", 1 : i64, {tag = 1 : i64}], ["pp_recv_f_p1", 1 : i64, {tag = 5 : i64}], ["block_fwd", 1 : i64, {wait = [4 : i64]}]
// OVER-SAME:  p2p = "overlap"
// p2p=blocking: torch's order, sends and recvs synchronous; each recv is issued
// after the compute before it (post) and the next compute waits for the send and the recv.
// BLOCK:      chakra.graph @step_pp0 {
// BLOCK:      %[[MM:.*]] = chakra.comp "aten.matmul.default"
// BLOCK-NEXT: %[[S:.*]] = chakra.send "dist.send" on @mesh grid_axes = [0] offset = 1 tag = 0 bytes = 512 data(%[[MM]])
// BLOCK-NEXT: %[[R:.*]] = chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = 1 tag = 4 bytes = 512 ctrl(%[[MM]])
// BLOCK-NEXT: chakra.comp "aten.empty.memory_format" {{.*}} ctrl(%[[MM]], %[[S]], %[[R]])
// BLOCK:      chakra.graph @step_pp1 {
// BLOCK-NEXT: %[[R1:.*]] = chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = -1 tag = 0 bytes = 512
// BLOCK-NEXT: %[[C1:.*]] = chakra.comp "aten.matmul.default" {{.*}} ctrl(%[[R1]])
// BLOCK-NEXT: chakra.send "dist.send" on @mesh grid_axes = [0] offset = -1 tag = 4 bytes = 512 data(%[[C1]])
// BLOCK-NEXT: chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = -1 tag = 1 bytes = 512 ctrl(%[[C1]])
// INTER:      func.func @pp_send_f_p1(%x: tensor<2x8x16xbf16> {flint.role = "activation"}) {
// INTER-NEXT:   %{{.*}} = dist.send %x to @mesh grid_axes = [0] offset = 1 tag = 0 : tensor<2x8x16xbf16> -> !dist.future<none>
// INTER:      func.func @pp_recv_f_p1() -> !dist.future<tensor<2x8x16xbf16>> {
// INTER-NEXT:   %{{.*}} = dist.recv from @mesh grid_axes = [0] offset = 1 tag = 0 : !dist.future<tensor<2x8x16xbf16>>

// ZBV zero bubble: stages in a V (0, 1 on ranks 0, 1; 2, 3 on ranks 1, 0). Rank 0 runs the last stage:
// its I action is the input-gradient part of head and block backward (no gradient sync), sent back at
// once; its W action the weight-gradient part, whose reduce-scatter runs on the stage's last W only.
// The first stage's I does nothing and its W is the full backward (torch's backward_weight_one_chunk).
// ZBV:      ["head_fwd", 1 : i64], ["head_bwd_input", 1 : i64, {nosync = ["dp_shard"]}], ["block_bwd_input", 1 : i64, {nosync = ["dp_shard"]}], ["pp_send_b_p1", 1 : i64, {tag = 10 : i64}], ["pp_recv_f_p1", 1 : i64, {tag = 9 : i64}], ["block_bwd_weight", 1 : i64, {nosync = ["dp_shard"]}]
// ZBV-SAME: ["block_bwd_weight", 1 : i64], ["block_bwd", 1 : i64, {nosync = ["dp_shard"], wait = [2 : i64]}], ["embed_bwd", 1 : i64, {nosync = ["dp_shard"]}]
// Rank 1 holds stages 1 and 2: the 1 -> 2 hand-off stays on the rank (no send / recv between them).
// ZBV-SAME: {{\[}}["pp_recv_f_m1", 1 : i64, {tag = 0 : i64}], ["block_fwd", 1 : i64, {wait = [0 : i64]}], ["pp_recv_f_m1", 1 : i64, {tag = 1 : i64}], ["block_fwd", 1 : i64], ["pp_send_f_m1", 1 : i64, {tag = 8 : i64}]
// ZBV-SAME: stage_ranks = [0 : i64, 1 : i64, 1 : i64, 0 : i64]
// The backward split in two functions (one body each): I computes dx, W dw and its reduce-scatter.
// ZBV:      func.func @block_bwd(
// ZBV:      func.func @block_bwd_input(%{{.*}}: tensor<16x16xbf16> {flint.role = "parameter"}, %{{.*}}: tensor<2x8x16xbf16> {flint.role = "tangent"}) -> tensor<2x8x16xbf16> attributes {flint.backward_part = "input", flint.backward_of = "block_bwd"} {
// ZBV-NEXT:   aten.op "aten.matmul.default"
// ZBV-NEXT:   func.return
// ZBV:      func.func @block_bwd_weight(%{{.*}}: tensor<16x16xbf16> {flint.role = "parameter"}) -> tensor<8x16xbf16> attributes {flint.backward_part = "weight", flint.backward_of = "block_bwd"} {
// ZBV-NEXT:   aten.op "aten.mm.default"
// ZBV-NEXT:   dist.reduce_scatter
// ZBV-NEXT:   func.return
// The head's weight part is empty here (its backward has no parameter): no function, no entry.
// ZBV:      func.func @head_bwd_input(
// ZBV-NOT:  func.func @head_bwd_weight(

// Interleaved zero bubble, round-robin stages: rank 0's stage 2 runs I then W per microbatch.
// IZB:      ["block_bwd_input", 1 : i64, {nosync = ["dp_shard"], wait = [10 : i64]}], ["pp_send_b_p1", 1 : i64, {tag = 6 : i64}], ["block_bwd_weight", 1 : i64, {nosync = ["dp_shard"]}]
// IZB-SAME: schedule = "interleaved-zero-bubble", microbatches = 2 : i64, stage_ranks = [0 : i64, 1 : i64, 0 : i64, 1 : i64]

// One stage: plain gradient accumulation over 3 microbatches, reduce-scatters only in the last.
// ACCUM:      flint.stage_schedules = {{\[\[}}["embed_fwd", 1 : i64], ["block_fwd", 4 : i64], ["head_fwd", 1 : i64], ["head_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["block_bwd", 4 : i64, {nosync = ["dp_shard"]}], ["embed_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["embed_fwd", 1 : i64], ["block_fwd", 4 : i64], ["head_fwd", 1 : i64], ["head_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["block_bwd", 4 : i64, {nosync = ["dp_shard"]}], ["embed_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["embed_fwd", 1 : i64], ["block_fwd", 4 : i64], ["head_fwd", 1 : i64], ["head_bwd", 1 : i64], ["block_bwd", 4 : i64], ["embed_bwd", 1 : i64], ["block_optim", 4 : i64]]]

// Lowered: one chakra.graph per pipeline rank; microbatch 0's backward has no reduce-scatter
// (accumulation), microbatch 1's has; sends / recvs carry the per-microbatch tags and wait order.
// LOWER:      chakra.graph @step_pp0 {
// LOWER:      chakra.send "dist.send" on @mesh grid_axes = [0] offset = 1 tag = 0 bytes = 512
// LOWER:      chakra.send "dist.send" on @mesh grid_axes = [0] offset = 1 tag = 1 bytes = 512
// LOWER:      chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = 1 tag = 2 bytes = 512
// LOWER-NOT:  chakra.coll
// LOWER:      chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = 1 tag = 3 bytes = 512
// LOWER:      chakra.coll reduce_scatter "dist.reduce_scatter" on @mesh grid_axes = [1]
// LOWER:      chakra.graph @step_pp1 {
// LOWER:      chakra.recv "dist.recv" on @mesh grid_axes = [0] offset = -1 tag = 0 bytes = 512

builtin.module attributes {flint.schedule = [["embed_fwd", 1], ["block_fwd", 4], ["head_fwd", 1], ["head_bwd", 1], ["block_bwd", 4], ["embed_bwd", 1], ["block_optim", 4]], flint.plan = {dp_shard = 2 : i64, pp = 2 : i64, world_size = 4 : i64}} {
  shard.grid @mesh(shape = 2x2) {flint.axis_names = ["pp", "dp_shard"]}
  func.func @embed_fwd(%t: tensor<2x8xi64> {flint.role = "input"}) -> tensor<2x8x16xbf16> {
    %y = aten.op "aten.empty.memory_format"() args = {size = [2, 8, 16]} : () -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @block_fwd(%x: tensor<2x8x16xbf16> {flint.role = "activation"}, %w: tensor<16x16xbf16> {flint.role = "parameter"}) -> tensor<2x8x16xbf16> {
    %y = aten.op "aten.matmul.default"(%x, %w) : (tensor<2x8x16xbf16>, tensor<16x16xbf16>) -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @head_fwd(%x: tensor<2x8x16xbf16> {flint.role = "activation"}) -> tensor<f32> {
    %y = aten.op "aten.sum.default"(%x) : (tensor<2x8x16xbf16>) -> tensor<f32>
    func.return %y : tensor<f32>
  }
  func.func @head_bwd(%g: tensor<f32> {flint.role = "tangent"}) -> tensor<2x8x16xbf16> {
    %y = aten.op "aten.expand.default"(%g) args = {size = [2, 8, 16]} : (tensor<f32>) -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @block_bwd(%w: tensor<16x16xbf16> {flint.role = "parameter"}, %g: tensor<2x8x16xbf16> {flint.role = "tangent"}) -> (tensor<2x8x16xbf16>, tensor<8x16xbf16>) {
    %dx = aten.op "aten.matmul.default"(%g, %w) : (tensor<2x8x16xbf16>, tensor<16x16xbf16>) -> tensor<2x8x16xbf16>
    %dw = aten.op "aten.mm.default"(%w, %w) : (tensor<16x16xbf16>, tensor<16x16xbf16>) -> tensor<16x16xbf16>
    %rs = dist.reduce_scatter %dw on @mesh grid_axes = [1] scatter_dim = 0 : tensor<16x16xbf16> -> tensor<8x16xbf16>
    func.return %dx, %rs : tensor<2x8x16xbf16>, tensor<8x16xbf16>
  }
  func.func @embed_bwd(%g: tensor<2x8x16xbf16> {flint.role = "tangent"}) {
    func.return
  }
  func.func @block_optim(%w: tensor<8x16xbf16> {flint.role = "parameter"}, %g: tensor<8x16xbf16> {flint.role = "gradient"}) {
    func.return
  }
}
