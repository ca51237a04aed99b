// A hand-written per-rank SPMD step of a 2-layer MLP under FSDP x TP on a
// 4 x 2 grid (4-way FSDP along "dp", 2-way TP along "tp"). `make demo` runs
// canonicalize-dist and verify-dist on it until capture and emission land.
shard.grid @mesh(shape = 4x2)

func.func @step(%x: tensor<8x64xbf16>, %w1_shard: tensor<16x64xbf16>, %w2_shard: tensor<64x16xbf16>) -> tensor<8x64xbf16> {
  // FSDP: gather this layer's weight shard, overlapped with nothing: the wait folds.
  %0 = dist.all_gather %w1_shard on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
  %w1 = dist.wait %0 : tensor<64x64xbf16>
  // Prefetch the next layer's weight while computing this one.
  %1 = dist.all_gather %w2_shard on @mesh grid_axes = [0] gather_dim = 1 : tensor<64x16xbf16> -> !dist.future<tensor<64x64xbf16>>
  %h = aten.op "aten.mm.default"(%x, %w1) phase = "fwd" module = "layers.0" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %a = aten.op "aten.relu.default"(%h) phase = "fwd" module = "layers.0" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
  %w2 = dist.wait %1 : tensor<64x64xbf16>
  %y = aten.op "aten.mm.default"(%a, %w2) phase = "fwd" module = "layers.1" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  // TP: a row-parallel layer's partial sums.
  %2 = dist.all_reduce %y on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>
  func.return %2 : tensor<8x64xbf16>
}
