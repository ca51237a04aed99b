// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=1},shard-expand' | filecheck %s --check-prefix=Z1
// RUN: flint-opt %s -p 'shard-annotate{dp_shard=2 zero=3},shard-expand' | filecheck %s --check-prefix=Z3
// fp32 master parameters (plan field master_dtype; Megatron's mixed-precision optimizer) under the ZeRO stages
// of dp_shard: the bf16 MLP block of shard-expand-zero.mlir whose AdamW step updates fp32 masters (role
// "master") with fp32 state and the gradients cast to fp32, then copies them into the bf16 parameters.
// The masters are sharded as the Adam state is:
//   ZeRO-1: whole bf16 parameters and gradients; each rank steps its shard of the masters, copies it into
//           its shard of the parameter, and the updated bf16 shards are all-gathered back.
//   ZeRO-3: parameters, gradients, masters and state all sharded; the step has no collective.

// Z1:      func.func @block_optim(%w1: tensor<32x16xbf16> {{.*}}, %w2: tensor<16x32xbf16> {{.*}}, %g1: tensor<32x16xbf16> {{.*}}, %g2: tensor<16x32xbf16> {{.*}}, %p1: tensor<16x16xf32> {{.*}}, %p2: tensor<8x32xf32> {{.*}}, %m1: tensor<16x16xf32> {{.*}}, %m2: tensor<8x32xf32> {{.*}}, %v1: tensor<16x16xf32> {{.*}}, %v2: tensor<8x32xf32>
// Z1:      %[[W1:.*]] = aten.op "aten.slice.Tensor"(%w1) args = {dim = 0 : i64, start = 0 : i64, end = 16 : i64}
// Z1:      %[[G1:.*]] = aten.op "aten.slice.Tensor"(%g1)
// Z1:      aten.op "aten._to_copy.default"(%[[G1]]) phase = "optim" args = {dtype = "torch.float32"} : (tensor<16x16xbf16>) -> tensor<16x16xf32>
// Z1:      %[[U1:.*]] = aten.op "aten.addcdiv_.default"{{.*}} -> tensor<16x16xf32>
// Z1:      aten.op "aten.copy_.default"(%[[W1]], %[[U1]]) phase = "optim" : (tensor<16x16xbf16>, tensor<16x16xf32>) -> tensor<16x16xbf16>
// Z1:      aten.op "aten.copy_.default"({{.*}}) phase = "optim" : (tensor<8x32xbf16>, tensor<8x32xf32>) -> tensor<8x32xbf16>
// Z1:      dist.all_gather %{{.*}} on @mesh grid_axes = [0] gather_dim = 0 : tensor<512xbf16> -> !dist.future<tensor<1024xbf16>>
// Z1:      aten.op "aten.copy_.default"(%w1, %{{.*}}) : (tensor<32x16xbf16>, tensor<32x16xbf16>)
// Z1:      aten.op "aten.copy_.default"(%w2, %{{.*}}) : (tensor<16x32xbf16>, tensor<16x32xbf16>)

// Z3:      func.func @block_optim(%w1: tensor<16x16xbf16> {{.*}}, %w2: tensor<8x32xbf16> {{.*}}, %g1: tensor<16x16xbf16> {{.*}}, %g2: tensor<8x32xbf16> {{.*}}, %p1: tensor<16x16xf32> {{.*}}, %p2: tensor<8x32xf32> {{.*}}, %m1: tensor<16x16xf32> {{.*}}, %m2: tensor<8x32xf32> {{.*}}, %v1: tensor<16x16xf32> {{.*}}, %v2: tensor<8x32xf32>
// Z3:      aten.op "aten.copy_.default"(%w1, %{{.*}}) phase = "optim" : (tensor<16x16xbf16>, tensor<16x16xf32>) -> tensor<16x16xbf16>
// Z3:      aten.op "aten.copy_.default"(%w2, %{{.*}}) phase = "optim" : (tensor<8x32xbf16>, tensor<8x32xf32>) -> tensor<8x32xbf16>
// Z3-NOT:  {{= dist\.(all|reduce)}}

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
  func.func @block_optim(%w1: tensor<32x16xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w1.weight"}, %w2: tensor<16x32xbf16> {flint.role = "parameter", flint.param = "layers.0.feed_forward.w2.weight"}, %g1: tensor<32x16xbf16> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w1.weight"}, %g2: tensor<16x32xbf16> {flint.role = "gradient", flint.param = "layers.0.feed_forward.w2.weight"}, %p1: tensor<32x16xf32> {flint.role = "master", flint.param = "layers.0.feed_forward.w1.weight"}, %p2: tensor<16x32xf32> {flint.role = "master", flint.param = "layers.0.feed_forward.w2.weight"}, %m1: tensor<32x16xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w1.weight"}, %m2: tensor<16x32xf32> {flint.role = "exp_avg", flint.param = "layers.0.feed_forward.w2.weight"}, %v1: tensor<32x16xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w1.weight"}, %v2: tensor<16x32xf32> {flint.role = "exp_avg_sq", flint.param = "layers.0.feed_forward.w2.weight"}, %step: tensor<f32> {flint.role = "step"}) {
    %0 = aten.op "aten._to_copy.default"(%g1) phase = "optim" args = {dtype = "torch.float32"} : (tensor<32x16xbf16>) -> tensor<32x16xf32>
    %1 = aten.op "aten.mul_.Tensor"(%p1) phase = "optim" args = {other = 9.999700e-01 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %2 = aten.op "aten.lerp_.Scalar"(%m1, %0) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %3 = aten.op "aten.mul_.Tensor"(%v1) phase = "optim" args = {other = 9.500000e-01 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %4 = aten.op "aten.addcmul_.default"(%3, %0, %0) phase = "optim" args = {value = 5.000000e-02 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %5 = aten.op "aten.sqrt.default"(%4) phase = "optim" : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %6 = aten.op "aten.add_.Tensor"(%5) phase = "optim" args = {other = 1.000000e-08 : f64} : (tensor<32x16xf32>) -> tensor<32x16xf32>
    %7 = aten.op "aten.addcdiv_.default"(%1, %2, %6) phase = "optim" args = {value = -3.000000e-04 : f64} : (tensor<32x16xf32>, tensor<32x16xf32>, tensor<32x16xf32>) -> tensor<32x16xf32>
    %8 = aten.op "aten.copy_.default"(%w1, %7) phase = "optim" : (tensor<32x16xbf16>, tensor<32x16xf32>) -> tensor<32x16xbf16>
    %20 = aten.op "aten._to_copy.default"(%g2) phase = "optim" args = {dtype = "torch.float32"} : (tensor<16x32xbf16>) -> tensor<16x32xf32>
    %21 = aten.op "aten.mul_.Tensor"(%p2) phase = "optim" args = {other = 9.999700e-01 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %22 = aten.op "aten.lerp_.Scalar"(%m2, %20) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %23 = aten.op "aten.mul_.Tensor"(%v2) phase = "optim" args = {other = 9.500000e-01 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %24 = aten.op "aten.addcmul_.default"(%23, %20, %20) phase = "optim" args = {value = 5.000000e-02 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %25 = aten.op "aten.sqrt.default"(%24) phase = "optim" : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %26 = aten.op "aten.add_.Tensor"(%25) phase = "optim" args = {other = 1.000000e-08 : f64} : (tensor<16x32xf32>) -> tensor<16x32xf32>
    %27 = aten.op "aten.addcdiv_.default"(%21, %22, %26) phase = "optim" args = {value = -3.000000e-04 : f64} : (tensor<16x32xf32>, tensor<16x32xf32>, tensor<16x32xf32>) -> tensor<16x32xf32>
    %28 = aten.op "aten.copy_.default"(%w2, %27) phase = "optim" : (tensor<16x32xbf16>, tensor<16x32xf32>) -> tensor<16x32xbf16>
    func.return
  }
}
