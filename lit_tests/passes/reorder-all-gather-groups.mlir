// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=1}' | filecheck %s --check-prefix=K1
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=2}' | filecheck %s --check-prefix=K2
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=3}' | filecheck %s --check-prefix=K3
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=1},lower-to-chakra' | filecheck %s --check-prefix=LOWER

// A block of two FSDP groups (two layers, A then B: Llama 4's pattern, or selective-layer every 2nd
// block), each gathered, waited for, copied out (a view) and used. It runs 4 times. `prefetch` counts
// groups, as FSDP2 prefetches one module ahead: a group's gather is issued when the group `prefetch`
// before it starts, counting across iterations.
builtin.module attributes {flint.schedule = [["embed", 1], ["block", 4]]} {
  shard.grid @mesh(shape = 4)

  func.func @embed(%x: tensor<8x64xbf16> {flint.role = "input"}, %w: tensor<64x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.mm.default"(%x, %w) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %0 : tensor<8x64xbf16>
  }

  func.func @block(%h: tensor<8x64xbf16> {flint.role = "activation"}, %wa: tensor<16x64xbf16> {flint.role = "parameter"}, %wb: tensor<16x64xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = aten.op "aten.view.default"(%wa) phase = "fwd" args = {size = [-1]} : (tensor<16x64xbf16>) -> tensor<1024xbf16>
    %1 = dist.all_gather %0 on @mesh grid_axes = [0] gather_dim = 0 : tensor<1024xbf16> -> !dist.future<tensor<4096xbf16>>
    %2 = dist.wait %1 : tensor<4096xbf16>
    %3 = aten.op "aten.view.default"(%wb) phase = "fwd" args = {size = [-1]} : (tensor<16x64xbf16>) -> tensor<1024xbf16>
    %4 = dist.all_gather %3 on @mesh grid_axes = [0] gather_dim = 0 : tensor<1024xbf16> -> !dist.future<tensor<4096xbf16>>
    %5 = dist.wait %4 : tensor<4096xbf16>
    %6 = aten.op "aten.view.default"(%2) phase = "fwd" args = {size = [64, 64]} : (tensor<4096xbf16>) -> tensor<64x64xbf16>
    %7 = aten.op "aten.mm.default"(%h, %6) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %8 = aten.op "aten.view.default"(%5) phase = "fwd" args = {size = [64, 64]} : (tensor<4096xbf16>) -> tensor<64x64xbf16>
    %9 = aten.op "aten.mm.default"(%7, %8) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %9 : tensor<8x64xbf16>
  }
}

// prefetch=1: B is gathered when A starts (right before A's first use, after A's wait and copy-out);
// the next iteration's A when B starts: at the top, marked one iteration ahead, its issue point named
// on B's first use.
// K1: func.func @block
// K1-NEXT: aten.op "aten.view.default"(%wa) {{.*}}{flint.prefetch = 1 : i64, flint.prefetch_at = "group0"}
// K1-NEXT: %[[AGA:.*]] = dist.all_gather {{.*}}{flint.prefetch = 1 : i64, flint.prefetch_at = "group0"}
// K1-NEXT: %[[WA:.*]] = dist.wait %[[AGA]]
// K1-NEXT: %[[VA:.*]] = aten.op "aten.view.default"(%[[WA]])
// K1-NEXT: aten.op "aten.view.default"(%wb)
// K1-NOT: flint.prefetch
// K1-NEXT: %[[AGB:.*]] = dist.all_gather
// K1-NOT: flint.prefetch
// K1-NEXT: %[[MA:.*]] = aten.op "aten.mm.default"(%h, %[[VA]])
// K1-NEXT: %[[WB:.*]] = dist.wait %[[AGB]]
// K1-NEXT: %[[VB:.*]] = aten.op "aten.view.default"(%[[WB]])
// K1-NEXT: aten.op "aten.mm.default"(%[[MA]], %[[VB]]) phase = "fwd" {flint.prefetch_point = "group0"}
// The embedding runs once: nothing to reach ahead of, nothing marked there.
// K1-NOT: flint.prefetch

// prefetch=2 (a whole block): each group one iteration ahead, issued where it starts: A at the top,
// B at B's first use.
// K2: func.func @block
// K2-NEXT: aten.op "aten.view.default"(%wa) {{.*}}{flint.prefetch = 1 : i64}
// K2-NEXT: dist.all_gather {{.*}}{flint.prefetch = 1 : i64}
// K2-NEXT: aten.op "aten.view.default"(%wb) {{.*}}{flint.prefetch = 1 : i64, flint.prefetch_at = "group1"}
// K2-NEXT: dist.all_gather {{.*}}{flint.prefetch = 1 : i64, flint.prefetch_at = "group1"}
// K2: aten.op "aten.mm.default"({{.*}}) phase = "fwd" {flint.prefetch_point = "group1"}

// prefetch=3 is not a whole number of blocks for every group (one flint.prefetch per function):
// both groups two iterations ahead, from the top.
// K3: func.func @block
// K3-NEXT: aten.op "aten.view.default"(%wa) {{.*}}{flint.prefetch = 2 : i64}
// K3-NEXT: dist.all_gather {{.*}}{flint.prefetch = 2 : i64}
// K3-NEXT: aten.op "aten.view.default"(%wb) {{.*}}{flint.prefetch = 2 : i64}
// K3-NEXT: dist.all_gather {{.*}}{flint.prefetch = 2 : i64}
// K3-NOT: flint.prefetch_at

// Lowered: iteration 0's A is gathered in the prologue (the embedding's start); each steady iteration
// gathers its own B first, then A's matmul reads the A gathered one iteration earlier (the slot), then
// the next iteration's A is issued after that matmul, where B starts; the tail issues no A.
// LOWER: chakra.graph @step {
// LOWER-NEXT: %[[PG:.*]] = chakra.coll all_gather
// LOWER: chakra.repeat 3 ({{.*}}, %[[PG]]) {
// LOWER-NEXT: ^{{.*}}(%{{.*}}: !chakra.node, %{{.*}}: !chakra.node, %[[SLOT:.*]]: !chakra.node):
// LOWER-NEXT: %[[GB:.*]] = chakra.coll all_gather
// LOWER-NEXT: %[[MA:.*]] = chakra.comp "aten.mm.default" {{.*}}data(%[[SLOT]])
// LOWER-NEXT: %[[NEXT:.*]] = chakra.coll all_gather {{.*}}ctrl(%[[GB]], %[[MA]])
// LOWER-NEXT: chakra.comp "aten.mm.default" {{.*}}data(%[[MA]], %[[GB]])
// LOWER-NEXT: chakra.yield %[[NEXT]], %[[NEXT]], %[[NEXT]]
// LOWER: chakra.repeat 1
// LOWER-NEXT: ^{{.*}}(%{{.*}}: !chakra.node, %{{.*}}: !chakra.node, %[[TSLOT:.*]]: !chakra.node):
// LOWER-NEXT: %[[TB:.*]] = chakra.coll all_gather
// LOWER-NEXT: chakra.comp "aten.mm.default" {{.*}}data(%[[TSLOT]])
// LOWER-NEXT: chakra.comp "aten.mm.default"
// LOWER-NEXT: chakra.yield
