// RUN: flint-opt %s -p assign-streams | filecheck %s
// RUN: flint-opt %s -p 'assign-streams{all-gather=fsdp all-reduce=tp}' | filecheck %s --check-prefix=NAMED
// RUN: flint-opt %s -p 'assign-streams,lower-to-chakra' | filecheck %s --check-prefix=LOWER
// RUN: flint-opt %s -p 'assign-streams{data-parallel=dp}' | filecheck %s --check-prefix=DP

builtin.module {
  shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard", "tp"]}
  func.func @f(%x: tensor<8x64xbf16>, %a: tensor<16x64xbf16> {flint.role = "parameter"}, %g: tensor<64x64xbf16>) -> (tensor<8x64xbf16>, tensor<32x64xbf16>) {
    %0 = dist.all_gather %a on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<32x64xbf16>>
    %1 = aten.op "aten.relu.default"(%x) phase = "fwd" : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    %2 = dist.all_reduce %1 on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>
    %3 = dist.reduce_scatter %g on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64x64xbf16> -> !dist.future<tensor<32x64xbf16>>
    %4 = dist.wait %0 : tensor<32x64xbf16>
    %5 = dist.wait %3 : tensor<32x64xbf16>
    func.return %2, %5 : tensor<8x64xbf16>, tensor<32x64xbf16>
  }
}

// FSDP2's streams by default; the TP all-reduce stays on the default stream.
// CHECK: dist.all_gather {{.*}}{stream = "all_gather"}
// CHECK: dist.all_reduce {{.*}}: tensor<8x64xbf16> -> tensor<8x64xbf16>
// CHECK: dist.reduce_scatter {{.*}}{stream = "reduce_scatter"}

// NAMED: dist.all_gather {{.*}}{stream = "fsdp"}
// NAMED: dist.all_reduce {{.*}}{stream = "tp"}
// NAMED: dist.reduce_scatter {{.*}}{stream = "reduce_scatter"}

// Lowered: each stream is its own chain; the reduce-scatter shares the gather's communicator
// (grid axis 0), so it still comes after the gather.
// LOWER: %[[AG:.*]] = chakra.coll all_gather "dist.all_gather" on @mesh grid_axes = [0] stream = "all_gather" bytes = 2048
// LOWER: %[[R:.*]] = chakra.comp "aten.relu.default"
// LOWER: chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [1] bytes = 1024 data(%[[R]]){{$}}
// LOWER: chakra.coll reduce_scatter "dist.reduce_scatter" on @mesh grid_axes = [0] stream = "reduce_scatter" bytes = 8192 ctrl(%[[AG]], %[[R]])

// data-parallel=dp: the collectives over the data-parallel axis (dp_shard, grid axis 0) go to stream "dp"
// whatever their kind; the TP all-reduce (axis 1) keeps its kind's stream (none).
// DP: dist.all_gather {{.*}}grid_axes = [0]{{.*}}{stream = "dp"}
// DP: dist.all_reduce %{{.*}} on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>{{$}}
// DP: dist.reduce_scatter {{.*}}grid_axes = [0]{{.*}}{stream = "dp"}
