"""Named streams and SMs travel through Chakra files: a trace written and read back simulates exactly as
the IR it came from (durations rounded to the file's whole microseconds), and the chakra dialect keeps
them too (``read_trace -> trace_to_ir -> trace_from_concrete_ir``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from captures import imported
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage
from xdsl.context import Context

from flint.chakra import TraceError, read_trace, write_trace
from flint.chakra.from_ir import mesh_of, trace_from_ir
from flint.chakra.to_ir import trace_from_concrete_ir, trace_to_ir
from flint.cost import load_device, load_network
from flint.passes.lower_to_chakra import LowerToChakraPass
from flint.passes.micro_pipeline_tp import MicroPipelineTPPass, rewrite
from flint.schedule.pipelines import run_pipeline
from flint.sim import simulate
from flint.trace import NodeKind, RankProgram, Trace

from chakra_helpers import dir_bytes

DEVICE, NETWORK = "h100-sxm", "dgx-h100"


def _fsdp_streams():
    """FSDP x TP with the data-parallel collectives on their own stream, beside TP's."""
    _, module = imported("llama-tiny", "fsdp+tp", 8, 2)
    m = module.clone()
    run_pipeline(m, "reorder-all-gather{prefetch=1},sink-waits,assign-streams{data-parallel=dp}")
    return m


def _async_tp_sms():
    """TP + SP under async TP: the pieces' sends on the "symm_mem" stream, the reduce-scatter's holding 16 SMs."""
    _, module = imported("llama-tiny", "tp+sp", 2, 2)
    m = module.clone()
    rewrite(m, MicroPipelineTPPass(sms=16))
    return m


def _decomposed_channels():
    """FSDP's collectives decomposed into send/recv rings on 2 channels (channel streams, eager sends, the
    reductions' compute on the channels' streams)."""
    _, module = imported("llama-tiny", "fsdp", 4)
    m = module.clone()
    run_pipeline(m, "sink-waits,decompose-collectives{algorithm=ring channels=2}")
    return m


CASES = {"fsdp-streams": _fsdp_streams, "async-tp-sms": _async_tp_sms, "ring-channels": _decomposed_channels}


def _trace(make):
    m = make()
    LowerToChakraPass(device=DEVICE).apply(Context(), m)
    return trace_from_ir(m), mesh_of(m)


def _as_written(trace: Trace) -> Trace:
    """``trace`` with the durations a Chakra file keeps: whole microseconds, 0 read back as "none"."""
    tables: dict[int, object] = {}
    ranks = []
    for p in trace.ranks:
        t = p.table
        if id(t) not in tables:
            d = np.round(t.duration_us)
            tables[id(t)] = replace(t, duration_us=np.where(d == 0, np.nan, d))
        ranks.append(RankProgram(tables[id(t)], p.group_ids, p.peer_ranks))
    return Trace(trace.world_size, ranks, trace.comm_groups)


def _sim(trace, mesh, slow=True):
    """``slow``: on a 2 GB/s NVLink, where the tiny model's communication outlasts its compute, so where it
    queues shows in the step time (the SMs async TP's sends hold show on the real one)."""
    net = load_network(NETWORK)
    if slow:
        net = net.with_link("nvlink", bandwidth_gbytes_per_s=2.0)
    return simulate(trace, load_device(DEVICE), net, mesh, algorithm="auto")


@pytest.mark.parametrize("case", list(CASES))
def test_trace_read_back_simulates_as_the_ir(tmp_path, case):
    trace, mesh = _trace(CASES[case])
    t0 = trace.ranks[0].table
    assert t0.comm_stream is not None and (t0.comm_stream >= 0).any()
    write_trace(trace, tmp_path / "a", "t")
    back = read_trace(tmp_path / "a")
    b0 = back.ranks[0].table
    for r in range(trace.world_size):  # every row keeps its stream's name and its SMs
        src, got = trace.ranks[r].table, back.ranks[r].table
        name = lambda t, i: t.stream_names[t.comm_stream[i]] if t.comm_stream[i] >= 0 else ""  # noqa: E731
        assert [name(got, i) for i in range(len(got))] == [name(src, i) for i in range(len(src))]
        want = src.comm_sms if src.comm_sms is not None else np.zeros(len(src), np.int16)
        have = got.comm_sms if got.comm_sms is not None else np.zeros(len(got), np.int16)
        assert np.array_equal(have, want)
    if case == "async-tp-sms":
        assert b0.comm_sms is not None and set(b0.comm_sms[b0.kind == NodeKind.SEND].tolist()) == {0, 16}
    slow = case != "async-tp-sms"
    ref, got = _sim(_as_written(trace), mesh, slow), _sim(back, mesh, slow)
    assert got.iteration_time_us == ref.iteration_time_us
    assert np.array_equal(got.finish_us, ref.finish_us)
    assert np.array_equal(got.exposed_comm_us, ref.exposed_comm_us)
    # without the streams (all of a rank's collectives on one queue, sends without SMs) the step differs:
    # what the files lost before they carried them
    bare = Trace(back.world_size, [RankProgram(replace(p.table, comm_stream=None, stream_names=(), comm_sms=None),
                                               p.group_ids, p.peer_ranks) for p in back.ranks], back.comm_groups)
    assert _sim(bare, mesh, slow).iteration_time_us != ref.iteration_time_us
    write_trace(back, tmp_path / "b", "t")  # and a rewrite is byte-identical
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


@pytest.mark.parametrize("case", ["async-tp-sms", "ring-channels"])
def test_chakra_dialect_keeps_streams_and_sms(tmp_path, case):
    trace, mesh = _trace(CASES[case])
    write_trace(trace, tmp_path / "a", "t")
    back = read_trace(tmp_path / "a")
    module = trace_to_ir(back)
    text = str(module)
    assert 'stream = "' in text and (case != "async-tp-sms" or "sms = 16" in text)
    again = trace_from_concrete_ir(module)
    assert _sim(again, mesh).iteration_time_us == _sim(back, mesh).iteration_time_us
    write_trace(again, tmp_path / "b", "t")
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


def _attr(name, **kw):
    a = pb.AttributeProto(name=name)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _one_send(tmp_path, *attrs):
    with open(tmp_path / "t.0.et", "wb") as f:
        encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
        encodeMessage(f, pb.Node(id=3, name="s", type=pb.COMM_SEND_NODE, attr=[
            _attr("comm_size", int64_val=8), _attr("comm_tag", int32_val=0), _attr("comm_dst", int32_val=0), *attrs]))


@pytest.mark.parametrize("attr,message", [
    (_attr("comm_sms", int32_val=2000), r"node 3 .*'comm_sms' is 2000; it must be 0\.\.1024"),
    (_attr("comm_stream", string_val=""), r"node 3 .*'comm_stream' is empty"),
])
def test_bad_stream_attributes_are_named(tmp_path, attr, message):
    _one_send(tmp_path, attr)
    with pytest.raises(TraceError, match=message):
        read_trace(tmp_path)


def test_sms_on_a_node_that_is_not_a_send_is_refused(tmp_path):
    with open(tmp_path / "t.0.et", "wb") as f:
        encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
        encodeMessage(f, pb.Node(id=5, name="r", type=pb.COMM_RECV_NODE, attr=[
            _attr("comm_size", int64_val=8), _attr("comm_tag", int32_val=0), _attr("comm_src", int32_val=0),
            _attr("comm_sms", int32_val=8)]))
    with pytest.raises(TraceError, match=r"node 5 .*'comm_sms' on a node of type 6; only a send"):
        read_trace(tmp_path)


def test_streams_of_a_foreign_trace_are_read(tmp_path):
    """A file of another generator can put a node on a named stream with the same attribute."""
    _one_send(tmp_path, _attr("comm_stream", string_val="p2p"), _attr("comm_sms", int32_val=8))
    t = read_trace(tmp_path).ranks[0].table
    assert t.stream_names == ("p2p",) and t.comm_stream.tolist() == [0] and t.comm_sms.tolist() == [8]


def test_inspect_lists_the_named_streams(tmp_path):
    from flint.chakra.inspect import format_table, summarize

    trace, _ = _trace(_async_tp_sms)
    write_trace(trace, tmp_path / "a", "t")
    summary = summarize(read_trace(tmp_path / "a"))
    text = format_table(summary)
    sends = summary["rank_classes"][0]["sms_sends"]
    assert sends > 0 and summary["rank_classes"][0]["streams"]["symm_mem"] > sends
    assert f"symm_mem {summary['rank_classes'][0]['streams']['symm_mem']}, {sends} send(s) holding SMs" in text
