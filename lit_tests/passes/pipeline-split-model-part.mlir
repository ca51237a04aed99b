// RUN: not flint-opt %s -p 'pipeline-split{stages=2 microbatches=2}' 2>&1 | filecheck %s --check-prefix=STAGES
// RUN: flint-opt %s -p 'pipeline-split{stages=1 microbatches=2}' | filecheck %s
// flint-opt verifies the module after every pass.

// A model outside the zoo whose work outside the blocks stayed one part (tied embeddings, or one data-parallel
// group over both sides): @model holds the work before AND after the repeated blocks (embedding, head, loss),
// scheduled before them. Split into stages, all of it would run
// on the first stage (what the planned path, flint expand, did); refused, naming the way that splits it.
// STAGES: plan field 'pp': @model_fwd holds a model's work both before and after its repeated blocks
// STAGES-SAME: capture it with pp in the plan (flint capture --plan-file), which splits that part into first_stage and last_stage, or says why it cannot

// One stage (microbatches only): nothing is split, the model part runs as captured.
// CHECK: flint.stage_schedules = {{\[\[}}["model_fwd", 1 : i64], ["block_fwd", 2 : i64], ["block_bwd", 2 : i64, {nosync = ["dp_shard"]}], ["model_bwd", 1 : i64, {nosync = ["dp_shard"]}], ["model_fwd", 1 : i64], ["block_fwd", 2 : i64], ["block_bwd", 2 : i64], ["model_bwd", 1 : i64]]]

builtin.module attributes {flint.schedule = [["model_fwd", 1], ["block_fwd", 2], ["block_bwd", 2], ["model_bwd", 1]], flint.plan = {dp_shard = 2 : i64, pp = 2 : i64, microbatches = 2 : i64, world_size = 4 : i64}} {
  shard.grid @mesh(shape = 2x2) {flint.axis_names = ["pp", "dp_shard"]}
  func.func @model_fwd(%x: tensor<2x8x16xbf16> {flint.role = "input"}) -> tensor<2x8x16xbf16> {
    %y = aten.op "aten.relu.default"(%x) : (tensor<2x8x16xbf16>) -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @model_bwd(%g: tensor<2x8x16xbf16> {flint.role = "tangent"}) -> tensor<2x8x16xbf16> {
    func.return %g : tensor<2x8x16xbf16>
  }
  func.func @block_fwd(%x: tensor<2x8x16xbf16> {flint.role = "activation"}, %w: tensor<16x16xbf16> {flint.role = "parameter"}) -> tensor<2x8x16xbf16> {
    %y = aten.op "aten.matmul.default"(%x, %w) : (tensor<2x8x16xbf16>, tensor<16x16xbf16>) -> tensor<2x8x16xbf16>
    func.return %y : tensor<2x8x16xbf16>
  }
  func.func @block_bwd(%x: tensor<2x8x16xbf16> {flint.role = "saved"}, %g: tensor<2x8x16xbf16> {flint.role = "tangent"}) -> tensor<2x8x16xbf16> {
    func.return %g : tensor<2x8x16xbf16>
  }
}
