// RUN: flint-opt %s -p 'shard-annotate{tp=2},shard-expand' | filecheck %s
// flint-opt verifies the module after every pass.
// An output projection with a bias (Phi's lm_head), column-parallel over the vocabulary as the model's own plan
// declares it (Hugging Face's colwise_gather_output: weight and bias split on dim 0, the output gathered for
// the loss). In backward the gradient of the gathered logits is whole on every rank; the layer's local
// backward takes the rank's columns of it once (DTensor's Replicate -> Shard: a slice and a clone) and computes
// the weight gradient and the bias gradient from that shard. The bias gradient sums the shard's 16 columns,
// not all 32 columns of the whole gradient followed by a second slice and clone of the sum.

// CHECK:      func.func @head_bwd
// CHECK:      %[[S:.*]] = aten.op "aten.slice.Tensor"(%g) {{.*}} : (tensor<16x32xf32>) -> tensor<16x16xf32>
// CHECK-NEXT: %[[C:.*]] = aten.op "aten.clone.default"(%[[S]]) : (tensor<16x16xf32>) -> tensor<16x16xf32>
// CHECK:      aten.op "aten.sum.dim_IntList"(%[[C]]) {{.*}} : (tensor<16x16xf32>) -> tensor<1x16xf32>
// CHECK-NOT:  aten.slice
// CHECK-NOT:  aten.clone
// CHECK:      func.return

builtin.module attributes {flint.schedule = [["head_fwd", 1 : i64], ["head_bwd", 1 : i64]], flint.tp_rules = [["lm_head.weight", 0 : i64], ["lm_head.bias", 0 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @head_fwd(%h: tensor<2x8x16xf32> {flint.role = "activation"}, %w: tensor<32x16xf32> {flint.role = "parameter", flint.param = "lm_head.weight"}, %b: tensor<32xf32> {flint.role = "parameter", flint.param = "lm_head.bias"}) -> (tensor<16x32xf32>, tensor<16x16xf32>, tensor<32x16xf32>) {
    %0 = aten.op "aten.t.default"(%w) phase = "fwd" module = "lm_head" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %1 = aten.op "aten.view.default"(%h) phase = "fwd" module = "lm_head" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x16xf32>) -> tensor<16x16xf32>
    %2 = aten.op "aten.addmm.default"(%b, %1, %0) phase = "fwd" module = "lm_head" : (tensor<32xf32>, tensor<16x16xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %3 = aten.op "aten._log_softmax.default"(%2) phase = "fwd" module = "loss" args = {dim = 1 : i64, half_to_float = false} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    func.return %3, %1, %w : tensor<16x32xf32>, tensor<16x16xf32>, tensor<32x16xf32>
  }
  func.func @head_bwd(%x: tensor<16x16xf32> {flint.role = "saved"}, %w: tensor<32x16xf32> {flint.role = "saved"}, %g: tensor<16x32xf32> {flint.role = "tangent"}) -> (tensor<2x8x16xf32>, tensor<32x16xf32>, tensor<32xf32>) {
    %0 = aten.op "aten.mm.default"(%g, %w) phase = "bwd" module = "lm_head" : (tensor<16x32xf32>, tensor<32x16xf32>) -> tensor<16x16xf32>
    %1 = aten.op "aten.t.default"(%g) phase = "bwd" module = "lm_head" : (tensor<16x32xf32>) -> tensor<32x16xf32>
    %2 = aten.op "aten.mm.default"(%1, %x) phase = "bwd" module = "lm_head" : (tensor<32x16xf32>, tensor<16x16xf32>) -> tensor<32x16xf32>
    %3 = aten.op "aten.sum.dim_IntList"(%g) phase = "bwd" module = "lm_head" args = {dim = [0 : i64], keepdim = true} : (tensor<16x32xf32>) -> tensor<1x32xf32>
    %4 = aten.op "aten.view.default"(%3) phase = "bwd" module = "lm_head" args = {size = [32 : i64]} : (tensor<1x32xf32>) -> tensor<32xf32>
    %5 = aten.op "aten.view.default"(%0) phase = "bwd" module = "lm_head" args = {size = [2 : i64, 8 : i64, 16 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x16xf32>
    func.return %5, %2, %4 : tensor<2x8x16xf32>, tensor<32x16xf32>, tensor<32xf32>
  }
}
