// RUN: flint-opt %s -p lower-to-chakra | filecheck %s --check-prefix=PART
// RUN: flint-opt %s -p 'lower-to-chakra{grad-wait=optimizer}' | filecheck %s --check-prefix=STEP
// RUN: not flint-opt %s -p 'lower-to-chakra{grad-wait=later}' 2>&1 | filecheck %s --check-prefix=BAD
// RUN: not flint-opt %s -p 'lower-to-chakra{grad-sync=step}' 2>&1 | filecheck %s --check-prefix=OLD
// flint-opt verifies the module after every pass.

// A backward that ends with its gradient reduce-scatter over the data-parallel axis (0) and a
// tensor-parallel all-reduce (axis 1) of the input gradient it returns, a second backward part, and
// the optimizer. Both collectives are synchronous: the compute stream waits for them where the part ends.

builtin.module attributes {flint.schedule = [["block_bwd", 1], ["embed_bwd", 1], ["block_optim", 1]], flint.plan = {dp_shard = 2 : i64, tp = 2 : i64, world_size = 4 : i64}} {
  shard.grid @mesh(shape = 2x2) {flint.axis_names = ["dp_shard", "tp"]}
  func.func @block_bwd(%x: tensor<16x16xbf16> {flint.role = "saved"}, %g: tensor<16x16xbf16> {flint.role = "tangent"}) -> (tensor<16x16xbf16>, tensor<8x16xbf16>) {
    %dw = aten.op "aten.mm.default"(%x, %g) phase = "bwd" : (tensor<16x16xbf16>, tensor<16x16xbf16>) -> tensor<16x16xbf16>
    %dx = aten.op "aten.mm.default"(%g, %x) phase = "bwd" : (tensor<16x16xbf16>, tensor<16x16xbf16>) -> tensor<16x16xbf16>
    %rs = dist.reduce_scatter %dw on @mesh grid_axes = [0] scatter_dim = 0 {stream = "dp"} : tensor<16x16xbf16> -> tensor<8x16xbf16>
    %ar = dist.all_reduce %dx on @mesh grid_axes = [1] : tensor<16x16xbf16> -> tensor<16x16xbf16>
    func.return %ar, %rs : tensor<16x16xbf16>, tensor<8x16xbf16>
  }
  func.func @embed_bwd(%g: tensor<16x16xbf16> {flint.role = "tangent"}) -> tensor<16x16xbf16> {
    %0 = aten.op "aten.relu.default"(%g) phase = "bwd" : (tensor<16x16xbf16>) -> tensor<16x16xbf16>
    func.return %0 : tensor<16x16xbf16>
  }
  func.func @block_optim(%w: tensor<8x16xbf16> {flint.role = "parameter"}, %gw: tensor<8x16xbf16> {flint.role = "gradient"}) -> tensor<8x16xbf16> {
    %0 = aten.op "aten.add.Tensor"(%w, %gw) phase = "optim" : (tensor<8x16xbf16>, tensor<8x16xbf16>) -> tensor<8x16xbf16>
    func.return %0 : tensor<8x16xbf16>
  }
}

// Default (part): the next part's first compute waits for both, where the program waits (the repeat
// carries what its first iteration is blocked on in, as its last operands).
// PART:      %[[MM:.*]] = chakra.comp "aten.mm.default +1"
// PART-NEXT: %[[RS:.*]] = chakra.coll reduce_scatter "dist.reduce_scatter" on @mesh grid_axes = [0]
// PART-NEXT: %[[AR:.*]] = chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [1]
// PART-NEXT: chakra.repeat 1 (%[[MM]], %[[AR]], %[[RS]], %[[RS]], %[[AR]], %[[RS]], %[[AR]]) {
// PART-NEXT: ^{{.*}}(%{{.*}}, %[[W1:.*]]: !chakra.node, %[[W2:.*]]: !chakra.node):
// PART-NEXT: chakra.comp "aten.relu.default" {{.*}} ctrl(%[[W1]], %[[W2]])
// PART:      chakra.repeat 1 (%{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}) {
// PART:      chakra.comp "aten.add.Tensor" {{.*}} data(%{{[0-9]+}}){{$}}

// optimizer: the data-parallel reduce-scatter (a gradient reduction) is waited for by the optimizer's first
// compute node, as Megatron-LM's finish_grad_sync; the tensor-parallel all-reduce still by the next part.
// STEP:      %[[MM:.*]] = chakra.comp "aten.mm.default +1"
// STEP-NEXT: %[[RS:.*]] = chakra.coll reduce_scatter "dist.reduce_scatter" on @mesh grid_axes = [0]
// STEP-NEXT: %[[AR:.*]] = chakra.coll all_reduce "dist.all_reduce" on @mesh grid_axes = [1]
// STEP-NEXT: chakra.repeat 1 (%[[MM]], %[[AR]], %[[RS]], %[[RS]], %[[AR]], %[[AR]]) {
// STEP-NEXT: ^{{.*}}(%{{.*}}, %[[W1:.*]]: !chakra.node):
// STEP-NEXT: chakra.comp "aten.relu.default" {{.*}} ctrl(%[[W1]]){{$}}
// STEP:      chakra.repeat 1 (%{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %[[RS]]) {
// STEP-NEXT: ^{{.*}}(%{{.*}}, %[[W2:.*]]: !chakra.node):
// STEP-NEXT: chakra.comp "aten.add.Tensor" {{.*}} ctrl(%[[W2]]){{$}}

// BAD: lower-to-chakra: option grad-wait="later" is not one of part, optimizer
// the option's name before session 25 (the plan's grad_sync is how often gradients are reduced):
// OLD: flint-opt: error: pass 'lower-to-chakra': it has no option 'grad-sync'; its options: device=h100-sxm, merge-compute=true, grad-wait=part, class-times=false
