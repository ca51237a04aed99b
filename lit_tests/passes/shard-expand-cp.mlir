// RUN: flint-opt %s -p 'shard-annotate{cp=2},shard-expand,verify-p2p' | filecheck %s --check-prefix=CP
// RUN: flint-opt %s -p 'shard-annotate{cp=2 dp_shard=2},shard-expand,verify-p2p' | filecheck %s --check-prefix=CPFSDP
// RUN: flint-opt %s -p 'shard-annotate{cp=2 tp=2},shard-expand,verify-p2p' | filecheck %s --check-prefix=CPTP
// RUN: not flint-opt %s -p 'shard-annotate{cp=8},shard-expand' 2>&1 | filecheck %s --check-prefix=BADCP
// Context parallelism: a one-projection causal attention block (2 heads of 8, sequence 8), forward and
// backward on one device, expanded with the sequence split over `cp` as PyTorch's context_parallel runs it
// (flint/sharding/cp.py): the local K/V all-gathered once (ALL_GATHER rotator), a causal call on the local
// chunk then cp-1 unmasked calls on half of each remote K/V (head-tail load balance), merged with the
// logsumexp update; backward gathers K/V again and passes the float32 K/V gradient round the ring with
// send/recv (one hop per step). FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp).

// A block without token inputs: the sequence the attention sees (8) must split into 2*cp load-balanced chunks.
// BADCP: error: plan field 'cp': sequence length 8 is not divisible by 16

// CP:      shard.grid @mesh(shape = 2) {flint.axis_names = ["cp"]}
// CP:      func.func @block_fwd(%x: tensor<2x4x16xf32> {{.*}}, %wq: tensor<8x16xf32> {{.*}}, %wo: tensor<8x16xf32>
// CP:      dist.all_gather %{{.*}} grid_axes = [0] gather_dim = 0 : tensor<256xf32> -> !dist.future<tensor<512xf32>>
// CP:      %[[KV:.*]] = aten.op "aten.cat.default"(%{{.*}}, %{{.*}}) phase = "fwd" module = "attention" {{.*}} -> tensor<256xf32>
// CP-NEXT: dist.all_gather %[[KV]] on @mesh grid_axes = [0] gather_dim = 0 : tensor<256xf32> -> !dist.future<tensor<512xf32>>
// CP:      "aten._scaled_dot_product_flash_attention_for_cpu.default"{{.*}}is_causal = true} : (tensor<2x2x4x8xf32>, tensor<2x2x4x8xf32>, tensor<2x2x4x8xf32>)
// CP:      "aten._scaled_dot_product_flash_attention_for_cpu.default"{{.*}}is_causal = false} : (tensor<2x2x4x8xf32>, tensor<2x2x2x8xf32>, tensor<2x2x2x8xf32>)
// CP:      aten.sigmoid.default
// CP:      aten.log_sigmoid_forward.default
// CP-NOT:  {{= dist\.(all|reduce|send|recv)}}
// CP:      func.func @block_bwd
// CP:      dist.all_gather %{{.*}} tensor<256xf32> -> !dist.future<tensor<512xf32>>
// CP:      dist.all_gather %{{.*}} tensor<256xf32> -> !dist.future<tensor<512xf32>>
// CP:      "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"{{.*}}is_causal = true}
// CP:      dist.send %{{.*}} to @mesh grid_axes = [0] offset = 1 tag = 0 : tensor<256xf32> -> !dist.future<none>
// CP-NEXT: dist.recv from @mesh grid_axes = [0] offset = -1 tag = 0 : !dist.future<tensor<256xf32>>
// CP:      "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"{{.*}}is_causal = false} : (tensor<2x2x4x8xf32>, tensor<2x2x4x8xf32>, tensor<2x2x2x8xf32>, tensor<2x2x2x8xf32>
// CP:      dist.send %{{.*}} offset = 1 tag = 1 : tensor<256xf32>
// CP-NEXT: dist.recv {{.*}} offset = -1 tag = 1
// CP:      dist.reduce_scatter %{{.*}} grid_axes = [0] scatter_dim = 0 : tensor<512xf32> -> !dist.future<tensor<256xf32>>
// CP-NOT:  {{= dist\.(all|reduce|send|recv)}}

// CPFSDP:      shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard", "cp"]}
// CPFSDP:      func.func @block_fwd(%x: tensor<1x4x16xf32> {{.*}}, %wq: tensor<4x16xf32>
// CPFSDP:      dist.all_gather %{{.*}} grid_axes = [0, 1] gather_dim = 0 : tensor<128xf32> -> !dist.future<tensor<512xf32>>
// CPFSDP:      dist.all_gather %{{.*}} grid_axes = [1] gather_dim = 0 : tensor<128xf32> -> !dist.future<tensor<256xf32>>
// CPFSDP:      func.func @block_bwd
// CPFSDP:      dist.send %{{.*}} grid_axes = [1] offset = 1 tag = 0 : tensor<128xf32>
// CPFSDP:      dist.send %{{.*}} grid_axes = [1] offset = 1 tag = 1 : tensor<128xf32>
// CPFSDP:      dist.reduce_scatter %{{.*}} grid_axes = [0, 1] scatter_dim = 0 : tensor<512xf32> -> !dist.future<tensor<128xf32>>

// CPTP:      shard.grid @mesh(shape = 2x2) {flint.axis_names = ["cp", "tp"]}
// CPTP:      func.func @block_fwd(%x: tensor<2x4x16xf32> {{.*}}, %wq: tensor<4x16xf32> {{.*}}, %wo: tensor<8x8xf32>
// CPTP:      "aten._scaled_dot_product_flash_attention_for_cpu.default"{{.*}}is_causal = true} : (tensor<2x1x4x8xf32>
// CPTP:      dist.all_reduce %{{.*}} grid_axes = [1] : tensor<2x4x16xf32>
// CPTP:      func.func @block_bwd
// CPTP:      dist.send %{{.*}} grid_axes = [0] offset = 1 tag = 0 : tensor<128xf32>
// CPTP:      dist.all_reduce %{{.*}} grid_axes = [1] : tensor<2x4x16xf32>
// CPTP:      dist.reduce_scatter %{{.*}} grid_axes = [0] scatter_dim = 0 : tensor<256xf32> -> !dist.future<tensor<128xf32>>

builtin.module attributes {flint.schedule = [["block_fwd", 2 : i64], ["block_bwd", 2 : i64]]} {
  shard.grid @mesh(shape = 1) {flint.axis_names = ["dp_shard"]}
  func.func @block_fwd(%x: tensor<2x8x16xf32> {flint.role = "activation"}, %wq: tensor<16x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wq.weight"}, %wo: tensor<16x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wo.weight"}) -> (tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8xf32>, tensor<16x16xf32>) {
    %0 = aten.op "aten.t.default"(%wq) phase = "fwd" module = "attention.wq" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %1 = aten.op "aten.view.default"(%x) phase = "fwd" module = "attention.wq" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x16xf32>) -> tensor<16x16xf32>
    %2 = aten.op "aten.mm.default"(%1, %0) phase = "fwd" module = "attention.wq" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %3 = aten.op "aten.view.default"(%2) phase = "fwd" module = "attention" args = {size = [2 : i64, 8 : i64, 2 : i64, 8 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x2x8xf32>
    %4 = aten.op "aten.transpose.int"(%3) phase = "fwd" module = "attention" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x8x2x8xf32>) -> tensor<2x2x8x8xf32>
    %5, %6 = aten.op "aten._scaled_dot_product_flash_attention_for_cpu.default"(%4, %4, %4) phase = "fwd" module = "attention" args = {dropout_p = 0.000000e+00 : f64, is_causal = true} : (tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>) -> (tensor<2x2x8x8xf32>, tensor<2x2x8xf32>)
    %7 = aten.op "aten.transpose.int"(%5) phase = "fwd" module = "attention" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x2x8x8xf32>) -> tensor<2x8x2x8xf32>
    %8 = aten.op "aten.view.default"(%7) phase = "fwd" module = "attention.wo" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x2x8xf32>) -> tensor<16x16xf32>
    %9 = aten.op "aten.t.default"(%wo) phase = "fwd" module = "attention.wo" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %10 = aten.op "aten.mm.default"(%8, %9) phase = "fwd" module = "attention.wo" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %11 = aten.op "aten.view.default"(%10) phase = "fwd" module = "attention.wo" args = {size = [2 : i64, 8 : i64, 16 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x16xf32>
    %12 = aten.op "aten.add.Tensor"(%x, %11) phase = "fwd" : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
    func.return %12, %x, %wq, %wo, %1, %4, %5, %6, %8 : tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8xf32>, tensor<16x16xf32>
  }
  func.func @block_bwd(%x: tensor<2x8x16xf32> {flint.role = "activation"}, %wq: tensor<16x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wq.weight"}, %wo: tensor<16x16xf32> {flint.role = "parameter", flint.param = "layers.0.attention.wo.weight"}, %xv: tensor<16x16xf32> {flint.role = "saved"}, %q: tensor<2x2x8x8xf32> {flint.role = "saved"}, %out: tensor<2x2x8x8xf32> {flint.role = "saved"}, %lse: tensor<2x2x8xf32> {flint.role = "saved"}, %a: tensor<16x16xf32> {flint.role = "saved"}, %g: tensor<2x8x16xf32> {flint.role = "tangent"}) -> (tensor<2x8x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>) {
    %0 = aten.op "aten.view.default"(%g) phase = "bwd" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x16xf32>) -> tensor<16x16xf32>
    %1 = aten.op "aten.t.default"(%0) phase = "bwd" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %2 = aten.op "aten.mm.default"(%1, %a) phase = "bwd" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %3 = aten.op "aten.t.default"(%wo) phase = "bwd" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %4 = aten.op "aten.t.default"(%3) phase = "bwd" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %5 = aten.op "aten.mm.default"(%0, %4) phase = "bwd" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %6 = aten.op "aten.view.default"(%5) phase = "bwd" args = {size = [2 : i64, 8 : i64, 2 : i64, 8 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x2x8xf32>
    %7 = aten.op "aten.transpose.int"(%6) phase = "bwd" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x8x2x8xf32>) -> tensor<2x2x8x8xf32>
    %8, %9, %10 = aten.op "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"(%7, %q, %q, %q, %out, %lse) phase = "bwd" module = "attention" args = {dropout_p = 0.000000e+00 : f64, is_causal = true} : (tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8xf32>) -> (tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>)
    %11 = aten.op "aten.add.Tensor"(%8, %9) phase = "bwd" : (tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>) -> tensor<2x2x8x8xf32>
    %12 = aten.op "aten.add.Tensor"(%11, %10) phase = "bwd" : (tensor<2x2x8x8xf32>, tensor<2x2x8x8xf32>) -> tensor<2x2x8x8xf32>
    %13 = aten.op "aten.transpose.int"(%12) phase = "bwd" args = {dim0 = 1 : i64, dim1 = 2 : i64} : (tensor<2x2x8x8xf32>) -> tensor<2x8x2x8xf32>
    %14 = aten.op "aten.view.default"(%13) phase = "bwd" args = {size = [16 : i64, 16 : i64]} : (tensor<2x8x2x8xf32>) -> tensor<16x16xf32>
    %15 = aten.op "aten.t.default"(%14) phase = "bwd" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %16 = aten.op "aten.mm.default"(%15, %xv) phase = "bwd" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %17 = aten.op "aten.t.default"(%wq) phase = "bwd" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %18 = aten.op "aten.t.default"(%17) phase = "bwd" : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %19 = aten.op "aten.mm.default"(%14, %18) phase = "bwd" : (tensor<16x16xf32>, tensor<16x16xf32>) -> tensor<16x16xf32>
    %20 = aten.op "aten.view.default"(%19) phase = "bwd" args = {size = [2 : i64, 8 : i64, 16 : i64]} : (tensor<16x16xf32>) -> tensor<2x8x16xf32>
    %21 = aten.op "aten.add.Tensor"(%g, %20) phase = "bwd" : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
    func.return %21, %16, %2 : tensor<2x8x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>
  }
}
