// RUN: flint-opt %s --split-input-file --verify-diagnostics | filecheck %s

chakra.graph @g {
  %0 = chakra.comp "x" flops = -1
}
// CHECK: ops_invalid.mlir:4:3: error: 'chakra.comp' op flops -1 must be non-negative

// -----
chakra.graph @g {
  %0 = chakra.comp "x" duration_us = -1.0
}
// CHECK: error: 'chakra.comp' op duration_us -1.0 must be non-negative

// -----
chakra.graph @g {
  %0 = chakra.coll all_reduce "ar" bytes = 8
}
// CHECK: error: 'chakra.coll' op needs either grid and grid_axes (SPMD) or group (concrete)

// -----
shard.grid @grid(shape = 2x4)
chakra.graph @g {
  %0 = chakra.coll all_reduce "ar" on @grid grid_axes = [3] bytes = 8
}
// CHECK: error: 'chakra.coll' op grid axis 3 out of range for rank-2 grid @grid

// -----
chakra.graph @g {
  %0 = chakra.coll all_reduce "ar" group = 1 bytes = -8
}
// CHECK: error: 'chakra.coll' op bytes -8 must be non-negative

// -----
shard.grid @grid(shape = 2x4)
chakra.graph @g {
  %0 = chakra.send "s" on @grid grid_axes = [0, 1] offset = 1 tag = 0 bytes = 8
}
// CHECK: error: 'chakra.send' op needs exactly one grid axis, got [0, 1]

// -----
chakra.graph @g {
  %0 = chakra.comp "x"
  %1 = chakra.repeat 0 (%0) {
  ^bb0(%a: !chakra.node):
    chakra.yield %a
  }
}
// CHECK: error: 'chakra.repeat' op count 0 out of range 1..10,000,000

// -----
chakra.graph @g {
  %0 = chakra.comp "x"
  %1 = chakra.repeat 2 (%0) {
  ^bb0(%a: !chakra.node):
    chakra.yield
  }
}
// CHECK: error: 'chakra.repeat' op body must end in 'chakra.yield' of 1 nodes

// -----
chakra.graph @g {
  %0 = chakra.comp "x"
  %1 = chakra.repeat 2 (%0) {
  ^bb0(%a: !chakra.node, %b: !chakra.node):
    chakra.yield %a
  }
}
// CHECK: error: 'chakra.repeat' op has 1 initial nodes, 2 block arguments and 1 results; all three must match

// -----
shard.grid @grid(shape = 2x4)
chakra.graph @g {
  %0 = chakra.recv "r" on @grid grid_axes = [1] offset = 1 peer = 2 tag = 0 bytes = 8
}
// CHECK: error: 'chakra.recv' op has both grid and grid_axes (SPMD) and peer (concrete)

// -----
chakra.graph @g {
  %0 = chakra.comp "x"
  %1 = chakra.repeat 1000000000 (%0) {
  ^bb0(%a: !chakra.node):
    chakra.yield %a
  }
}
// CHECK: error: 'chakra.repeat' op count 1,000,000,000 out of range 1..10,000,000

// -----
chakra.graph @g {
  %0 = chakra.comp "x" data(%0)
}
// CHECK: ops_invalid.mlir:{{[0-9]+}}:3: error: 'chakra.comp' op depends on itself: a dependency must name an earlier node (cycles cannot be expressed)

// -----
chakra.graph @g {
  %0 = chakra.send "s" peer = 1 tag = 2147483648 bytes = 8
}
// CHECK: error: 'chakra.send' op tag 2147483648 out of range: Chakra's comm_tag is an int32 (0..2147483647; -1: absent in an imported trace)
