// RUN: flint-opt %s -p sink-waits | filecheck %s

// A reduce-scatter waited for at once, its result only renamed (views) and returned: the wait
// and its views move to the end of the body. A gather's wait moves down to its first real use.
builtin.module {
  shard.grid @mesh(shape = 4)
  func.func @bwd(%g: tensor<64x64xbf16>, %ws: tensor<16x64xbf16> {flint.role = "parameter"}, %x: tensor<8x64xbf16>) -> (tensor<16x64xbf16>, tensor<8x64xbf16>) {
    %0 = dist.reduce_scatter %g on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64x64xbf16> -> !dist.future<tensor<16x64xbf16>>
    %1 = dist.wait %0 : tensor<16x64xbf16>
    %2 = aten.op "aten.view.default"(%1) phase = "bwd" args = {size = [16, 64]} : (tensor<16x64xbf16>) -> tensor<16x64xbf16>
    %3 = dist.all_gather %ws on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
    %4 = dist.wait %3 : tensor<64x64xbf16>
    %5 = aten.op "aten.relu.default"(%x) phase = "bwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %6 = aten.op "aten.mm.default"(%5, %4) phase = "bwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %2, %6 : tensor<16x64xbf16>, tensor<8x64xbf16>
  }
}

// CHECK: %[[RS:.*]] = dist.reduce_scatter
// CHECK-NEXT: %[[AG:.*]] = dist.all_gather
// CHECK-NEXT: %[[X:.*]] = aten.op "aten.relu.default"
// CHECK-NEXT: %[[W:.*]] = dist.wait %[[AG]]
// CHECK-NEXT: %[[M:.*]] = aten.op "aten.mm.default"(%[[X]], %[[W]])
// CHECK-NEXT: %[[G:.*]] = dist.wait %[[RS]]
// CHECK-NEXT: %[[V:.*]] = aten.op "aten.view.default"(%[[G]])
// CHECK-NEXT: func.return %[[V]], %[[M]]
