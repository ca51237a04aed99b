// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=1},shard-expand' | filecheck %s --check-prefix=Z1
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=3},shard-expand' | filecheck %s --check-prefix=Z3
// RUN: flint-opt %s -p 'shard-annotate{tp=2},shard-expand' | filecheck %s --check-prefix=TP
// flint-opt verifies the module after every pass.
// The optimizer's multi-tensor form (plan field optimizer_impl = "foreach", torch's own adamw(foreach=True)) with
// fp32 masters: the MLP block of shard-expand-master.mlir, whose step runs one multi-tensor op per step of the
// update over both parameters. shard-expand expands such an op index by index: the tensors at one index (a
// master, its moments, its cast gradient, its sqrt temporary) take the layout they agree on, as a pointwise op's
// operands do; the list lengths (list_sizes) stay, the shapes become local.
//   ZeRO-1: whole bf16 parameters and gradients, sharded masters and state: each gradient is sliced before its
//           cast, the masters' shards are copied into slices of the parameters (the list _foreach_copy_ writes),
//           and those updated shards are all-gathered back into the whole parameters.
//   ZeRO-3: everything sharded: the same ops on the local shards, no collective.
//   tp = 2: w1 split on its rows, w2 on its columns (the rules' colwise / rowwise): each index its own layout.

// Z1:      func.func @block_optim(%w1: tensor<32x16xbf16> {{.*}}, %w2: tensor<16x32xbf16> {{.*}}, %g1: tensor<32x16xbf16> {{.*}}, %g2: tensor<16x32xbf16> {{.*}}, %p1: tensor<16x16xf32> {{.*}}, %p2: tensor<8x32xf32> {{.*}}, %m1: tensor<16x16xf32> {{.*}}, %m2: tensor<8x32xf32> {{.*}}, %v1: tensor<16x16xf32> {{.*}}, %v2: tensor<8x32xf32>
// Z1:      %[[W1:.*]] = aten.op "aten.slice.Tensor"(%w1) args = {dim = 0 : i64, start = 0 : i64, end = 16 : i64}
// Z1:      %[[W2:.*]] = aten.op "aten.slice.Tensor"(%w2) args = {dim = 0 : i64, start = 0 : i64, end = 8 : i64}
// Z1:      aten.op "aten._foreach_mul_.Scalar"(%p1, %p2) phase = "optim" args = {{{.*}}list_sizes = [2 : i64]} : (tensor<16x16xf32>, tensor<8x32xf32>) -> ()
// Z1:      %[[S1:.*]] = aten.op "aten.slice.Tensor"(%g1)
// Z1:      %[[G1:.*]] = aten.op "aten._to_copy.default"(%[[S1]]) {{.*}} -> tensor<16x16xf32>
// Z1:      %[[S2:.*]] = aten.op "aten.slice.Tensor"(%g2)
// Z1:      %[[G2:.*]] = aten.op "aten._to_copy.default"(%[[S2]]) {{.*}} -> tensor<8x32xf32>
// Z1:      aten.op "aten._foreach_lerp_.Scalar"(%m1, %m2, %[[G1]], %[[G2]]) {{.*}} list_sizes = [2 : i64, 2 : i64]} : (tensor<16x16xf32>, tensor<8x32xf32>, tensor<16x16xf32>, tensor<8x32xf32>) -> ()
// Z1:      %[[D1:.*]], %[[D2:.*]] = aten.op "aten._foreach_sqrt.default"(%v1, %v2) {{.*}} -> (tensor<16x16xf32>, tensor<8x32xf32>)
// Z1:      aten.op "aten._foreach_addcdiv_.ScalarList"(%p1, %p2, %m1, %m2, %[[D1]], %[[D2]])
// Z1:      aten.op "aten._foreach_copy_.default"(%[[W1]], %[[W2]], %p1, %p2) {{.*}} : (tensor<16x16xbf16>, tensor<8x32xbf16>, tensor<16x16xf32>, tensor<8x32xf32>) -> ()
// Z1:      dist.all_gather %{{.*}} on @mesh grid_axes = [0] gather_dim = 0 : tensor<512xbf16> -> !dist.future<tensor<1024xbf16>>
// Z1:      aten.op "aten.copy_.default"(%w1, %{{.*}}) : (tensor<32x16xbf16>, tensor<32x16xbf16>)
// Z1:      aten.op "aten.copy_.default"(%w2, %{{.*}}) : (tensor<16x32xbf16>, tensor<16x32xbf16>)

// Z3:      func.func @block_optim(%w1: tensor<16x16xbf16> {{.*}}, %w2: tensor<8x32xbf16> {{.*}}, %g1: tensor<16x16xbf16> {{.*}}, %g2: tensor<8x32xbf16> {{.*}}, %p1: tensor<16x16xf32> {{.*}}, %p2: tensor<8x32xf32> {{.*}}, %m1: tensor<16x16xf32> {{.*}}, %m2: tensor<8x32xf32> {{.*}}, %v1: tensor<16x16xf32> {{.*}}, %v2: tensor<8x32xf32>
// Z3-NEXT: %[[G1:.*]] = aten.op "aten._to_copy.default"(%g1)
// Z3-NEXT: %[[G2:.*]] = aten.op "aten._to_copy.default"(%g2)
// Z3-NEXT: aten.op "aten._foreach_mul_.Scalar"(%p1, %p2)
// Z3-NEXT: aten.op "aten._foreach_lerp_.Scalar"(%m1, %m2, %[[G1]], %[[G2]])
// Z3-NEXT: aten.op "aten._foreach_mul_.Scalar"(%v1, %v2)
// Z3-NEXT: aten.op "aten._foreach_addcmul_.Scalar"(%v1, %v2, %[[G1]], %[[G2]], %[[G1]], %[[G2]])
// Z3-NEXT: %[[D1:.*]], %[[D2:.*]] = aten.op "aten._foreach_sqrt.default"(%v1, %v2) {{.*}} -> (tensor<16x16xf32>, tensor<8x32xf32>)
// Z3-NEXT: aten.op "aten._foreach_div_.ScalarList"(%[[D1]], %[[D2]])
// Z3-NEXT: aten.op "aten._foreach_add_.Scalar"(%[[D1]], %[[D2]])
// Z3-NEXT: aten.op "aten._foreach_addcdiv_.ScalarList"(%p1, %p2, %m1, %m2, %[[D1]], %[[D2]])
// Z3-NEXT: aten.op "aten._foreach_copy_.default"(%w1, %w2, %p1, %p2) {{.*}} : (tensor<16x16xbf16>, tensor<8x32xbf16>, tensor<16x16xf32>, tensor<8x32xf32>) -> ()
// Z3-NEXT: func.return

// TP:      func.func @block_optim(%w1: tensor<16x16xbf16> {{.*}}, %w2: tensor<16x16xbf16> {{.*}}, %g1: tensor<16x16xbf16> {{.*}}, %g2: tensor<16x16xbf16> {{.*}}, %p1: tensor<16x16xf32> {{.*}}, %p2: tensor<16x16xf32>
// TP-NOT:  dist.
// TP:      aten.op "aten._foreach_copy_.default"(%w1, %w2, %p1, %p2) {{.*}} : (tensor<16x16xbf16>, tensor<16x16xbf16>, tensor<16x16xf32>, tensor<16x16xf32>) -> ()
// TP-NEXT: func.return

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64], ["block_optim", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<4x8x16xbf16> {flint.role = "activation"}, %w1: tensor<32x16xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}) -> (tensor<4x8x16xbf16>, tensor<4x8x16xbf16>, tensor<32x16xbf16>, tensor<16x32xbf16>, tensor<32x16xbf16>, tensor<32x32xbf16>, tensor<32x32xbf16>) {
    %0 = aten.op "aten.t.default"(%w1) phase = "fwd" module = "feed_forward.w1" : (tensor<32x16xbf16>) -> tensor<16x32xbf16>
    %1 = aten.op "aten.view.default"(%x) phase = "fwd" module = "feed_forward.w1" args = {size = [32 : i64, 16 : i64]} : (tensor<4x8x16xbf16>) -> tensor<32x16xbf16>
    %2 = aten.op "aten.mm.default"(%1, %0) phase = "fwd" module = "feed_forward.w1" : (tensor<32x16xbf16>, tensor<16x32xbf16>) -> tensor<32x32xbf16>
    %3 = aten.op "aten.silu.default"(%2) phase = "fwd" module = "feed_forward" : (tensor<32x32xbf16>) -> tensor<32x32xbf16>
    %4 = aten.op "aten.t.default"(%w2) phase = "fwd" module = "feed_forward.w2" : (tensor<16x32xbf16>) -> tensor<32x16xbf16>
    %5 = aten.op "aten.mm.default"(%3, %4) phase = "fwd" module = "feed_forward.w2" : (tensor<32x32xbf16>, tensor<32x16xbf16>) -> tensor<32x16xbf16>
    %6 = aten.op "aten._unsafe_view.default"(%5) phase = "fwd" module = "feed_forward.w2" args = {size = [4 : i64, 8 : i64, 16 : i64]} : (tensor<32x16xbf16>) -> tensor<4x8x16xbf16>
    %7 = aten.op "aten.add.Tensor"(%x, %6) phase = "fwd" : (tensor<4x8x16xbf16>, tensor<4x8x16xbf16>) -> tensor<4x8x16xbf16>
    func.return %7, %x, %w1, %w2, %1, %3, %2 : tensor<4x8x16xbf16>, tensor<4x8x16xbf16>, tensor<32x16xbf16>, tensor<16x32xbf16>, tensor<32x16xbf16>, tensor<32x32xbf16>, tensor<32x32xbf16>
  }
  func.func @block_bwd(%x: tensor<4x8x16xbf16> {flint.role = "activation"}, %w1: tensor<32x16xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %v: tensor<32x16xbf16> {flint.role = "saved"}, %h: tensor<32x32xbf16> {flint.role = "saved"}, %m: tensor<32x32xbf16> {flint.role = "saved"}, %g: tensor<4x8x16xbf16> {flint.role = "tangent"}) -> (tensor<4x8x16xbf16>, tensor<32x16xbf16>, tensor<16x32xbf16>) {
    %0 = aten.op "aten.view.default"(%g) phase = "bwd" args = {size = [32 : i64, 16 : i64]} : (tensor<4x8x16xbf16>) -> tensor<32x16xbf16>
    %1 = aten.op "aten.t.default"(%0) phase = "bwd" : (tensor<32x16xbf16>) -> tensor<16x32xbf16>
    %2 = aten.op "aten.mm.default"(%1, %h) phase = "bwd" : (tensor<16x32xbf16>, tensor<32x32xbf16>) -> tensor<16x32xbf16>
    %3 = aten.op "aten.t.default"(%w2) phase = "bwd" : (tensor<16x32xbf16>) -> tensor<32x16xbf16>
    %4 = aten.op "aten.t.default"(%3) phase = "bwd" : (tensor<32x16xbf16>) -> tensor<16x32xbf16>
    %5 = aten.op "aten.mm.default"(%0, %4) phase = "bwd" : (tensor<32x16xbf16>, tensor<16x32xbf16>) -> tensor<32x32xbf16>
    %6 = aten.op "aten.silu_backward.default"(%5, %m) phase = "bwd" : (tensor<32x32xbf16>, tensor<32x32xbf16>) -> tensor<32x32xbf16>
    %7 = aten.op "aten.t.default"(%6) phase = "bwd" : (tensor<32x32xbf16>) -> tensor<32x32xbf16>
    %8 = aten.op "aten.mm.default"(%7, %v) phase = "bwd" : (tensor<32x32xbf16>, tensor<32x16xbf16>) -> tensor<32x16xbf16>
    %9 = aten.op "aten.t.default"(%w1) phase = "bwd" : (tensor<32x16xbf16>) -> tensor<16x32xbf16>
    %10 = aten.op "aten.t.default"(%9) phase = "bwd" : (tensor<16x32xbf16>) -> tensor<32x16xbf16>
    %11 = aten.op "aten.mm.default"(%6, %10) phase = "bwd" : (tensor<32x32xbf16>, tensor<32x16xbf16>) -> tensor<32x16xbf16>
    %12 = aten.op "aten.view.default"(%11) phase = "bwd" args = {size = [4 : i64, 8 : i64, 16 : i64]} : (tensor<32x16xbf16>) -> tensor<4x8x16xbf16>
    %13 = aten.op "aten.add.Tensor"(%g, %12) phase = "bwd" : (tensor<4x8x16xbf16>, tensor<4x8x16xbf16>) -> tensor<4x8x16xbf16>
    func.return %13, %8, %2 : tensor<4x8x16xbf16>, tensor<32x16xbf16>, tensor<16x32xbf16>
  }
  func.func @block_optim(%w1: tensor<32x16xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %g1: tensor<32x16xbf16> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w1.weight"}, %g2: tensor<16x32xbf16> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w2.weight"}, %p1: tensor<32x16xf32> {flint.role = "master", flint.param = "layers.0.feed_forward.w1.weight"}, %p2: tensor<16x32xf32> {flint.role = "master", flint.param = "layers.0.feed_forward.w2.weight"}, %m1: tensor<32x16xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w1.weight"}, %m2: tensor<16x32xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w2.weight"}, %v1: tensor<32x16xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w1.weight"}, %v2: tensor<16x32xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w2.weight"}) {
    %0 = aten.op "aten._to_copy.default"(%g1) phase = "optim" args = {dtype = "torch.float32"} : (tensor<32x16xbf16>) -> tensor<32x16xf32>
    %1 = aten.op "aten._to_copy.default"(%g2) phase = "optim" args = {dtype = "torch.float32"} : (tensor<16x32xbf16>) -> tensor<16x32xf32>
    aten.op "aten._foreach_mul_.Scalar"(%p1, %p2) phase = "optim" args = {scalar = 9.999700e-01 : f64, list_sizes = [2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    aten.op "aten._foreach_lerp_.Scalar"(%m1, %m2, %0, %1) phase = "optim" args = {weight = 1.000000e-01 : f64, list_sizes = [2 : i64, 2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    aten.op "aten._foreach_mul_.Scalar"(%v1, %v2) phase = "optim" args = {scalar = 9.500000e-01 : f64, list_sizes = [2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    aten.op "aten._foreach_addcmul_.Scalar"(%v1, %v2, %0, %1, %0, %1) phase = "optim" args = {value = 5.000000e-02 : f64, list_sizes = [2 : i64, 2 : i64, 2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    %2, %3 = aten.op "aten._foreach_sqrt.default"(%v1, %v2) phase = "optim" args = {list_sizes = [2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>) -> (tensor<32x16xf32>, tensor<16x32xf32>)
    aten.op "aten._foreach_div_.ScalarList"(%2, %3) phase = "optim" args = {scalars = [3.122499e-01 : f64, 3.122499e-01 : f64], list_sizes = [2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    aten.op "aten._foreach_add_.Scalar"(%2, %3) phase = "optim" args = {scalar = 1.000000e-08 : f64, list_sizes = [2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    aten.op "aten._foreach_addcdiv_.ScalarList"(%p1, %p2, %m1, %m2, %2, %3) phase = "optim" args = {scalars = [-1.578947e-03 : f64, -1.578947e-03 : f64], list_sizes = [2 : i64, 2 : i64, 2 : i64]} : (tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<16x32xf32>, tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    aten.op "aten._foreach_copy_.default"(%w1, %w2, %p1, %p2) phase = "optim" args = {list_sizes = [2 : i64, 2 : i64]} : (tensor<32x16xbf16>, tensor<16x32xbf16>, tensor<32x16xf32>, tensor<16x32xf32>) -> ()
    func.return
  }
}
