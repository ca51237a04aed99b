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

// -----
func.func @f(%a: tensor<8x16xbf16>, %b: tensor<8x16xbf16>) {
  %0 = aten.op "aten.mm.default"(%a, %b) : (tensor<8x16xbf16>, tensor<8x16xbf16>) -> tensor<8x16xbf16>
  func.return
}
// CHECK: error: 'aten.op' op aten.mm.default inner dimensions differ: [8, 16] x [8, 16] (16 != 8)

// -----
func.func @f(%a: tensor<8x16xbf16>, %b: tensor<16x4xbf16>) {
  %0 = aten.op "aten.mm.default"(%a, %b) : (tensor<8x16xbf16>, tensor<16x4xbf16>) -> tensor<8x8xbf16>
  func.return
}
// CHECK: error: 'aten.op' op aten.mm.default result shape [8, 8] does not match [8, 4] for [8, 16] x [16, 4]

// -----
builtin.module attributes {flint.schedule = [["f", 1], ["g", 2]]} {
  func.func @f() {
    func.return
  }
}
// CHECK: error: module attribute flint.schedule names function @g, which the module lacks

// -----
builtin.module attributes {flint.schedule = []} {
  func.func @f() {
    func.return
  }
}
// CHECK: error: module attribute flint.schedule is empty: the step would run no function (drop the attribute to run every function once, in module order)
