// RUN: flint-opt %s -p 'shard-annotate{tp=2},shard-expand' | filecheck %s --check-prefix=TP
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2},shard-expand' | filecheck %s --check-prefix=FSDP
// flint-opt verifies the module after every pass.
// Grouped-query attention as Hugging Face's repeat_kv runs it (4 query heads, 2 key/value heads of 4): the
// key/value heads unsqueezed, expanded 2x and reshaped to 4 heads. On one device that reshape copies
// (clone(memory_format=contiguous_format) + _unsafe_view in the captured graph): merging the kv-head and
// repeat dims is no view of an expanded tensor. Under tp = 2 a rank holds one key/value head, the merge is of a
// size-1 dim and the repeat, and torch.reshape is a view there: the captured TP program has no copy, and
// neither has the expansion. The attention mask [batch, 1, seq, seq] broadcasts over the heads: its size-1
// head dim is not sliced per rank. Under dp_shard = 2 the rank's reshape still merges 2 heads x 2: the copy
// stays.

// TP:      func.func @block_fwd
// TP:      aten.op "aten.expand.default"{{.*}} -> tensor<2x1x2x8x4xf32>
// TP-NEXT: aten.op "aten._unsafe_view.default"{{.*}} : (tensor<2x1x2x8x4xf32>) -> tensor<2x2x8x4xf32>
// TP-NOT:  aten.clone
// TP-NOT:  aten.slice
// TP:      "aten._scaled_dot_product_flash_attention_for_cpu.default"(%{{.*}}, %{{.*}}, %{{.*}}, %mask) {{.*}}tensor<2x1x8x8xi1>)
// TP:      func.return

// FSDP:      func.func @block_fwd
// FSDP:      aten.op "aten.expand.default"{{.*}} -> tensor<1x2x2x8x4xf32>
// FSDP-NEXT: aten.op "aten.clone.default"{{.*}} : (tensor<1x2x2x8x4xf32>) -> tensor<1x2x2x8x4xf32>
// FSDP-NEXT: aten.op "aten._unsafe_view.default"{{.*}} -> tensor<1x4x8x4xf32>

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<2x8x16xf32> {flint.role = "activation"}, %mask: tensor<2x1x8x8xi1> {flint.role = "input"}, %wq: tensor<16x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wq.weight"}, %wk: tensor<8x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wk.weight"}, %wo: tensor<16x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wo.weight"}) -> tensor<2x8x16xf32> {
    %0 = aten.op "aten.t.default"(%wq) phase = "fwd" module = "attention.wq" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %1 = aten.op "aten.view.default"(%x) phase = "fwd" module = "attention.wq" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x16xf32>) -> tensor<16x16xf32>
    %2 = aten.op "aten.mm.default"(%1, %0) phase = "fwd" module = "attention.wq" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %3 = aten.op "aten.view.default"(%2) phase = "fwd" module = "attention" args = {size = [2 : i64, 8 : i64, 4 : i64, 4 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x4x4xf32>
    %4 = aten.op "aten.transpose.int"(%3) phase = "fwd" module = "attention" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x8x4x4xf32>) -> tensor<2x4x8x4xf32>
    %5 = aten.op "aten.t.default"(%wk) phase = "fwd" module = "attention.wk" : (tensor<8x16xf32>) -> tensor<16x8xf32>
    %6 = aten.op "aten.mm.default"(%1, %5) phase = "fwd" module = "attention.wk" : (tensor<16x16xf32>, tensor<16x8xf32>) -> tensor<16x8xf32>
    %7 = aten.op "aten.view.default"(%6) phase = "fwd" module = "attention" args = {size = [2 : i64, 8 : i64, 2 : i64, 4 : i64]} : (tensor<16x8xf32>) -> tensor<2x8x2x4xf32>
    %8 = aten.op "aten.transpose.int"(%7) phase = "fwd" module = "attention" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x8x2x4xf32>) -> tensor<2x2x8x4xf32>
    %9 = aten.op "aten.unsqueeze.default"(%8) phase = "fwd" module = "attention" args = {dim = 2 : i64} : (tensor<2x2x8x4xf32>) -> tensor<2x2x1x8x4xf32>
    %10 = aten.op "aten.expand.default"(%9) phase = "fwd" module = "attention" args = {size = [2 : i64, 2 : i64, 2 : i64, 8 : i64, 4 : i64]} : (tensor<2x2x1x8x4xf32>) -> tensor<2x2x2x8x4xf32>
    %11 = aten.op "aten.clone.default"(%10) phase = "fwd" module = "attention" args = {memory_format = "torch.contiguous_format"} : (tensor<2x2x2x8x4xf32>) -> tensor<2x2x2x8x4xf32>
    %12 = aten.op "aten._unsafe_view.default"(%11) phase = "fwd" module = "attention" args = {size = [2 : i64, 4 : i64, 8 : i64, 4 : i64]} : (tensor<2x2x2x8x4xf32>) -> tensor<2x4x8x4xf32>
    %13, %14 = aten.op "aten._scaled_dot_product_flash_attention_for_cpu.default"(%4, %12, %12, %mask) phase = "fwd" module = "attention" args = {dropout_p = 0.000000e+00 : f64, is_causal = false} : (tensor<2x4x8x4xf32>, tensor<2x4x8x4xf32>, tensor<2x4x8x4xf32>, tensor<2x1x8x8xi1>) -> (tensor<2x4x8x4xf32>, tensor<2x4x8xf32>)
    %15 = aten.op "aten.transpose.int"(%13) phase = "fwd" module = "attention" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x4x8x4xf32>) -> tensor<2x8x4x4xf32>
    %16 = aten.op "aten.view.default"(%15) phase = "fwd" module = "attention.wo" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x4x4xf32>) -> tensor<16x16xf32>
    %17 = aten.op "aten.t.default"(%wo) phase = "fwd" module = "attention.wo" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %18 = aten.op "aten.mm.default"(%16, %17) phase = "fwd" module = "attention.wo" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %19 = aten.op "aten.view.default"(%18) phase = "fwd" module = "attention.wo" args = {size = [2 : i64, 8 : i64, 16 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x16xf32>
    %20 = aten.op "aten.add.Tensor"(%x, %19) phase = "fwd" : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
    func.return %20 : tensor<2x8x16xf32>
  }
}
