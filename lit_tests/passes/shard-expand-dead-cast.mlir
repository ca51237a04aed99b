// RUN: flint-opt %s -p 'shard-annotate{tp=2},shard-expand' | filecheck %s
// flint-opt verifies the module after every pass.
// A bf16 output projection split over the vocabulary (tp) whose logits the loss widens to float32 and
// log-softmaxes over the whole vocabulary (Hugging Face's ForCausalLMLoss: logits.float(), then view). The
// log-softmax needs the vocabulary whole: shard-expand gathers the bf16 projection output and casts after, as
// the module gathers its output before the loss widens it. The shard's own cast, and the view of it, are then
// left without a user; they are erased, not priced (before, a dead float32 copy of the shard's logits: at
// Llama 3's vocabulary of 128,256 and 8,192 tokens per rank under tp = 8, 0.8 GB of memory traffic).

// CHECK:      func.func @head_fwd
// CHECK:      %[[Y:.*]] = aten.op "aten.mm.default"{{.*}} -> tensor<16x16xbf16>
// CHECK-NOT:  aten._to_copy
// CHECK:      dist.all_gather %[[Y]] on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x16xbf16>
// CHECK:      aten.op "aten._to_copy.default"{{.*}} : (tensor<2x8x32xbf16>) -> tensor<2x8x32xf32>
// CHECK-NOT:  aten._to_copy
// CHECK:      aten._log_softmax
// CHECK-NEXT: func.return

builtin.module attributes {flint.schedule = [["head_fwd", 1 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @head_fwd(%h: tensor<2x8x16xbf16> {flint.role = "activation"}, %w: tensor<32x16xbf16> {flint.role = "parameter", flint.param = "head.output.weight"}) -> tensor<16x32xf32> {
    %0 = aten.op "aten.t.default"(%w) phase = "fwd" module = "head.output" : (tensor<32x16xbf16>) -> tensor<16x32xbf16>
    %1 = aten.op "aten.view.default"(%h) phase = "fwd" module = "head.output" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x16xbf16>) -> tensor<16x16xbf16>
    %2 = aten.op "aten.mm.default"(%1, %0) phase = "fwd" module = "head.output" : (tensor<16x16xbf16>, tensor<16x32xbf16>) -> tensor<16x32xbf16>
    %3 = aten.op "aten._unsafe_view.default"(%2) phase = "fwd" module = "head.output" args = {size = [2 : i64, 8 : i64, 32 : i64]} : (tensor<16x32xbf16>) -> tensor<2x8x32xbf16>
    %4 = aten.op "aten._to_copy.default"(%3) phase = "fwd" module = "head" args = {dtype = "torch.float32"} : (tensor<2x8x32xbf16>) -> tensor<2x8x32xf32>
    %5 = aten.op "aten.view.default"(%4) phase = "fwd" module = "head" args = {size = [16 : i64, 32 : i64]} : (tensor<2x8x32xf32>) -> tensor<16x32xf32>
    %6 = aten.op "aten._log_softmax.default"(%5) phase = "fwd" module = "head" args = {dim = 1 : i64, half_to_float = false} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    func.return %6 : tensor<16x32xf32>
  }
}
