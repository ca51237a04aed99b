// RUN: flint-opt %s --print-debuginfo | filecheck %s
// RUN: flint-opt %s --print-op-generic | filecheck %s --check-prefix=GENERIC
// RUN: flint-opt %s --print-op-generic --print-debuginfo | flint-opt --print-debuginfo | filecheck %s

// CHECK-LABEL: func.func @block
func.func @block(%a: tensor<8x16xbf16>, %b: tensor<16x32xbf16>) -> tensor<8x32xbf16> {
  // CHECK: %[[MM:.*]] = aten.op "aten.mm.default"(%{{.*}}, %{{.*}}) phase = "fwd" module = "layers.0.attn.wq" : (tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xbf16> loc("model.py":42:7)
  // GENERIC: "aten.op"(%{{.*}}, %{{.*}}) <{target = "aten.mm.default", phase = "fwd", module = "layers.0.attn.wq"}> : (tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xbf16>
  %0 = aten.op "aten.mm.default"(%a, %b) phase = "fwd" module = "layers.0.attn.wq" : (tensor<8x16xbf16>, tensor<16x32xbf16>) -> tensor<8x32xbf16> loc("model.py":42:7)
  // CHECK: aten.op "aten.sum.dim_IntList"(%[[MM]]) phase = "bwd" args = {dim = [1 : i64], keepdim = true} : (tensor<8x32xbf16>) -> tensor<8x1xbf16>
  // GENERIC: "aten.op"(%{{.*}}) <{target = "aten.sum.dim_IntList", phase = "bwd", args = {dim = [1 : i64], keepdim = true}}>
  %1 = aten.op "aten.sum.dim_IntList"(%0) phase = "bwd" args = {dim = [1 : i64], keepdim = true} : (tensor<8x32xbf16>) -> tensor<8x1xbf16>
  // CHECK: %{{.*}}, %{{.*}} = aten.op "aten.split.Tensor"(%[[MM]]) args = {split_size = 16 : i64} : (tensor<8x32xbf16>) -> (tensor<8x16xbf16>, tensor<8x16xbf16>)
  %2, %3 = aten.op "aten.split.Tensor"(%0) args = {split_size = 16 : i64} : (tensor<8x32xbf16>) -> (tensor<8x16xbf16>, tensor<8x16xbf16>)
  // CHECK: aten.op "aten._foreach_add_.Scalar"() phase = "optim" : () -> ()
  aten.op "aten._foreach_add_.Scalar"() phase = "optim" : () -> ()
  func.return %0 : tensor<8x32xbf16>
}
