// RUN: flint-opt %s -p 'hoist-starts{max-in-flight=1}' | filecheck %s --check-prefix=ONE
// RUN: flint-opt %s -p 'hoist-starts{max-in-flight=2}' | filecheck %s --check-prefix=TWO
// RUN: not flint-opt %s -p 'hoist-starts{max-in-flight=0}' 2>&1 | filecheck %s --check-prefix=ZERO

// Two gathers of parameters, issued late: both could start at the top.
builtin.module {
  shard.grid @mesh(shape = 4)
  func.func @f(%x: tensor<8x64xbf16>, %a: tensor<16x64xbf16> {flint.role = "parameter"}, %b: tensor<16x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.relu.default"(%x) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %1 = dist.all_gather %a on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
    %2 = dist.wait %1 : tensor<64x64xbf16>
    %3 = aten.op "aten.mm.default"(%0, %2) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %4 = dist.all_gather %b on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
    %5 = dist.wait %4 : tensor<64x64xbf16>
    %6 = aten.op "aten.mm.default"(%3, %5) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %6 : tensor<8x64xbf16>
  }
}

// One in flight: the first gather goes to the top; the second may not start before the first is waited.
// ONE: %[[A:.*]] = dist.all_gather %a
// ONE-NEXT: aten.op "aten.relu.default"
// ONE-NEXT: dist.wait %[[A]]
// ONE-NEXT: %[[B:.*]] = dist.all_gather %b
// ONE-NEXT: aten.op "aten.mm.default"
// ONE-NEXT: dist.wait %[[B]]

// Two in flight: both at the top.
// TWO: %[[A:.*]] = dist.all_gather %a
// TWO-NEXT: %[[B:.*]] = dist.all_gather %b
// TWO-NEXT: aten.op "aten.relu.default"
// TWO-NEXT: dist.wait %[[A]]
// TWO-NEXT: aten.op "aten.mm.default"
// TWO-NEXT: dist.wait %[[B]]

// ZERO: error: hoist-starts: option max-in-flight=0 must be >= 1
