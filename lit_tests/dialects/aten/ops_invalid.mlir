// RUN: flint-opt %s --split-input-file --verify-diagnostics | filecheck %s

func.func @f(%a: tensor<8x16xbf16>) {
  %0 = aten.op "mm"(%a) : (tensor<8x16xbf16>) -> tensor<8x16xbf16>
  func.return
}
// CHECK: ops_invalid.mlir:4:3: error: 'aten.op' op target "mm" is not an overload name of the form namespace.op.overload (e.g. "aten.mm.default")

// -----
func.func @f(%a: tensor<8x16xbf16>) {
  %0 = aten.op "aten.relu.default"(%a) phase = "forward" : (tensor<8x16xbf16>) -> tensor<8x16xbf16>
  func.return
}
// CHECK: ops_invalid.mlir:11:3: error: 'aten.op' op phase "forward" is not one of fwd, bwd, optim
