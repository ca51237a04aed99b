// RUN: flint-opt %s -p overlap-report -o /dev/null 2>&1 | filecheck %s
// RUN: flint-opt %s -p 'overlap-report{device=a100-80gb network=switch}' -o /dev/null 2>&1 | filecheck %s --check-prefix=SWITCH
// RUN: flint-opt %s -p overlap-report | filecheck %s --check-prefix=SAME
// RUN: not flint-opt %s -p 'overlap-report{network=nope}' 2>&1 | filecheck %s --check-prefix=BAD

// The block runs 3 times per step: its figures count 3 times in the totals.
builtin.module attributes {flint.schedule = [["block", 3], ["tail", 1]]} {
  shard.grid @mesh(shape = 4x2)

  func.func @block(%x: tensor<8x64xbf16>, %w1s: tensor<16x64xbf16> {flint.role = "parameter"}, %w2s: tensor<64x16xbf16> {flint.role = "parameter"}) -> tensor<8x64xbf16> {
    %0 = dist.all_gather %w1s on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
    %w1 = dist.wait %0 : tensor<64x64xbf16>
    %1 = dist.all_gather %w2s on @mesh grid_axes = [0] gather_dim = 1 : tensor<64x16xbf16> -> !dist.future<tensor<64x64xbf16>>
    %h = aten.op "aten.mm.default"(%x, %w1) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    %a = aten.op "aten.relu.default"(%h) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %w2 = dist.wait %1 : tensor<64x64xbf16>
    %y = aten.op "aten.mm.default"(%a, %w2) phase = "fwd" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
    func.return %y : tensor<8x64xbf16>
  }

  func.func @tail(%y: tensor<8x64xbf16>) -> tensor<8x64xbf16> {
    %0 = dist.all_reduce %y on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>
    dist.send %0 to @mesh grid_axes = [0] offset = 1 tag = 0 : tensor<8x64xbf16>
    %r = dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 : tensor<8x64xbf16>
    func.return %r : tensor<8x64xbf16>
  }
}

// CHECK:      overlap-report: device h100-sxm, network dgx-h100
// CHECK-NEXT: @block (runs 3x per step)
// CHECK-NEXT: op  communication {{ +}} bytes  duration_us   compute_us   exposed_us
// The first gather is waited at once: nothing hides it.
// CHECK-NEXT: #0  all_gather axes [0] (n=4) {{ +}} 2048        6.655        0.000        6.655
// The second has the mm and the relu to hide behind: 8.559 us of kernels on an H100 (the 8x64x64 mm
// 5.559: the GEMM's fixed latency 5.11 us plus one tile; the relu the 3 us floor).
// CHECK-NEXT: #2  all_gather axes [0] (n=4) {{ +}} 2048        6.655        8.559        0.000
// CHECK-NEXT: @tail (runs 1x per step)
// CHECK-NEXT: op  communication
// CHECK-NEXT: #0  all_reduce axes [1] (n=2) {{ +}} 1024        5.609        0.000        5.609
// CHECK-NEXT: #1  send axis 0 offset 1 {{ +}} 1024
// CHECK-NEXT: #2  recv axis 0 offset -1 {{ +}} 1024
// CHECK-NEXT: per step: communication {{[0-9.]+}} us, hidden 19.964 us, exposed {{[0-9.]+}} us

// SWITCH:      overlap-report: device a100-80gb, network switch
// SWITCH:      #2  all_gather axes [0] (n=4) {{ +}} 2048        6.123        7.000        0.000

// The analysis leaves the module as it was.
// SAME:      func.func @block
// SAME-NEXT: dist.all_gather %w1s

// BAD: error: unknown network 'nope'

// The block holds two FSDP groups (w1, then w2): reorder-all-gather{prefetch=1} issues each one group
// ahead, as FSDP2 prefetches one module ahead. w2's gather is issued where w1's group starts (its
// mm): the mm and the relu hide it. The next iteration's w1 is issued where w2's group starts
// (flint.prefetch_at): only w2's mm (5.559 us) runs before the next iteration waits for it.
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=1},overlap-report' -o /dev/null 2>&1 | filecheck %s --check-prefix=PREFETCH
// PREFETCH: @block (runs 3x per step)
// PREFETCH-NEXT: op  communication
// PREFETCH-NEXT: #0  all_gather axes [0] (n=4) prefetch 1 {{ +}} 2048        6.655        5.559        1.096
// PREFETCH-NEXT: #2  all_gather axes [0] (n=4) {{ +}} 2048        6.655        8.559        0.000
// prefetch=2, a whole block ahead: each gather issued one iteration early where its group starts,
// one whole body of compute (14.118 us) hides each.
// RUN: flint-opt %s -p 'reorder-all-gather{prefetch=2},overlap-report' -o /dev/null 2>&1 | filecheck %s --check-prefix=PREFETCH2
// PREFETCH2: @block (runs 3x per step)
// PREFETCH2-NEXT: op  communication
// PREFETCH2-NEXT: #0  all_gather axes [0] (n=4) prefetch 1 {{ +}} 2048        6.655       14.118        0.000
// PREFETCH2-NEXT: #1  all_gather axes [0] (n=4) prefetch 1 {{ +}} 2048        6.655       14.118        0.000
