"""The scheduling-pass invariant checker: a valid rescheduling passes, and each
check fires on a deliberately broken transformation, naming the op and what it broke."""

from __future__ import annotations

import textwrap

import pytest
from xdsl.dialects.builtin import ArrayAttr, IntegerAttr, ModuleOp, StringAttr, i64
from xdsl.parser import Parser
from xdsl.rewriter import InsertPoint, Rewriter

from flint.errors import FlintError
from flint.ir import dist, flint_context
from flint.ir.aten import AtenOp
from flint.schedule import ScheduleInvariantError, check_schedule_invariants

STEP = textwrap.dedent('''
    shard.grid @mesh(shape = 4x2)
    func.func @step(%x: tensor<8x64xbf16>, %w1s: tensor<16x64xbf16>, %w2s: tensor<16x64xbf16>, %g: tensor<64x64xbf16>) -> tensor<8x64xbf16> {
      %0 = dist.all_gather %w1s on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
      %w1 = dist.wait %0 : tensor<64x64xbf16>
      %1 = dist.all_gather %w2s on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
      %w2 = dist.wait %1 : tensor<64x64xbf16>
      %h = aten.op "aten.mm.default"(%x, %w1) phase = "fwd" module = "layers.0" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16> loc("model.py":10:0)
      %y = aten.op "aten.mm.default"(%h, %w2) phase = "fwd" module = "layers.1" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16> loc("model.py":11:0)
      %2 = dist.reduce_scatter %g on @mesh grid_axes = [0] scatter_dim = 0 : tensor<64x64xbf16> -> !dist.future<tensor<16x64xbf16>>
      %gs = dist.wait %2 : tensor<16x64xbf16>
      dist.send %y to @mesh grid_axes = [1] offset = 1 tag = 0 : tensor<8x64xbf16>
      dist.send %gs to @mesh grid_axes = [1] offset = 1 tag = 0 : tensor<16x64xbf16>
      %r1 = dist.recv from @mesh grid_axes = [1] offset = -1 tag = 0 : tensor<8x64xbf16>
      %r2 = dist.recv from @mesh grid_axes = [1] offset = -1 tag = 0 : tensor<16x64xbf16>
      dist.barrier on @mesh grid_axes = [0]
      %3 = dist.all_reduce %r1 on @mesh grid_axes = [1] : tensor<8x64xbf16> -> tensor<8x64xbf16>
      func.return %3 : tensor<8x64xbf16>
    }
''')


def parse(text: str) -> ModuleOp:
    module = Parser(flint_context(), text).parse_module()
    module.verify()
    return module


def ops(module: ModuleOp, name: str, target: str | None = None) -> list:
    return [o for o in module.walk() if o.name == name and (target is None or o.target.data == target)]


def move_before(op, anchor) -> None:
    op.detach()
    Rewriter.insert_op(op, InsertPoint.before(anchor))


def broken(message: str, before: ModuleOp, after: ModuleOp, **kw) -> ScheduleInvariantError:
    with pytest.raises(ScheduleInvariantError) as info:
        check_schedule_invariants(before, after, **kw)
    assert message in str(info.value), str(info.value)
    assert isinstance(info.value, FlintError)
    return info.value


def test_unchanged_and_valid_reorders_pass():
    before = parse(STEP)
    check_schedule_invariants(before, before.clone())
    # prefetch: issue the second gather before the first wait; sink that wait to its use
    after = before.clone()
    g1, g2 = ops(after, "dist.all_gather")
    w1, w2 = ops(after, "dist.wait")[:2]
    move_before(g2, w1)
    h = ops(after, "aten.op")[0]
    move_before(w1, h)
    # a synchronous collective becoming start + wait is the same communication
    check_schedule_invariants(before, after)
    check_schedule_invariants(before, after, same_bytes_per_group=True)


def test_use_before_wait_names_the_op_and_the_wait():
    before = parse(STEP)
    after = before.clone()
    h = ops(after, "aten.op")[0]
    move_before(h, ops(after, "dist.wait")[0])
    err = broken("before the 'dist.wait' that completes it", before, after)
    assert '"aten.mm.default" (module layers.0) at loc("model.py":10:0)' in str(err)
    assert "uses operand #1" in str(err)
    assert err.op is h


def test_wait_before_start():
    before = parse(STEP)
    after = before.clone()
    g2 = ops(after, "dist.all_gather")[1]
    move_before(ops(after, "dist.wait")[1], g2)
    broken("waits before its start", before, after)


def test_use_before_producer():
    before = parse(STEP)
    after = before.clone()
    h, y = ops(after, "aten.op")
    move_before(y, h)
    err = broken("uses operand #0 before it is computed", before, after)
    assert "module layers.1" in str(err)


def test_every_start_has_exactly_one_wait():
    before = parse(STEP)
    after = before.clone()
    w = ops(after, "dist.wait")[0]
    Rewriter.insert_op(dist.WaitOp(w.future), InsertPoint.after(w))
    broken("must be completed by exactly one 'dist.wait'; it has 2", before, after)


def test_verify_dist_runs():
    before = parse(STEP)
    after = before.clone()
    r2 = ops(after, "dist.recv")[1]
    Rewriter.erase_op(r2)
    err = broken("verify-dist fails after the pass", before, after)
    assert "no matching peer" in str(err)


def test_rewired_data_dependency():
    before = parse(STEP)
    after = before.clone()
    y = ops(after, "aten.op")[1]
    w1 = ops(after, "dist.wait")[0]
    y.operands[1] = w1.result  # the second layer now multiplies by the first layer's weight
    err = broken("breaks a data dependency: operand #1 came from", before, after)
    assert "module layers.1" in str(err) and "%w2s" not in str(err)


def test_dropped_collective():
    before = parse(STEP)
    after = before.clone()
    ar = ops(after, "dist.all_reduce")[0]
    ar.result.replace_all_uses_with(ar.input)
    Rewriter.erase_op(ar)
    err = broken("communication changed: 'dist.all_reduce' on @mesh grid_axes = [1] of 1024 bytes (bf16, "
                 "reduction sum) after 1 barrier(s): 1 per step before the pass, 0 per step after", before, after)
    assert "in the input" in str(err)


def test_collective_moved_across_a_barrier():
    before = parse(STEP)
    after = before.clone()
    move_before(ops(after, "dist.all_reduce")[0], ops(after, "dist.barrier")[0])
    broken("'dist.all_reduce' on @mesh grid_axes = [1] of 1024 bytes (bf16, reduction sum): 0 per step before",
           before, after)


def test_p2p_order_is_a_control_dependency():
    before = parse(STEP)
    after = before.clone()
    s1, s2 = ops(after, "dist.send")
    move_before(s2, s1)
    err = broken("breaks a control dependency: sends and recvs on one channel", before, after)
    assert "dist.send" in str(err)


def test_flops_change():
    before = parse(STEP)
    after = before.clone()
    h = ops(after, "aten.op")[0]
    extra = AtenOp("aten.mm.default", [h.inputs[0], h.inputs[1]], [h.outputs[0].type], phase="fwd")
    Rewriter.insert_op(extra, InsertPoint.after(h))
    err = broken("FLOPs changed: 131072 per step before the pass, 196608 after", before, after)
    assert "is new" in str(err)


def test_schedule_repeat_counts_weigh_work():
    text = STEP.replace("shard.grid", 'builtin.module attributes {flint.schedule = [["step", 3]]} {\nshard.grid') + "}\n"
    before = parse(text)
    after = before.clone()
    after.attributes["flint.schedule"] = ArrayAttr([ArrayAttr([StringAttr("step"), IntegerAttr(2, i64)])])
    broken("of 2048 bytes (bf16): 6 per step before the pass, 4 per step after (weighted by the schedule's repeat counts)", before, after)


BUCKET_BEFORE = textwrap.dedent('''
    shard.grid @mesh(shape = 4)
    func.func @f(%a: tensor<16x64xbf16>, %b: tensor<16x64xbf16>, %x: tensor<8x64xbf16>) -> tensor<8x64xbf16> {
      %0 = dist.all_gather %a on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
      %wa = dist.wait %0 : tensor<64x64xbf16>
      %1 = dist.all_gather %b on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>
      %wb = dist.wait %1 : tensor<64x64xbf16>
      %h = aten.op "aten.mm.default"(%x, %wa) module = "l0" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
      %y = aten.op "aten.mm.default"(%h, %wb) module = "l1" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
      func.return %y : tensor<8x64xbf16>
    }
''')

# One all-gather of both shards, unpacked as FSDP2's copy-out does: [n, 2, 16, 64] -> select each.
BUCKET_AFTER = textwrap.dedent('''
    shard.grid @mesh(shape = 4)
    func.func @f(%a: tensor<16x64xbf16>, %b: tensor<16x64xbf16>, %x: tensor<8x64xbf16>) -> tensor<8x64xbf16> {
      %c = aten.op "aten.cat.default"(%a, %b) args = {dim = 0 : i64} : (tensor<16x64xbf16>, tensor<16x64xbf16>) -> tensor<32x64xbf16>
      %0 = dist.all_gather %c on @mesh grid_axes = [0] gather_dim = 0 : tensor<32x64xbf16> -> !dist.future<tensor<128x64xbf16>>
      %g = dist.wait %0 : tensor<128x64xbf16>
      %v = aten.op "aten.view.default"(%g) args = {size = [4 : i64, 2 : i64, 16 : i64, 64 : i64]} : (tensor<128x64xbf16>) -> tensor<4x2x16x64xbf16>
      %sa = aten.op "aten.select.int"(%v) args = {dim = 1 : i64, index = 0 : i64} : (tensor<4x2x16x64xbf16>) -> tensor<4x16x64xbf16>
      %wa = aten.op "aten.reshape.default"(%sa) args = {shape = [64 : i64, 64 : i64]} : (tensor<4x16x64xbf16>) -> tensor<64x64xbf16>
      %sb = aten.op "aten.select.int"(%v) args = {dim = 1 : i64, index = 1 : i64} : (tensor<4x2x16x64xbf16>) -> tensor<4x16x64xbf16>
      %wb = aten.op "aten.reshape.default"(%sb) args = {shape = [64 : i64, 64 : i64]} : (tensor<4x16x64xbf16>) -> tensor<64x64xbf16>
      %h = aten.op "aten.mm.default"(%x, %wa) module = "l0" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
      %y = aten.op "aten.mm.default"(%h, %wb) module = "l1" : (tensor<8x64xbf16>, tensor<64x64xbf16>) -> tensor<8x64xbf16>
      func.return %y : tensor<8x64xbf16>
    }
''')


def test_bucketing_keeps_bytes_per_group():
    before, after = parse(BUCKET_BEFORE), parse(BUCKET_AFTER)
    check_schedule_invariants(before, after, same_bytes_per_group=True)
    # without the bucketing allowance, one collective of 4096 bytes is not two of 2048
    broken("communication changed: 'dist.all_gather' on @mesh grid_axes = [0] of 2048 bytes", before, after)


def test_bucketing_that_loses_bytes():
    before = parse(BUCKET_BEFORE)
    after = parse(BUCKET_AFTER.replace('"aten.cat.default"(%a, %b)', '"aten.cat.default"(%a, %a)'))
    err = broken("breaks a data dependency: operand #1 no longer depends on argument #1 of @f", before, after,
                 same_bytes_per_group=True)
    assert "module l1" in str(err)
    fewer = parse(BUCKET_AFTER.replace('(%a, %b) args = {dim = 0 : i64} : (tensor<16x64xbf16>, tensor<16x64xbf16>) -> tensor<32x64xbf16>',
                                       '(%a) args = {dim = 0 : i64} : (tensor<16x64xbf16>) -> tensor<16x64xbf16>')
                  .replace("%c on @mesh grid_axes = [0] gather_dim = 0 : tensor<32x64xbf16> -> !dist.future<tensor<128x64xbf16>>",
                           "%c on @mesh grid_axes = [0] gather_dim = 0 : tensor<16x64xbf16> -> !dist.future<tensor<64x64xbf16>>")
                  .replace("%g = dist.wait %0 : tensor<128x64xbf16>", "%g = dist.wait %0 : tensor<64x64xbf16>")
                  .replace('"aten.view.default"(%g) args = {size = [4 : i64, 2 : i64, 16 : i64, 64 : i64]} : (tensor<128x64xbf16>)',
                           '"aten.view.default"(%g) args = {size = [4 : i64, 2 : i64, 16 : i64, 64 : i64]} : (tensor<64x64xbf16>)'))
    broken("'dist.all_gather' on @mesh grid_axes = [0] (bf16): 4096 bytes in all before the pass, "
           "2048 bytes in all after", before, fewer, same_bytes_per_group=True)
