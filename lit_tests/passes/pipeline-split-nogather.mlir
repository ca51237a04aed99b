// RUN: flint-opt %s -p 'pipeline-split{stages=1 microbatches=3 reshard-after-backward=false}' | filecheck %s
// RUN: flint-opt %s -p 'pipeline-split{stages=1 microbatches=3 reshard-after-backward=false},lower-to-chakra' | filecheck %s --check-prefix=LOWER
// RUN: flint-opt %s -p 'pipeline-split{stages=1 microbatches=3},lower-to-chakra' | filecheck %s --check-prefix=RESHARD
// flint-opt verifies the module after every pass.

// ZeRO-2 (FSDP2 reshard_after_forward=False) under gradient accumulation, parameters kept gathered between
// microbatches (torch pipelining's set_reshard_after_backward(False)): the forward entries of microbatches 1
// and 2 are marked nogather over the data-parallel axes; the backward entries of microbatches 0 and 1 nosync.
// CHECK:      flint.stage_schedules = {{\[\[}}["block_fwd", 2 : i64], ["block_bwd", 2 : i64, {nosync = ["dp_shard"]}], ["block_fwd", 2 : i64, {nogather = ["dp_shard"]}], ["block_bwd", 2 : i64, {nosync = ["dp_shard"]}], ["block_fwd", 2 : i64, {nogather = ["dp_shard"]}], ["block_bwd", 2 : i64], ["block_optim", 2 : i64]]]

// Lowered: the parameter all-gather (its bf16 shard: 8x16x2 = 256 bytes) with its copy-in (the cast to bf16)
// runs in microbatch 0's forward only (block 0 flat, block 1 in the repeat), the gradient reduce-scatter (its
// fp32 input: 16x16x4 = 1024 bytes) in microbatch 2's backward only.
// LOWER:      chakra.graph @step_pp0 {
// LOWER-NEXT: chakra.comp "aten._to_copy.default"
// LOWER-NEXT: chakra.coll all_gather "dist.all_gather" on @mesh grid_axes = [0] bytes = 256
// LOWER:      chakra.repeat 1
// LOWER-NEXT: ^bb0
// LOWER-NEXT: chakra.comp "aten._to_copy.default"
// LOWER-NEXT: chakra.coll all_gather "dist.all_gather" on @mesh grid_axes = [0] bytes = 256
// LOWER-NOT:  chakra.coll all_gather
// LOWER-NOT:  _to_copy
// LOWER:      chakra.coll reduce_scatter "dist.reduce_scatter" on @mesh grid_axes = [0] bytes = 1024
// LOWER-NOT:  chakra.coll

// Without the option every microbatch's forward gathers again (FSDP2's default reshard after backward): the
// forward repeats of microbatches 1 and 2 (after a backward repeat each) start with the all-gather.
// RESHARD:      chakra.repeat 1
// RESHARD-NEXT: ^bb0
// RESHARD-NEXT: chakra.comp "aten._to_copy.default"
// RESHARD-NEXT: chakra.coll all_gather
// RESHARD:      chakra.repeat 2
// RESHARD:      chakra.repeat 2
// RESHARD-NEXT: ^bb0
// RESHARD-NEXT: chakra.comp "aten._to_copy.default"
// RESHARD-NEXT: chakra.coll all_gather
// RESHARD:      chakra.repeat 2
// RESHARD:      chakra.repeat 2
// RESHARD-NEXT: ^bb0
// RESHARD-NEXT: chakra.comp "aten._to_copy.default"
// RESHARD-NEXT: chakra.coll all_gather

builtin.module attributes {flint.schedule = [["block_fwd", 2], ["block_bwd", 2], ["block_optim", 2]], flint.plan = {dp_shard = 2 : i64, zero = 2 : i64, reduce_dtype = "float32", world_size = 2 : i64}} {
  shard.grid @mesh(shape = 2) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<2x8x16xbf16> {flint.role = "activation"}, %w: tensor<8x16xf32> {flint.role = "parameter"}) -> tensor<2x8x16xbf16> {
    %w16 = aten.op "aten._to_copy.default"(%w) args = {dtype = "torch.bfloat16"} : (tensor<8x16xf32>) -> tensor<8x16xbf16>
    %ag = dist.all_gather %w16 on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x16xbf16> -> tensor<16x16xbf16>
    %wv = aten.op "aten.view.default"(%ag) args = {size = [16, 16]} : (tensor<16x16xbf16>) -> tensor<16x16xbf16>
    %y = aten.op "aten.matmul.default"(%x, %wv) : (tensor<2x8x16xbf16>, tensor<16x16xbf16>) -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @block_bwd(%x: tensor<2x8x16xbf16> {flint.role = "saved"}, %g: tensor<2x8x16xbf16> {flint.role = "tangent"}) -> (tensor<2x8x16xbf16>, tensor<8x16xf32>) {
    %xt = aten.op "aten.view.default"(%x) args = {size = [16, 16]} : (tensor<2x8x16xbf16>) -> tensor<16x16xbf16>
    %gt = aten.op "aten.view.default"(%g) args = {size = [16, 16]} : (tensor<2x8x16xbf16>) -> tensor<16x16xbf16>
    %dw = aten.op "aten.mm.default"(%xt, %gt) : (tensor<16x16xbf16>, tensor<16x16xbf16>) -> tensor<16x16xbf16>
    %dw32 = aten.op "aten._to_copy.default"(%dw) args = {dtype = "torch.float32"} : (tensor<16x16xbf16>) -> tensor<16x16xf32>
    %rs = dist.reduce_scatter %dw32 on @mesh grid_axes = [0] scatter_dim = 0 : tensor<16x16xf32> -> tensor<8x16xf32>
    func.return %g, %rs : tensor<2x8x16xbf16>, tensor<8x16xf32>
  }
  func.func @block_optim(%w: tensor<8x16xf32> {flint.role = "parameter"}, %g: tensor<8x16xf32> {flint.role = "gradient"}) {
    func.return
  }
}
