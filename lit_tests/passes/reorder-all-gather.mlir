// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=1}' | filecheck %s --check-prefix=K1
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=2}' | filecheck %s --check-prefix=K2
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=0}' | filecheck %s --check-prefix=K0
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=0 delay=true}' | filecheck %s --check-prefix=DELAY
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=1},lower-to-chakra' | filecheck %s --check-prefix=LOWER
// RUN: not flint-opt %s -p 'reorder-all-gather{prefetch=-1}' 2>&1 | filecheck %s --check-prefix=NEG
// RUN: not flint-opt %s -p 'reorder-all-gather{prefetch=1 delay=true}' 2>&1 | filecheck %s --check-prefix=BADDELAY

// An FSDP block: the copy-in (view + cat of the parameter shards), the all-gather, its wait,
// the copy-out view, then the compute. The block runs 4 times; the embedding before it once.
builtin.module attributes {flint.schedule = [["embed", 1], ["block", 4]]} {
  shard.grid @mesh(shape = 4)

  func.func @embed(%x: tensor<8x64xbf16> {flint.role = "input"}, %w: tensor<64x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.mm.default"(%x, %w) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %0 : tensor<8x64xbf16>
  }

  func.func @block(%h: tensor<8x64xbf16> {flint.role = "activation"}, %wa: tensor<16x64xbf16> {flint.role = "parameter"}, %wb: tensor<16x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.relu.default"(%h) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %1 = aten.op "aten.view.default"(%wa) phase = "fwd" args = {size = [-1]} : (tensor<16x64xbf16>) -> tensor<1024xbf16>
    %2 = aten.op "aten.view.default"(%wb) phase = "fwd" args = {size = [-1]} : (tensor<16x64xbf16>) -> tensor<1024xbf16>
    %3 = aten.op "aten.cat.default"(%1, %2) phase = "fwd" : (tensor<1024xbf16>, tensor<1024xbf16>) -> tensor<2048xbf16>
    %4 = dist.all_gather %3 on @mesh grid_axes = [0] gather_dim = 0 : tensor<2048xbf16> -> !dist.future<tensor<8192xbf16>>
    %5 = dist.wait %4 : tensor<8192xbf16>
    %6 = aten.op "aten.view.default"(%5) phase = "fwd" args = {size = [128, 64]} : (tensor<8192xbf16>) -> tensor<128x64xbf16>
    %7 = aten.op "aten.slice.Tensor"(%6) phase = "fwd" args = {dim = 0, start = 0, end = 64} : (tensor<128x64xbf16>) -> tensor<64x64xbf16>
    %8 = aten.op "aten.mm.default"(%0, %7) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %8 : tensor<8x64xbf16>
  }
}

// The copy-in and the gather move to the top of the block, marked one block ahead; the wait stays.
// K1: func.func @block
// K1-NEXT: aten.op "aten.view.default"(%wa) {{.*}}{flint.prefetch = 1 : i64}
// K1-NEXT: aten.op "aten.view.default"(%wb) {{.*}}{flint.prefetch = 1 : i64}
// K1-NEXT: aten.op "aten.cat.default"{{.*}}{flint.prefetch = 1 : i64}
// K1-NEXT: %[[AG:.*]] = dist.all_gather {{.*}}{flint.prefetch = 1 : i64}
// K1-NEXT: aten.op "aten.relu.default"
// K1-NEXT: dist.wait %[[AG]]
// The embedding runs once: nothing to reach ahead of, nothing marked there.
// K1-NOT: flint.prefetch

// K2: %[[AG:.*]] = dist.all_gather {{.*}}{flint.prefetch = 2 : i64}
// K2-NEXT: aten.op "aten.relu.default"
// K2-NEXT: dist.wait %[[AG]]

// prefetch=0: to the top of the block, unmarked.
// K0: func.func @block
// K0-NEXT: aten.op "aten.view.default"(%wa)
// K0-NEXT: aten.op "aten.view.default"(%wb)
// K0-NEXT: aten.op "aten.cat.default"
// K0-NEXT: %[[AG:.*]] = dist.all_gather
// K0-NEXT: aten.op "aten.relu.default"
// K0-NEXT: dist.wait %[[AG]]
// K0-NOT: flint.prefetch

// delay: the copy-in, the gather and its wait right before the first use of the gathered value.
// DELAY: func.func @block
// DELAY-NEXT: aten.op "aten.relu.default"
// DELAY-NEXT: aten.op "aten.view.default"(%wa)
// DELAY-NEXT: aten.op "aten.view.default"(%wb)
// DELAY-NEXT: aten.op "aten.cat.default"
// DELAY-NEXT: %[[AG:.*]] = dist.all_gather
// DELAY-NEXT: %[[W:.*]] = dist.wait %[[AG]]
// DELAY-NEXT: aten.op "aten.view.default"(%[[W]])

// Lowered: block 0's copy-in and gather are issued at the start of the embedding (the prologue),
// the repeat runs 3 steady iterations carrying one slot (the gather issued one block earlier),
// then one tail iteration that issues nothing.
// LOWER: chakra.graph @step {
// LOWER-NEXT: %[[PC:.*]] = chakra.comp "aten.cat.default"
// LOWER-NEXT: %[[PG:.*]] = chakra.coll all_gather "dist.all_gather" {{.*}} data(%[[PC]])
// LOWER: chakra.comp "aten.mm.default"
// LOWER: chakra.repeat 3 ({{.*}}, %[[PG]]) {
// LOWER-NEXT: ^{{.*}}(%[[C:.*]]: !chakra.node, %{{.*}}: !chakra.node, %{{.*}}: !chakra.node, %[[SLOT:.*]]: !chakra.node):
// LOWER-NEXT: chakra.comp "aten.cat.default"
// LOWER-NEXT: %[[G:.*]] = chakra.coll all_gather
// The block's matmul reads the gather issued one block earlier (the slot), not this one.
// LOWER: chakra.comp "aten.mm.default" {{.*}}data(%{{.*}}, %[[SLOT]])
// LOWER-NEXT: chakra.yield {{.*}}, %[[G]]{{$}}
// LOWER: chakra.repeat 1
// LOWER-NOT: all_gather
// LOWER: chakra.yield

// NEG: error: reorder-all-gather: option prefetch=-1 must be >= 0
// BADDELAY: error: reorder-all-gather: option delay=true needs prefetch=0
