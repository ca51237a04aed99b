// RUN: flint-opt %s -p annotate-cost | filecheck %s
// RUN: flint-opt %s -p 'lower-to-chakra{class-times=true merge-compute=false}' | filecheck %s --check-prefix=LOWER
// RUN: flint-opt %s | flint-opt | filecheck %s --check-prefix=ROUND
// flint-opt verifies the module after every pass.

// Multi-tensor ops (plan field optimizer_impl: torch's foreach ops and fused AdamW). The IR flattens their
// tensor lists into the operands; args list_sizes keeps each Tensor[] argument's length. An in-place one
// returns nothing. Bytes: every tensor read, the lists it writes written again, its results written;
// kernels: ATen's multi_tensor_apply launches (2,240 chunks of 65,536 elements at most per launch), each
// priced as streaming pointwise bytes (h100-sxm: 3,350 GB/s x 0.867), never below the 3 us floor.

// _foreach_mul_ reads and writes both gradients (1,052,672 f32) and reads the coefficient: 8,421,380 bytes.
// CHECK: aten.op "aten._foreach_mul_.Tensor"(%gp, %gb, %c) {{.*}} {flops = 0 : i64, bytes = 8421380 : i64, duration_us = 3.000000e+00 : f64} : ({{.*}}) -> ()
// Out of place: its list of results is written: 8,421,376 bytes.
// CHECK: aten.op "aten._foreach_sqrt.default"(%vp, %vb) {{.*}} {flops = 0 : i64, bytes = 8421376 : i64, duration_us = 3.000000e+00 : f64}
// The fused step reads params, grads, both moments (4 x 4,210,688) and the step counts (8), and writes params
// and both moments (3 x 4,210,688), not the gradients: 29,474,824 bytes / 2,904,450 bytes per us.
// CHECK: aten.op "aten._fused_adamw_.default"({{.*}}) {{.*}} {flops = 0 : i64, bytes = 29474824 : i64, duration_us = 10.14816{{[0-9]*}} : f64}
// One tensor one element past a launch's 2,240 chunks: two launches, the second at the floor (404.347 + 3 us).
// CHECK: aten.op "aten._foreach_mul_.Scalar"(%big) {{.*}} {flops = 0 : i64, bytes = 1174405128 : i64, duration_us = 407.3468{{[0-9]*}} : f64}

// flint estimate's breakdown (flint.class_times) counts them as "multi-tensor", each launch a kernel.
// LOWER: chakra.comp "aten._fused_adamw_.default" {{.*}} {flint.class_times = {"multi-tensor" = [10.14816{{[0-9]*}} : f64, array<i64: 0, 29474824, 1>]}}
// LOWER: chakra.comp "aten._foreach_mul_.Scalar" {{.*}} {flint.class_times = {"multi-tensor" = [407.3468{{[0-9]*}} : f64, array<i64: 0, 1174405128, 2>]}}

// ROUND: aten.op "aten._foreach_mul_.Tensor"(%gp, %gb, %c) phase = "optim" args = {list_sizes = [2 : i64]} : (tensor<1024x1024xf32>, tensor<4096xf32>, tensor<f32>) -> ()
// ROUND: %0, %1 = aten.op "aten._foreach_sqrt.default"(%vp, %vb)

shard.grid @mesh(shape = 2)

func.func @step(%p: tensor<1024x1024xf32> {flint.role = "parameter"}, %b: tensor<4096xf32> {flint.role = "parameter"}, %gp: tensor<1024x1024xf32> {flint.role = "gradient"}, %gb: tensor<4096xf32> {flint.role = "gradient"}, %mp: tensor<1024x1024xf32> {flint.role = "exp_avg"}, %mb: tensor<4096xf32> {flint.role = "exp_avg"}, %vp: tensor<1024x1024xf32> {flint.role = "exp_avg_sq"}, %vb: tensor<4096xf32> {flint.role = "exp_avg_sq"}, %s0: tensor<f32> {flint.role = "step"}, %s1: tensor<f32> {flint.role = "step"}, %c: tensor<f32> {flint.role = "clip_coef"}, %big: tensor<146800641xf32> {flint.role = "parameter"}) {
  aten.op "aten._foreach_mul_.Tensor"(%gp, %gb, %c) phase = "optim" args = {list_sizes = [2 : i64]} : (tensor<1024x1024xf32>, tensor<4096xf32>, tensor<f32>) -> ()
  %0, %1 = aten.op "aten._foreach_sqrt.default"(%vp, %vb) phase = "optim" args = {list_sizes = [2 : i64]} : (tensor<1024x1024xf32>, tensor<4096xf32>) -> (tensor<1024x1024xf32>, tensor<4096xf32>)
  aten.op "aten._foreach_add_.Scalar"(%s0, %s1) phase = "optim" args = {scalar = 1 : i64, list_sizes = [2 : i64]} : (tensor<f32>, tensor<f32>) -> ()
  aten.op "aten._fused_adamw_.default"(%p, %b, %gp, %gb, %mp, %mb, %vp, %vb, %s0, %s1) phase = "optim" args = {max_exp_avg_sqs = [], lr = 3.000000e-04 : f64, beta1 = 9.000000e-01 : f64, beta2 = 9.500000e-01 : f64, weight_decay = 1.000000e-01 : f64, eps = 1.000000e-08 : f64, amsgrad = false, maximize = false, list_sizes = [2 : i64, 2 : i64, 2 : i64, 2 : i64, 0 : i64, 2 : i64]} : (tensor<1024x1024xf32>, tensor<4096xf32>, tensor<1024x1024xf32>, tensor<4096xf32>, tensor<1024x1024xf32>, tensor<4096xf32>, tensor<1024x1024xf32>, tensor<4096xf32>, tensor<f32>, tensor<f32>) -> ()
  aten.op "aten._foreach_mul_.Scalar"(%big) phase = "optim" args = {scalar = 9.000000e-01 : f64, list_sizes = [1 : i64]} : (tensor<146800641xf32>) -> ()
  func.return
}
