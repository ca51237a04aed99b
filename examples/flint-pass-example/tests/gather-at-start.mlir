// RUN: flint-opt %s -p gather-at-start | filecheck %s
// RUN: flint-opt %s -p 'gather-at-start{kind=all}' | filecheck %s --check-prefix=ALL

shard.grid @mesh(shape = 4)

// CHECK-LABEL: func.func @block
// CHECK-NEXT:  %[[A:.*]] = dist.all_gather %w1s
// CHECK-NEXT:  %[[B:.*]] = dist.all_gather %w2s
// CHECK-NEXT:  dist.wait %[[A]]
// CHECK:       aten.op "aten.mm.default"(%h
// CHECK-NEXT:  dist.reduce_scatter %g
// ALL-LABEL:   func.func @block
// ALL-NEXT:    dist.all_gather %w1s
// ALL-NEXT:    dist.all_gather %w2s
// ALL-NEXT:    dist.reduce_scatter %g
func.func @block(%x: tensor<8x64xbf16>, %w1s: tensor<16x64xbf16>, %w2s: tensor<16x64xbf16>, %g: tensor<64x8xbf16>) -> (tensor<8x64xbf16>, tensor<16x8xbf16>) {
  %0 = dist.all_gather %w1s on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
  %w1 = dist.wait %0 : tensor<64x64xbf16>
  %h = aten.op "aten.mm.default"(%x, %w1) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %1 = dist.all_gather %w2s on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
  %w2 = dist.wait %1 : tensor<64x64xbf16>
  %y = aten.op "aten.mm.default"(%h, %w2) : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
  %2 = dist.reduce_scatter %g on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64x8xbf16> -> !dist.future<tensor<16x8xbf16>>
  %gs = dist.wait %2 : tensor<16x8xbf16>
  func.return %y, %gs : tensor<8x64xbf16>, tensor<16x8xbf16>
}
