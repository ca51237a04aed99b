"""Peak memory from the step IR's tensor lifetimes (flint.sim.lifetimes), on hand-written modules.

Every expected number below is computed by hand in the comments (f32: 4 bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.parser import Parser

from flint.errors import FlintError
from flint.ir import flint_context
from flint.sim.lifetimes import step_memory


def parse(text: str):
    module = Parser(flint_context(), text).parse_module()
    module.verify()
    return module


# block_fwd x L then block_bwd x L, AOTAutograd convention: forward returns
# (output, saved..., saved parameter), backward takes (saved..., parameter, tangent).
def fwd_bwd(layers: int = 2, bwd_first_arg: str = "tensor<2x16xf32>") -> str:
    return f"""
builtin.module attributes {{flint.schedule = [["block_fwd", {layers}], ["block_bwd", {layers}]]}} {{
  shard.grid @mesh(shape = 2)
  func.func @block_fwd(%h: tensor<2x8xf32> {{flint.role = "activation"}}, %w: tensor<8x16xf32> {{flint.role = "parameter"}}) -> (tensor<2x16xf32>, tensor<2x16xf32>, tensor<2x8xf32>, tensor<8x16xf32>) {{
    %0 = aten.op "aten.mm.default"(%h, %w) phase = "fwd" : (tensor<2x8xf32>, tensor<8x16xf32>) -> tensor<2x16xf32>
    %1 = aten.op "aten.relu.default"(%0) phase = "fwd" : (tensor<2x16xf32>) -> tensor<2x16xf32>
    func.return %1, %0, %h, %w : tensor<2x16xf32>, tensor<2x16xf32>, tensor<2x8xf32>, tensor<8x16xf32>
  }}
  func.func @block_bwd(%s: {bwd_first_arg} {{flint.role = "saved"}}, %sh: tensor<2x8xf32> {{flint.role = "saved"}}, %w: tensor<8x16xf32> {{flint.role = "parameter"}}, %g: tensor<2x16xf32> {{flint.role = "tangent"}}) -> (tensor<2x8xf32>, tensor<8x16xf32>) {{
    %d = aten.op "aten.threshold_backward.default"(%g, %s) phase = "bwd" args = {{threshold = 0 : i64}} : (tensor<2x16xf32>, {bwd_first_arg}) -> tensor<2x16xf32>
    %wt = aten.op "aten.t.default"(%w) phase = "bwd" : (tensor<8x16xf32>) -> tensor<16x8xf32>
    %gh = aten.op "aten.mm.default"(%d, %wt) phase = "bwd" : (tensor<2x16xf32>, tensor<16x8xf32>) -> tensor<2x8xf32>
    %sht = aten.op "aten.t.default"(%sh) phase = "bwd" : (tensor<2x8xf32>) -> tensor<8x2xf32>
    %gw = aten.op "aten.mm.default"(%sht, %d) phase = "bwd" : (tensor<8x2xf32>, tensor<2x16xf32>) -> tensor<8x16xf32>
    func.return %gh, %gw : tensor<2x8xf32>, tensor<8x16xf32>
  }}
}}
"""


def test_saved_activations_live_until_the_matching_backward_iteration():
    # Positions: fwd iterations at 0-1, 2-3; bwd iterations at 4-8, 9-13 (the views are positions too).
    # Resident: w (8x16 f32 = 512 B) x 2 layers, counted once for fwd + bwd = 1024.
    # fwd j: A0 (mm, 128 B, saved) freed after bwd iteration 1-j's first op (4+5(1-j));
    #        A1 (relu, 128 B, hand-off) freed when the next part starts using it;
    #        the saved input h is taken over (64 B from the iteration start) until bwd 1-j's last op.
    # bwd j: d (128 B) until op 4; gh (64 B, hand-off) until bwd j+1's tangent use / step end;
    #        gw (512 B) a gradient: kept to the end of the step.
    mem = step_memory(parse(fwd_bwd()))
    live = mem.report.live_bytes - 1024
    assert live.tolist() == [192, 320, 384, 512, 640, 384, 448, 448, 960, 896, 704, 768, 768, 1280]
    assert mem.peak_bytes == 2304
    assert mem.report.at_peak_bytes == {"params": 1024, "grads": 1024, "optimizer": 0, "activations": 256,
                                        "comm": 0, "other": 0}
    assert (mem.peak_function, mem.peak_iteration, mem.peak_op_index) == ("block_bwd", 1, 4)
    assert mem.positions == 14 and mem.notes == ()


@pytest.mark.parametrize("layers", [1, 3, 6])
def test_repeat_count_multiplies_state_and_saved_activations(layers):
    mem = step_memory(parse(fwd_bwd(layers)))
    assert mem.positions == 7 * layers
    at = mem.report.at_peak_bytes
    assert at["params"] == 512 * layers and at["grads"] == 512 * layers
    # Entering backward (first bwd op) every layer's saved A0 (128 B) and taken-over input (64 B) is live.
    first_bwd = 2 * layers
    assert mem.report.live_bytes[first_bwd] >= 512 * layers + 192 * layers


def test_unpaired_backward_is_reported():
    # The backward's first saved argument has a type no forward result has.
    mem = step_memory(parse(fwd_bwd(2, bwd_first_arg="tensor<4x16xf32>")))
    assert any("block_bwd" in n and "underestimate" in n for n in mem.notes)


TRAIN = """
builtin.module {
  shard.grid @mesh(shape = 2)
  func.func @train(%x: tensor<4x8xf32> {flint.role = "input"}, %w: tensor<8x8xf32> {flint.role = "parameter"}, %m: tensor<8x8xf32> {flint.role = "exp_avg"}, %v: tensor<8x8xf32> {flint.role = "exp_avg_sq"}) -> tensor<f32> {
    %f = dist.all_gather %w on @mesh grid_axes = [0] gather_dim = 0 : tensor<8x8xf32> -> !dist.future<tensor<16x8xf32>>
    %y0 = aten.op "aten.relu.default"(%x) phase = "fwd" : (tensor<4x8xf32>) -> tensor<4x8xf32>
    %wf = dist.wait %f : tensor<16x8xf32>
    %wt = aten.op "aten.t.default"(%wf) phase = "fwd" : (tensor<16x8xf32>) -> tensor<8x16xf32>
    %y = aten.op "aten.mm.default"(%y0, %wt) phase = "fwd" : (tensor<4x8xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>
    %s = aten.op "aten.sum.default"(%y) phase = "fwd" : (tensor<4x16xf32>) -> tensor<f32>
    %m2 = aten.op "aten.mul_.Tensor"(%m, %w) phase = "optim" : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %d = aten.op "aten.sqrt.default"(%v) phase = "optim" : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %w2 = aten.op "aten.addcdiv_.default"(%w, %m2, %d) phase = "optim" : (tensor<8x8xf32>, tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    func.return %s : tensor<f32>
  }
}
"""


def test_collective_buffers_views_waits_and_in_place_optimizer_ops():
    # Resident: w 256 (params), m + v 512 (optimizer), x 128 (input -> other) = 896.
    # gathered w (16x8 = 512 B, comm) at 0, through the wait and the transpose view, until the mm at 4;
    # y0 128 at 1..4; y 256 at 4..5; s 4 B from 5 to the end (the step's output);
    # mul_ / addcdiv_ are in place (no memory), sqrt 256 B (other) at 7..8.
    mem = step_memory(parse(TRAIN), capacity_bytes=1000)
    assert (mem.report.live_bytes - 896).tolist() == [512, 640, 640, 640, 896, 260, 4, 260, 260]
    assert mem.peak_bytes == 1792 and mem.report.peak_position == 4
    assert mem.report.at_peak_bytes == {"params": 256, "grads": 0, "optimizer": 512, "activations": 384,
                                        "comm": 512, "other": 128}
    assert mem.report.category_peak_bytes["other"] == 128 + 256
    assert mem.report.fits is False


def test_optimizer_function_shares_the_forward_parameters():
    text = """
builtin.module attributes {flint.schedule = [["layer_fwd", 3], ["layer_optim", 3]]} {
  func.func @layer_fwd(%h: tensor<4x8xf32> {flint.role = "activation"}, %w: tensor<8x8xf32> {flint.role = "parameter"}) -> tensor<4x8xf32> {
    %0 = aten.op "aten.mm.default"(%h, %w) phase = "fwd" : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    func.return %0 : tensor<4x8xf32>
  }
  func.func @layer_optim(%w: tensor<8x8xf32> {flint.role = "parameter"}, %g: tensor<8x8xf32> {flint.role = "gradient"}, %m: tensor<8x8xf32> {flint.role = "exp_avg"}, %v: tensor<8x8xf32> {flint.role = "exp_avg_sq"}) {
    %0 = aten.op "aten.lerp_.Scalar"(%m, %g) phase = "optim" args = {weight = 1.000000e-01 : f64} : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    func.return
  }
}
"""
    mem = step_memory(parse(text))
    # 3 layers x 256 B parameters, counted once although both functions name them; m + v: 3 x 512.
    assert mem.report.at_peak_bytes["params"] == 768
    assert mem.report.at_peak_bytes["optimizer"] == 1536


def test_lowered_module_has_no_tensors():
    text = """
shard.grid @mesh(shape = 2)
chakra.graph @step {
  %0 = chakra.comp "x" flops = 1 bytes = 1 duration_us = 1.0
}
"""
    with pytest.raises(FlintError, match="already lowered chakra.graph"):
        step_memory(parse(text))


def test_memory_of_many_layers():
    # Its speed is bench/analyses.py's (memory model < 2 s at 2,000 layers), not a unit test's.
    mem = step_memory(parse(fwd_bwd(2000)))
    assert mem.report.at_peak_bytes["params"] == 512 * 2000
    assert np.all(mem.report.live_bytes >= 0)


def test_a_value_returned_as_output_and_as_saved_lives_until_its_last_consumer():
    text = """
builtin.module attributes {flint.schedule = [["f_fwd", 1], ["f_bwd", 1]]} {
  func.func @f_fwd(%h: tensor<2x8xf32> {flint.role = "activation"}, %w: tensor<8x16xf32> {flint.role = "parameter"}) -> (tensor<2x16xf32>, tensor<2x16xf32>) {
    %0 = aten.op "aten.mm.default"(%h, %w) phase = "fwd" : (tensor<2x8xf32>, tensor<8x16xf32>) -> tensor<2x16xf32>
    func.return %0, %0 : tensor<2x16xf32>, tensor<2x16xf32>
  }
  func.func @f_bwd(%s: tensor<2x16xf32> {flint.role = "saved"}, %g: tensor<2x16xf32> {flint.role = "tangent"}) -> tensor<2x16xf32> {
    %x = aten.op "aten.relu.default"(%g) phase = "bwd" : (tensor<2x16xf32>) -> tensor<2x16xf32>
    %d = aten.op "aten.mul.Tensor"(%x, %s) phase = "bwd" : (tensor<2x16xf32>, tensor<2x16xf32>) -> tensor<2x16xf32>
    func.return %d : tensor<2x16xf32>
  }
}
"""
    # %0 (128 B) is the hand-off (tangent read at bwd op 0) *and* the saved value (read at bwd op 1):
    # it lives through position 2. w: 512 B. x 128 B at 1..2, d 128 B from 2 to the end.
    mem = step_memory(parse(text))
    assert (mem.report.live_bytes - 512).tolist() == [128, 256, 384]
    assert mem.report.at_peak_bytes["grads"] == 0


def test_collective_output_saved_for_backward_counts_as_activation():
    text = """
builtin.module attributes {flint.schedule = [["f_fwd", 1], ["f_bwd", 1]]} {
  shard.grid @mesh(shape = 2)
  func.func @f_fwd(%h: tensor<2x8xf32> {flint.role = "activation"}, %w: tensor<8x16xf32> {flint.role = "parameter"}) -> (tensor<2x16xf32>, tensor<2x16xf32>) {
    %0 = aten.op "aten.mm.default"(%h, %w) phase = "fwd" : (tensor<2x8xf32>, tensor<8x16xf32>) -> tensor<2x16xf32>
    %1 = dist.all_reduce %0 on @mesh grid_axes = [0] : tensor<2x16xf32> -> tensor<2x16xf32>
    %2 = aten.op "aten.relu.default"(%1) phase = "fwd" : (tensor<2x16xf32>) -> tensor<2x16xf32>
    func.return %2, %1 : tensor<2x16xf32>, tensor<2x16xf32>
  }
  func.func @f_bwd(%s: tensor<2x16xf32> {flint.role = "saved"}, %g: tensor<2x16xf32> {flint.role = "tangent"}) -> tensor<2x16xf32> {
    %x = aten.op "aten.relu.default"(%g) phase = "bwd" : (tensor<2x16xf32>) -> tensor<2x16xf32>
    %d = aten.op "aten.mul.Tensor"(%x, %s) phase = "bwd" : (tensor<2x16xf32>, tensor<2x16xf32>) -> tensor<2x16xf32>
    func.return %d : tensor<2x16xf32>
  }
}
"""
    # mm 0..1; all_reduce output 1..4 (saved: read by the bwd mul); relu 2..3 (hand-off to the tangent);
    # x 3..4; d from 4 on. All 128 B.
    mem = step_memory(parse(text))
    assert (mem.report.live_bytes - 512).tolist() == [128, 256, 256, 384, 384]
    assert mem.report.category_peak_bytes["comm"] == 0
    assert mem.report.at_peak_bytes["activations"] == 384


def test_explicit_entries_pair_like_a_repeat():
    # The same two layers written as four schedule entries: backward entries consume the latest
    # unconsumed forward iteration, so lifetimes equal the repeated form. Resident state counts a
    # function's largest repeat (entries of one function are taken to be the same layers run again).
    repeated = step_memory(parse(fwd_bwd(2)))
    text = fwd_bwd(2).replace('[["block_fwd", 2], ["block_bwd", 2]]',
                              '[["block_fwd", 1], ["block_fwd", 1], ["block_bwd", 1], ["block_bwd", 1]]')
    explicit = step_memory(parse(text))
    assert explicit.report.at_peak_bytes["params"] == 512
    assert (explicit.report.live_bytes - 512).tolist() == (repeated.report.live_bytes - 1024).tolist()
    assert explicit.notes == ()


def test_microbatches_pair_each_backward_with_its_own_forward():
    # fwd x2, bwd x2, fwd x2, bwd x2 (two microbatches). Microbatch 1 leaves only its gradients
    # (2 x 512 B) live; microbatch 2 repeats microbatch 1's lifetimes on top of them, except that
    # its gradients are added into those buffers (freed at their iteration's end): from bwd
    # iteration 0's last op on, microbatch 2 holds one 512 B gradient less than microbatch 1 did.
    one = step_memory(parse(fwd_bwd(2)))
    text = fwd_bwd(2).replace('[["block_fwd", 2], ["block_bwd", 2]]',
                              '[["block_fwd", 2], ["block_bwd", 2], ["block_fwd", 2], ["block_bwd", 2]]')
    two = step_memory(parse(text))
    live1 = one.report.live_bytes - 1024
    live2 = two.report.live_bytes - 1024
    assert live2[:14].tolist() == live1.tolist()
    expected = live1 + 1024 - 512 * (np.arange(14) >= 9)
    assert live2[14:].tolist() == expected.tolist()
    assert two.report.category_peak_bytes["grads"] == 1024 + 512
    assert two.notes == ()


COPY_OUT = """
builtin.module {
  shard.grid @mesh(shape = 2)
  func.func @block(%x: tensor<8x8xf32> {flint.role = "input"}, %w: tensor<64xf32> {flint.role = "parameter"}) -> tensor<f32> {
    %f = dist.all_gather %w on @mesh grid_axes = [0] gather_dim = 0 : tensor<64xf32> -> !dist.future<tensor<128xf32>>
    %g = dist.wait %f : tensor<128xf32>
    %v = aten.op "aten.view.default"(%g) phase = "fwd" args = {size = [2 : i64, 64 : i64]} : (tensor<128xf32>) -> tensor<2x64xf32>
    %a, %b = aten.op "aten.split_with_sizes_copy.default"(%v) phase = "fwd" args = {split_sizes = [32 : i64, 32 : i64], dim = 1 : i64} : (tensor<2x64xf32>) -> (tensor<2x32xf32>, tensor<2x32xf32>)
    %av = aten.op "aten.view.default"(%a) phase = "fwd" args = {size = [8 : i64, 8 : i64]} : (tensor<2x32xf32>) -> tensor<8x8xf32>
    %y1 = aten.op "aten.mm.default"(%x, %av) phase = "fwd" : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %bv = aten.op "aten.view.default"(%b) phase = "fwd" args = {size = [8 : i64, 8 : i64]} : (tensor<2x32xf32>) -> tensor<8x8xf32>
    %y2 = aten.op "aten.mm.default"(%y1, %bv) phase = "fwd" : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %s = aten.op "aten.sum.default"(%y2) phase = "fwd" : (tensor<8x8xf32>) -> tensor<f32>
    func.return %s : tensor<f32>
  }
}
"""


def test_fsdp_copy_out_parameters_are_freed_together_as_comm():
    # FSDP2 copies the all-gather output into the group's unsharded parameters in its pre-forward hook,
    # freeing the gathered buffer there, and frees the parameters together at the reshard, not each one
    # after its last use. Resident: x 256 (input) + w 256 (params) = 512.
    # gathered flat buffer 512 B (comm) at 0 only (the copy-out runs where the all-gather is issued, not at
    # op 3); copy-out a, b 256 B each (comm) from 0 until b's last use at 7 (a's own last use is 5: freed
    # with b, not after 5); y1 256 at 5..7; y2 256 at 7..8; s 4 B.
    mem = step_memory(parse(COPY_OUT))
    assert (mem.report.live_bytes - 512).tolist() == [1024, 512, 512, 512, 512, 768, 768, 1024, 260]
    assert mem.report.at_peak_bytes["comm"] == 1024 and mem.report.peak_position == 0


def backward_prefetch(prefetch: int) -> str:
    attr = f" {{flint.prefetch = {prefetch} : i64}}" if prefetch else ""
    return f"""
builtin.module attributes {{flint.schedule = [["block_bwd", 2], ["embed_bwd", 1]]}} {{
  shard.grid @mesh(shape = 2)
  func.func @block_bwd(%w: tensor<64xf32> {{flint.role = "parameter"}}, %g: tensor<8x8xf32> {{flint.role = "tangent"}}) -> (tensor<8x8xf32>, tensor<64xf32>) {{
    %f = dist.all_gather %w on @mesh grid_axes = [0] gather_dim = 0{attr} : tensor<64xf32> -> !dist.future<tensor<128xf32>>
    %n = aten.op "aten.neg.default"(%g) phase = "bwd" : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %wf = dist.wait %f : tensor<128xf32>
    %v = aten.op "aten.view.default"(%wf) phase = "bwd" args = {{size = [2 : i64, 8 : i64, 8 : i64]}} : (tensor<128xf32>) -> tensor<2x8x8xf32>
    %s = aten.op "aten.select.int"(%v) phase = "bwd" args = {{dim = 0 : i64, index = 0 : i64}} : (tensor<2x8x8xf32>) -> tensor<8x8xf32>
    %h = aten.op "aten.mm.default"(%n, %s) phase = "bwd" : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
    %gw = aten.op "aten.neg.default"(%w) phase = "bwd" : (tensor<64xf32>) -> tensor<64xf32>
    func.return %h, %gw : tensor<8x8xf32>, tensor<64xf32>
  }}
  func.func @embed_bwd(%e: tensor<64xf32> {{flint.role = "parameter"}}, %g: tensor<8x8xf32> {{flint.role = "tangent"}}) -> tensor<64xf32> {{
    %buf = aten.op "aten.new_empty.default"(%g) phase = "bwd" args = {{size = [64 : i64]}} : (tensor<8x8xf32>) -> tensor<64xf32>
    %cp = aten.op "aten.copy.default"(%buf, %e) phase = "bwd" : (tensor<64xf32>, tensor<64xf32>) -> tensor<64xf32>
    %f = dist.all_gather %cp on @mesh grid_axes = [0] gather_dim = 0 : tensor<64xf32> -> !dist.future<tensor<128xf32>>
    %ge = aten.op "aten.neg.default"(%e) phase = "bwd" : (tensor<64xf32>) -> tensor<64xf32>
    %wf = dist.wait %f : tensor<128xf32>
    func.return %ge : tensor<64xf32>
  }}
}}
"""


def test_backward_prefetch_gathers_the_next_part_during_the_last_layer():
    # block_bwd iterations at 0-6 and 7-13, embed_bwd at 14-18 (its copy-in at 14-15, all-gather at 16).
    # With prefetch K=1: layer 1's gather (512 B) is issued with layer 0's at position 0 (+512 at 0-6),
    # and FSDP2's pre-backward of the last layer already all-gathers the embedding (+512 from 7 until
    # embed_bwd's own copy-in at 14). Without prefetch, each gather is allocated where its copy-in starts.
    # The copy-in (new_empty + copy, 256 B) writes into the gathered buffer: no memory of its own.
    pre = step_memory(parse(backward_prefetch(1))).report.live_bytes
    none = step_memory(parse(backward_prefetch(0))).report.live_bytes
    assert (pre - none).tolist() == [512] * 14 + [0] * 5


HELD_REDUCE_SCATTER = """
builtin.module attributes {flint.schedule = [["block_bwd", 1], ["embed_bwd", 1]]} {
  shard.grid @mesh(shape = 2)
  func.func @block_bwd(%w: tensor<64xf32> {flint.role = "parameter"}, %g: tensor<8x8xf32> {flint.role = "tangent"}) -> (tensor<8x8xf32>, tensor<32xf32>) {
    %gw = aten.op "aten.neg.default"(%w) phase = "bwd" : (tensor<64xf32>) -> tensor<64xf32>
    %rs = aten.op "aten.cat.default"(%gw) phase = "bwd" : (tensor<64xf32>) -> tensor<64xf32>
    %f = dist.reduce_scatter %rs on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64xf32> -> !dist.future<tensor<32xf32>>
    %s = dist.wait %f : tensor<32xf32>
    %h = aten.op "aten.neg.default"(%g) phase = "bwd" : (tensor<8x8xf32>) -> tensor<8x8xf32>
    func.return %h, %s : tensor<8x8xf32>, tensor<32xf32>
  }
  func.func @embed_bwd(%e: tensor<64xf32> {flint.role = "parameter"}, %g: tensor<8x8xf32> {flint.role = "tangent"}) -> tensor<32xf32> {
    %full = aten.op "aten.neg.default"(%g) phase = "bwd" : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %shard = aten.op "aten.clone.default"(%full) phase = "bwd" : (tensor<8x8xf32>) -> tensor<8x8xf32>
    %v = aten.op "aten.view.default"(%shard) phase = "bwd" args = {size = [64 : i64]} : (tensor<8x8xf32>) -> tensor<64xf32>
    %rs = aten.op "aten.cat.default"(%v) phase = "bwd" : (tensor<64xf32>) -> tensor<64xf32>
    %f = dist.reduce_scatter %rs on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64xf32> -> !dist.future<tensor<32xf32>>
    %s = dist.wait %f : tensor<32xf32>
    func.return %s : tensor<32xf32>
  }
}
"""


def test_reduce_scatter_input_is_held_until_the_next_group_forms_its_own():
    # FSDP2 keeps a group's reduce-scatter input (comm_ctx.reduce_scatter_states) until the next group's
    # post-backward, which first redistributes its gradient (here the clone: a tensor-parallel
    # Replicate -> Shard(0) copy) and only then releases the old buffer and forms its own. Before, the
    # old buffer was freed after the next function's last use of its tangent (embed_bwd op 0): Llama-3 8B
    # FSDP x TP lost layer 0's 436 MB reduce-scatter input at the embedding's redistribution (-4.3%).
    # And foreach_reduce keeps the group's last gradient (its loop variable) until it returns, past the
    # copy-in cat and the reduce-scatter output's allocation: Llama-3 8B FSDP's 2 GB embedding gradient
    # at its reduce-scatter (-1.0% before, now equal to the tracker to the byte).
    # Positions: block_bwd 0-4 (neg, cat, reduce_scatter, wait, neg), embed_bwd 5-10 (neg, clone, view,
    # cat, reduce_scatter, wait). Resident: w, e 256 B each. block: gw 256 at 0-2 (the cat's last
    # operand: through the reduce-scatter at 2, before: 0-1), its reduce-scatter input rs 256 from 1,
    # the sharded gradient 128 from 2 and h 256 from 4 (both handed on, until embed's op 0).
    # embed: full 256 at 5-6, its clone 256 at 6-9 (through embed's reduce-scatter), its rs 256 from 8,
    # output 128 from 9. block's rs lives to 7 (the position before embed's rs), so it is there at the
    # clone (6): 512 + 256 (rs) + 256 (full) + 256 (clone) = 1280 (before: freed after 5, 1024 at 6).
    mem = step_memory(parse(HELD_REDUCE_SCATTER))
    assert mem.report.live_bytes.tolist() == [768, 1024, 1152, 896, 1152, 1408, 1280, 1024, 1024, 1152, 896]
