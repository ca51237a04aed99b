// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2},shard-expand' | filecheck %s --check-prefix=FSDP
// RUN: flint-opt %s -p 'shard-annotate{dp_replicate=2},shard-expand' | filecheck %s --check-prefix=DDP
// Hugging Face's causal-LM loss on one device (transformers' ForCausalLMLoss): the labels padded with -100
// at the end of the sequence (constant_pad_nd) and shifted, ATen's cross-entropy (_log_softmax then
// nll_loss_forward, mean over the tokens), and its backward (nll_loss_backward). The untied input embedding
// is its own data-parallel unit, as the captured recipes wrap it (get_input_embeddings); the output
// projection is the function's other unit. flint-opt verifies the module after every pass.

// Batch split over dp_shard: each rank pads and shifts its own 2 sequences and takes the mean of its own
// tokens' loss; no collective for the loss, in forward or backward.
// FSDP:      func.func @model_fwd(%ids: tensor<2x8xi64> {{.*}}, %emb: tensor<16x16xf32> {{.*}}, %head: tensor<16x16xf32> {{.*}}, %labels: tensor<2x8xi64>
// FSDP:      dist.all_gather {{.*}} : tensor<256xf32> -> !dist.future<tensor<512xf32>>
// FSDP:      dist.all_gather {{.*}} : tensor<256xf32> -> !dist.future<tensor<512xf32>>
// FSDP:      "aten.constant_pad_nd.default"(%{{.*}}) {{.*}} args = {pad = [0 : i64, 1 : i64], value = -1.000000e+02 : f64} : (tensor<2x8xi64>) -> tensor<2x9xi64>
// FSDP:      "aten._log_softmax.default"(%{{.*}}) {{.*}} : (tensor<16x32xf32>) -> tensor<16x32xf32>
// FSDP-NEXT: "aten.nll_loss_forward.default"(%{{.*}}, %{{.*}}) {{.*}} : (tensor<16x32xf32>, tensor<16xi64>) -> (tensor<f32>, tensor<f32>)
// FSDP-NOT:  dist.
// The part runs once and last: its other unit (the output projection) keeps its forward's gathered weight for
// the backward, as FSDP2 never reshards its root group after forward (torchtitan: [norm, output] with
// reshard_after_forward=False); the backward gathers the embedding alone again.
// FSDP:      func.func @model_bwd({{.*}}%head: tensor<32x16xf32> {flint.role = "parameter"
// FSDP:      dist.all_gather {{.*}} : tensor<256xf32> -> !dist.future<tensor<512xf32>>
// FSDP-NOT:  dist.all_gather
// FSDP:      "aten.nll_loss_backward.default"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) {{.*}} : (tensor<f32>, tensor<16x32xf32>, tensor<16xi64>, tensor<f32>) -> tensor<16x32xf32>
// FSDP-NOT:  dist.all_reduce
// FSDP:      dist.reduce_scatter {{.*}} : tensor<512xf32> -> !dist.future<tensor<256xf32>>
// FSDP:      dist.reduce_scatter {{.*}} : tensor<512xf32> -> !dist.future<tensor<256xf32>>
// FSDP-NOT:  {{= dist\.(all|reduce)}}

// With dp_replicate (DDP): one all-reduce per unit, each issued once its gradients are computed (the output
// projection's after its weight gradient, the embedding's after the embedding's backward), not both at the end.
// DDP:      func.func @model_fwd
// DDP-NOT:  dist.
// DDP:      "aten.nll_loss_backward.default"
// DDP:      %[[HG:.*]] = aten.op "aten.mm.default"(%{{.*}}, %x) {{.*}} -> tensor<32x16xf32>
// DDP:      dist.all_reduce {{.*}} reduction = average : tensor<512xf32> -> !dist.future<tensor<512xf32>>
// DDP-NEXT: aten.op "aten.mm.default"(%{{.*}}, %head)
// DDP:      "aten.embedding_dense_backward.default"
// DDP:      dist.all_reduce {{.*}} reduction = average : tensor<512xf32> -> !dist.future<tensor<512xf32>>
// DDP-NOT:  {{= dist\.(all|reduce)}}

builtin.module attributes {flint.schedule = [["model_fwd", 1 : i64], ["model_bwd", 1 : i64]], flint.plan = {world_size = 1 : i64}} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @model_fwd(%ids: tensor<4x8xi64> {flint.role = "input"}, %emb: tensor<32x16xf32> {flint.role = "parameter", flint.param = "embed.weight"}, %head: tensor<32x16xf32> {flint.role = "parameter", flint.param = "head.weight"}, %labels: tensor<4x8xi64> {flint.role = "input"}) -> (tensor<f32>, tensor<4x8xi64>, tensor<32x16xf32>, tensor<32x16xf32>, tensor<32xi64>, tensor<32x32xf32>, tensor<f32>) {
    %0 = aten.op "aten.embedding.default"(%emb, %ids) phase = "fwd" module = "embed" : (tensor<32x16xf32>, tensor<4x8xi64>) -> tensor<4x8x16xf32>
    %1 = aten.op "aten.t.default"(%head) phase = "fwd" module = "head" : (tensor<32x16xf32>) -> tensor<16x32xf32>
    %2 = aten.op "aten.view.default"(%0) phase = "fwd" module = "head" args = {size = [32 : i64, 16 : i64]} : (tensor<4x8x16xf32>) -> tensor<32x16xf32>
    %3 = aten.op "aten.mm.default"(%2, %1) phase = "fwd" module = "head" : (tensor<32x16xf32>, tensor<16x32xf32>) -> tensor<32x32xf32>
    %4 = aten.op "aten.constant_pad_nd.default"(%labels) phase = "fwd" module = "loss" args = {pad = [0 : i64, 1 : i64], value = -1.000000e+02 : f64} : (tensor<4x8xi64>) -> tensor<4x9xi64>
    %5 = aten.op "aten.slice.Tensor"(%4) phase = "fwd" module = "loss" args = {dim = 1 : i64, start = 1 : i64, end = 9223372036854775807 : i64} : (tensor<4x9xi64>) -> tensor<4x8xi64>
    %6 = aten.op "aten.view.default"(%5) phase = "fwd" module = "loss" args = {size = [-1 : i64]} : (tensor<4x8xi64>) -> tensor<32xi64>
    %7 = aten.op "aten._log_softmax.default"(%3) phase = "fwd" module = "loss" args = {dim = 1 : i64, half_to_float = false} : (tensor<32x32xf32>) -> tensor<32x32xf32>
    %8, %9 = aten.op "aten.nll_loss_forward.default"(%7, %6) phase = "fwd" module = "loss" args = {reduction = 1 : i64, ignore_index = -100 : i64} : (tensor<32x32xf32>, tensor<32xi64>) -> (tensor<f32>, tensor<f32>)
    func.return %8, %ids, %head, %2, %6, %7, %9 : tensor<f32>, tensor<4x8xi64>, tensor<32x16xf32>, tensor<32x16xf32>, tensor<32xi64>, tensor<32x32xf32>, tensor<f32>
  }
  func.func @model_bwd(%ids: tensor<4x8xi64> {flint.role = "input"}, %head: tensor<32x16xf32> {flint.role = "parameter", flint.param = "head.weight"}, %x: tensor<32x16xf32> {flint.role = "saved"}, %target: tensor<32xi64> {flint.role = "saved"}, %logp: tensor<32x32xf32> {flint.role = "saved"}, %total: tensor<f32> {flint.role = "saved"}, %tangents: tensor<f32> {flint.role = "tangent"}) -> (tensor<32x16xf32>, tensor<32x16xf32>) {
    %0 = aten.op "aten.nll_loss_backward.default"(%tangents, %logp, %target, %total) phase = "bwd" module = "loss" args = {reduction = 1 : i64, ignore_index = -100 : i64} : (tensor<f32>, tensor<32x32xf32>, tensor<32xi64>, tensor<f32>) -> tensor<32x32xf32>
    %1 = aten.op "aten._log_softmax_backward_data.default"(%0, %logp) phase = "bwd" module = "loss" args = {dim = 1 : i64, input_dtype = "torch.float32"} : (tensor<32x32xf32>, tensor<32x32xf32>) -> tensor<32x32xf32>
    %2 = aten.op "aten.t.default"(%1) phase = "bwd" module = "head" : (tensor<32x32xf32>) -> tensor<32x32xf32>
    %3 = aten.op "aten.mm.default"(%2, %x) phase = "bwd" module = "head" : (tensor<32x32xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %4 = aten.op "aten.mm.default"(%1, %head) phase = "bwd" module = "head" : (tensor<32x32xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %5 = aten.op "aten.view.default"(%4) phase = "bwd" module = "embed" args = {size = [4 : i64, 8 : i64, 16 : i64]} : (tensor<32x16xf32>) -> tensor<4x8x16xf32>
    %6 = aten.op "aten.embedding_dense_backward.default"(%5, %ids) phase = "bwd" module = "embed" args = {num_weights = 32 : i64, padding_idx = -1 : i64, scale_grad_by_freq = false} : (tensor<4x8x16xf32>, tensor<4x8xi64>) -> tensor<32x16xf32>
    func.return %6, %3 : tensor<32x16xf32>, tensor<32x16xf32>
  }
}
