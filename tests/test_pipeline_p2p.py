"""Stage-boundary send/recv: as the schedule runs them, Megatron's overlap, or Megatron's blocking default.

``pp_p2p`` (plan) / ``p2p`` (pipeline-split): ``schedule`` (torch's runtime: multi-stage schedules post
each recv at its RECV action and wait for it at the consuming compute, sends waited at the step's end),
``overlap`` (Megatron's ``overlap_p2p_comm``: the same on a multi-stage schedule, refused on single-stage
ones) and ``blocking`` (torch's order, each recv issued after the compute before it, every send and recv
waited before the next compute). Small pipelines from tests/test_pipeline_reuse.py's module (TP
all-reduces in the block, an asynchronous DP gradient all-reduce), lowered and simulated.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_pipeline_reuse import _lower as _reuse_lower
from test_pipeline_reuse import _module
from xdsl.context import Context
from xdsl.parser import Parser

from flint.chakra.from_ir import trace_from_ir
from flint.cost import load_device
from flint.cost.network import Network, load_network
from flint.ir import chakra, flint_context
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.passes.pipeline_split import PipelineSplitPass
from flint.plan import Plan, PlanError
from flint.sim import simulate

INTER = dict(schedule="interleaved-1f1b", microbatches=4, virtual=2)


def _split(pp: int, layers: int, **options):
    module = Parser(flint_context(), _module(pp, layers)).parse_module()
    PipelineSplitPass(stages=pp, dp_axes="dp_replicate", **options).apply(Context(), module)
    return module


def _lower(pp: int, layers: int, reuse: bool = True, **options):
    return _reuse_lower(pp, layers, reuse, **options)


def _sim(module, slow: float = 1.0, monkeypatch=None):
    if slow != 1.0:
        orig = Network.p2p_time_us
        monkeypatch.setattr(Network, "p2p_time_us", lambda self, s, d, n: slow * orig(self, s, d, n))
    return simulate(trace_from_ir(module), load_device("a100-80gb"), load_network("dgx-a100"), None)


def _p2p_exposed_us(result) -> float:
    """Send/recv time of the simulated ranks that no compute and no collective overlaps (mean)."""
    from flint.sim.engine import COMPUTE
    from flint.sim.result import _overlap, _union
    from flint.trace import NodeKind

    raw, out = result.raw, []
    for s in range(len(raw.classes)):
        t, st, en = raw.plans[s].table, raw.start_us[s], raw.finish_us[s]
        p2p = (t.kind == NodeKind.SEND) | (t.kind == NodeKind.RECV)
        other = ~p2p  # compute and collectives: a transfer under either is not what holds the rank up
        o_s, o_e = _union(st[other], en[other])
        p_s, p_e = _union(st[p2p], en[p2p])
        out.append(float(np.sum(p_e - p_s)) - _overlap(p_s, p_e, o_s, o_e))
        assert COMPUTE == 0
    return float(np.mean(out))


CASES = [("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 2, 4), ("1f1b", 2, 1, 4), ("gpipe", 2, 1, 3)]


@pytest.mark.parametrize("schedule,pp,virtual,m", CASES, ids=str)
def test_overlap_is_never_slower_than_blocking(schedule, pp, virtual, m):
    opts = dict(schedule=schedule, microbatches=m, virtual=virtual)
    layers = pp * virtual
    default = _sim(_lower(pp, layers, **opts)).iteration_time_us
    blocking = _sim(_lower(pp, layers, p2p="blocking", **opts)).iteration_time_us
    assert default > 0 and default <= blocking * (1 + 1e-12)
    if virtual > 1:  # overlap is torch's multi-stage runtime: the same program
        assert str(_split(pp, layers, p2p="overlap", **opts)) == str(_split(pp, layers, **opts)).replace(
            'grad_sync = "step"}', 'grad_sync = "step", p2p = "overlap"}')


def test_slow_link_exposes_blocking_p2p_and_overlap_hides_it(monkeypatch):
    over = _lower(2, 4, p2p="overlap", **INTER)
    block = _lower(2, 4, p2p="blocking", **INTER)
    fast = (_sim(over), _sim(block))
    slow = (_sim(over, 20.0, monkeypatch), _sim(block, 20.0, monkeypatch))
    # a 20x slower link: blocking exposes every transfer, overlap hides part of them behind compute
    assert _p2p_exposed_us(slow[0]) < 0.8 * _p2p_exposed_us(slow[1])
    assert slow[0].iteration_time_us < slow[1].iteration_time_us
    assert slow[0].exposed_comm_us.mean() < slow[1].exposed_comm_us.mean()
    # blocking's exposed p2p grows with the link time; it is not an artefact of the accounting
    assert _p2p_exposed_us(slow[1]) > 10 * _p2p_exposed_us(fast[1]) > 0


def test_blocking_recvs_are_issued_after_the_compute_before_them():
    def recv_ctrl(module):  # per pipeline rank's graph: does each recv wait for a compute node?
        out = []
        for graph in (o for o in module.walk() if isinstance(o, chakra.GraphOp)):
            comp = {o.node for o in graph.walk() if isinstance(o, chakra.CompOp)}
            out.append([any(d in comp for d in r.ctrl_deps) for r in graph.walk() if isinstance(r, chakra.RecvOp)])
        assert len(out) == 2 and all(out)
        return out

    block = _lower(2, 4, p2p="blocking", **INTER)
    rank0, rank1 = recv_ctrl(block)
    assert all(rank0) and not rank1[0] and all(rank1[1:])  # rank 1's first recv: no compute before it
    assert not any(sum(recv_ctrl(_lower(2, 4, **INTER)), []))  # torch's runtime: posted at once, waited at use
    entries = _split(2, 4, p2p="blocking", **INTER).attributes["flint.stage_schedules"].data[0].data
    posted = [e for e in entries if e.data[0].data.startswith("pp_recv")]
    assert posted and all(e.data[2].data["post"].value.data == 1 for e in posted)


def test_blocking_lowering_is_deterministic_and_reuse_exact(tmp_path):
    from flint.chakra.writer import write_trace

    a, b = _lower(2, 4, p2p="blocking", **INTER), _lower(2, 4, p2p="blocking", **INTER)
    ref = _lower(2, 4, reuse=False, p2p="blocking", **INTER)
    assert str(a) == str(b) == str(ref)
    for name, m in (("a", a), ("b", b)):
        write_trace(trace_from_ir(m), tmp_path / name)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files and files == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    ta, tb = _sim(a), _sim(ref)
    assert ta.iteration_time_us == tb.iteration_time_us
    for x, y in zip(ta.raw.finish_us, tb.raw.finish_us):
        np.testing.assert_array_equal(x, y)


def test_verify_p2p_passes_in_every_mode_and_catches_a_pipeline_deadlock():
    from xdsl.dialects.builtin import ArrayAttr

    from flint.passes.verify_p2p import P2PError, VerifyP2PPass

    for mode in ("schedule", "overlap", "blocking"):
        VerifyP2PPass().apply(Context(), _split(2, 4, p2p=mode, **INTER))

    def rank0(module, edit):
        scheds = module.attributes["flint.stage_schedules"].data
        entries = list(scheds[0].data)
        edit(entries)
        module.attributes["flint.stage_schedules"] = ArrayAttr([ArrayAttr(entries), *scheds[1:]])
        return module

    def late_send(entries):  # rank 0 sends microbatch 0's activation only after waiting for rank 1's reply
        send = entries.pop(2)
        assert send.data[0].data == "pp_send_f_p1" and entries[2].data[0].data == "pp_recv_f_p1"
        entries.insert(4, send)

    with pytest.raises(P2PError, match="can never complete"):
        VerifyP2PPass().apply(Context(), rank0(_split(2, 4, p2p="blocking", **INTER), late_send))

    def lost_recv(entries):
        i = next(i for i, e in enumerate(entries) if e.data[0].data == "pp_recv_f_p1")
        entries.pop(i)

    with pytest.raises(P2PError, match="no matching 'dist.recv'"):
        VerifyP2PPass().apply(Context(), rank0(_split(2, 4, p2p="blocking", **INTER), lost_recv))


def test_bad_modes_name_the_field():
    with pytest.raises(PlanError, match="pp_p2p.*unknown value 'eager'"):
        Plan.from_dict({"pp": 2, "microbatches": 4, "pp_p2p": "eager"}, world_size=2)
    with pytest.raises(PlanError, match="pp_p2p.*'overlap' needs a schedule with virtual stages.*'1f1b'"):
        Plan.from_dict({"pp": 2, "microbatches": 4, "pp_p2p": "overlap"}, world_size=2)
    with pytest.raises(PlanError, match="pp_p2p.*gpipe"):
        _split(2, 2, schedule="gpipe", microbatches=2, p2p="overlap")
    plan = Plan.from_dict({"pp": 2, "microbatches": 4, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2,
                           "pp_p2p": "overlap"}, world_size=2)
    assert Plan.from_dict(plan.to_dict(), world_size=2) == plan and plan.pp_p2p == "overlap"
