// RUN: flint-opt %s | filecheck %s
// RUN: flint-opt %s --print-op-generic | filecheck %s --check-prefix=GENERIC
// RUN: flint-opt %s --print-op-generic | flint-opt | filecheck %s

shard.grid @grid(shape = 2x4)

// CHECK-LABEL: chakra.graph @step {
chakra.graph @step {
  // CHECK: %[[C:.*]] = chakra.comp "aten.mm.default" flops = 1024 bytes = 512 duration_us = 1.500000e+00
  // GENERIC: "chakra.comp"() <{node_name = "aten.mm.default", flops = 1024 : i64, bytes = 512 : i64, duration_us = 1.500000e+00 : f64, operandSegmentSizes = array<i32: 0, 0>}> : () -> !chakra.node
  %0 = chakra.comp "aten.mm.default" flops = 1024 bytes = 512 duration_us = 1.5
  // CHECK: %[[AG:.*]] = chakra.coll all_gather "ag" on @grid grid_axes = [0] bytes = 4096 data(%[[C]])
  // GENERIC: "chakra.coll"(%{{.*}}) <{kind = #chakra<coll_kind all_gather>, node_name = "ag", grid = @grid, grid_axes = array<i16: 0>, bytes = 4096 : i64, operandSegmentSizes = array<i32: 1, 0>}> : (!chakra.node) -> !chakra.node
  %1 = chakra.coll all_gather "ag" on @grid grid_axes = [0] bytes = 4096 data(%0)
  // CHECK: %[[R:.*]] = chakra.repeat 3 (%[[AG]]) {
  // CHECK-NEXT: ^{{.*}}(%[[A:.*]]: !chakra.node):
  // CHECK-NEXT: %[[X:.*]] = chakra.comp "x" data(%[[A]]) ctrl(%[[A]])
  // CHECK-NEXT: chakra.yield %[[X]]
  // GENERIC: "chakra.repeat"(%{{.*}}) <{count = 3 : i64}> ({
  // GENERIC: "chakra.yield"(%{{.*}}) : (!chakra.node) -> ()
  %2 = chakra.repeat 3 (%1) {
  ^bb0(%a: !chakra.node):
    %3 = chakra.comp "x" data(%a) ctrl(%a)
    chakra.yield %3
  }
  // CHECK: chakra.send "s" on @grid grid_axes = [1] offset = 1 tag = 7 bytes = 64 data(%[[R]])
  // GENERIC: "chakra.send"(%{{.*}}) <{node_name = "s", grid = @grid, grid_axes = array<i16: 1>, offset = 1 : i64, tag = 7 : i64, bytes = 64 : i64, operandSegmentSizes = array<i32: 1, 0>}>
  %4 = chakra.send "s" on @grid grid_axes = [1] offset = 1 tag = 7 bytes = 64 data(%2)
  // CHECK: chakra.recv "r" on @grid grid_axes = [1] offset = -1 tag = 7 bytes = 64 duration_us = 2.000000e+00
  %5 = chakra.recv "r" on @grid grid_axes = [1] offset = -1 tag = 7 bytes = 64 duration_us = 2.0
  // CHECK: chakra.recv "r2" peer = 3 tag = 7 bytes = 64
  // GENERIC: "chakra.recv"() <{node_name = "r2", peer = 3 : i64, tag = 7 : i64, bytes = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}>
  %6 = chakra.recv "r2" peer = 3 tag = 7 bytes = 64
  // CHECK: chakra.send "s2" on @grid grid_axes = [1] offset = 1 stream = "ch1" tag = 8 bytes = 64
  %8 = chakra.send "s2" on @grid grid_axes = [1] offset = 1 stream = "ch1" tag = 8 bytes = 64
  // CHECK: chakra.coll all_reduce "ar" group = 2 bytes = 8 ctrl(%[[C]])
  %7 = chakra.coll all_reduce "ar" group = 2 bytes = 8 ctrl(%0)
}
