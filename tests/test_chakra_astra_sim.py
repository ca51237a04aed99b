"""ASTRA-sim adapter: config files, output parsing, and runs of the real binary (skipped, saying why, without it)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from flint.chakra import read_trace, write_trace
from flint.chakra.astra_sim import (
    GIB_PER_GB, AstraSimConfig, AstraSimError, BINARY_ENV, find_binary, logging_toml, memory_json, network_yaml,
    parse_output, roofline_safe, run_astra_sim, system_json, write_configs,
)
from flint.cost import Link, collective_time_us
from flint.errors import FlintError
from flint.trace import CollKind, NodeKind, NodeTableBuilder, RankProgram, Trace

from chakra_helpers import ASTRA_SKIP_REASON, DATA, REAL_ASTRA_SIM, fsdp_tp_trace

SAMPLES = DATA / "astra_sim"
needs_astra = pytest.mark.skipif(REAL_ASTRA_SIM is None, reason=ASTRA_SKIP_REASON)


def test_network_yaml_converts_to_astra_sims_units():
    """Flint's GB/s become GiB/s; a Switch message takes two hops, so it gets half the latency per hop."""
    cfg = AstraSimConfig.simple(["Ring", "Switch"], [4, 2], [50, 25.5], [500, 1000])
    lines = [ln for ln in network_yaml(cfg).splitlines() if not ln.startswith("#")]
    assert lines == [
        "topology: [ Ring, Switch ]",
        "npus_count: [ 4, 2 ]",
        f"bandwidth: [ {50 * GIB_PER_GB!r}, {25.5 * GIB_PER_GB!r} ]",
        "latency: [ 500.0, 500.0 ]",
    ]
    assert cfg.npus_count == 8


def test_system_json_keys_and_algorithms_per_dimension():
    cfg = AstraSimConfig.simple(["Ring", "Switch"], [4, 2], [50, 50], [500, 500], all_reduce=("ring", "direct"),
                                roofline=True, peak_tflops=989.0, roofline_mem_bw_gbps=2680.0)
    d = json.loads(system_json(cfg))
    assert d["all-reduce-implementation"] == ["ring", "direct"]
    assert d["all-gather-implementation"] == ["ring", "ring"]  # one name replicated per dimension
    assert d["roofline-enabled"] == 1 and d["peak-perf"] == 989.0
    assert d["local-mem-bw"] == 2680.0  # ASTRA-sim's roofline uses local-mem-bw as its memory roof
    assert d["scheduling-policy"] == "LIFO" and d["collective-optimization"] == "localBWAware"
    # Flint's model: no dataset splits, no endpoint delay (1 ns is ASTRA-sim's minimum), no local memory time.
    off = json.loads(system_json(AstraSimConfig.simple("Ring", 4, 50, 500)))
    assert off["preferred-dataset-splits"] == 1 and off["endpoint-delay"] == 1 and off["local-mem-bw"] >= 1e6
    assert off["roofline-enabled"] == 0 and "peak-perf" not in off
    assert json.loads(memory_json()) == {"memory-type": "NO_MEMORY_EXPANSION"}
    assert 'name = "workload"' in logging_toml()


def test_config_validation():
    with pytest.raises(FlintError, match="Torus"):
        AstraSimConfig.simple("Torus", 4, 50, 500)
    with pytest.raises(FlintError, match="peak_tflops"):
        AstraSimConfig.simple("Ring", 4, 50, 500, roofline=True)
    with pytest.raises(FlintError, match="3 algorithms for a 2-dimension"):
        AstraSimConfig.simple(["Ring", "Ring"], [2, 2], [1, 1], [1, 1], all_reduce=("ring", "ring", "ring"))
    with pytest.raises(FlintError, match="at least 1 ns"):
        AstraSimConfig.simple("Ring", 4, 50, 500, endpoint_delay=0)
    with pytest.raises(FlintError, match="positive bandwidth"):
        AstraSimConfig.simple("Ring", 4, float("nan"), 500)


def test_write_configs_under_fixed_names(tmp_path):
    files = write_configs(AstraSimConfig.simple("Ring", 4, 50, 500), tmp_path / "cfg")
    assert (files.dir / files.network).read_text().count("topology: [ Ring ]") == 1
    assert json.loads((files.dir / files.system).read_text())["all-reduce-implementation"] == ["ring"]
    assert json.loads((files.dir / files.groups).read_text()) == {}
    assert "empty" not in files.groups and (files.dir / files.memory).exists() and (files.dir / files.logging).exists()


def test_parse_successful_run():
    res = parse_output((SAMPLES / "ok_allreduce_4ranks.txt").read_text(), 4)
    assert res.cycles == {0: 43000, 1: 43000, 2: 43000, 3: 43000}
    assert res.exposed_comm_cycles[2] == 43000 and res.iteration_cycles == 43000


def test_deadlock_with_exit_code_zero_is_a_failure():
    with pytest.raises(AstraSimError, match=r"did not finish 2 of 4 ranks \(2, 3\); it reports unreleased nodes"):
        parse_output((SAMPLES / "deadlock_4ranks.txt").read_text(), 4)


def test_missing_finish_lines_are_a_failure():
    text = (SAMPLES / "ok_allreduce_4ranks.txt").read_text()
    with pytest.raises(AstraSimError, match=r"did not finish 4 of 8 ranks \(4, 5, 6, 7\); its output has no finish line"):
        parse_output(text, 8)


def test_finish_lines_printed_twice_and_a_teardown_crash_are_a_success():
    """The synchronous logger and ASTRA-sim's default sink both print each finish line; exit 134 after all finished is the teardown bug."""
    text = (SAMPLES / "ok_allreduce_4ranks.txt").read_text() * 2 + "malloc_consolidate(): unaligned fastbin chunk detected\n"
    res = parse_output(text, 4, returncode=134)
    assert res.iteration_cycles == 43000 and res.teardown_status == 134
    with pytest.raises(AstraSimError, match="did not finish 4 of 8 ranks .* exited with status -6"):
        parse_output(text, 8, returncode=-6)


def test_binary_lookup(monkeypatch, tmp_path):
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "nope"))
    with pytest.raises(AstraSimError, match="does not exist or is not executable"):
        find_binary()
    monkeypatch.delenv(BINARY_ENV)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AstraSimError, match=f"set {BINARY_ENV}"):
        find_binary()


def test_world_size_must_match_network(tmp_path):
    write_trace(fsdp_tp_trace(), tmp_path / "t", "s")
    exe = tmp_path / "astra"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    with pytest.raises(AstraSimError, match="network has 8 NPUs .* but the trace has 4 ranks"):
        run_astra_sim(tmp_path / "t", AstraSimConfig.simple("Ring", 8, 50, 500), binary=exe)


# -- the real binary ------------------------------------------------------------------


def _one_collective(kind: CollKind, n: int, nbytes: int) -> Trace:
    b = NodeTableBuilder()
    b.add_coll("c", kind, nbytes, -1)
    t = b.build()
    return Trace(n, [RankProgram(t) for _ in range(n)], {})


_FLINT_TOPOLOGY = {"Ring": "ring", "Switch": "switch", "FullyConnected": "fully-connected"}


@needs_astra
@pytest.mark.parametrize("topology", ["Ring", "Switch", "FullyConnected"])
@pytest.mark.parametrize("kind", [CollKind.ALL_REDUCE, CollKind.ALL_GATHER, CollKind.REDUCE_SCATTER])
def test_single_collectives_match_flints_formula(tmp_path, topology, kind):
    """With the converted units, hops and splits, ASTRA-sim's ring collectives take what collective_time_us says."""
    n, nbytes, bw, lat_us = 8, 1 << 24, 50.0, 2.0
    write_trace(_one_collective(kind, n, nbytes), tmp_path / "t", "c")
    res = run_astra_sim(tmp_path / "t", AstraSimConfig.simple(topology, n, bw, lat_us * 1e3), binary=REAL_ASTRA_SIM)
    flint = collective_time_us(kind, nbytes, n, Link(bw, lat_us, _FLINT_TOPOLOGY[topology]))
    assert res.iteration_cycles / 1e3 == pytest.approx(flint, rel=2e-4)  # ASTRA-sim adds 1 ns endpoint delay per step


@needs_astra
def test_all_to_all_is_where_the_models_differ(tmp_path):
    """ASTRA-sim's ring all-to-all relays chunks around the ring: (n-1)/2 of the buffer, Flint's pairwise (n-1)/n."""
    n, nbytes = 8, 1 << 24
    write_trace(_one_collective(CollKind.ALL_TO_ALL, n, nbytes), tmp_path / "t", "c")
    res = run_astra_sim(tmp_path / "t", AstraSimConfig.simple("Switch", n, 50.0, 0.0), binary=REAL_ASTRA_SIM)
    flint = collective_time_us(CollKind.ALL_TO_ALL, nbytes, n, Link(50.0, 0.0, "switch"))
    assert res.iteration_cycles / 1e3 == pytest.approx(flint * n / 2, rel=1e-3)


@needs_astra
def test_relative_work_dir_and_paths_naming_empty(tmp_path, monkeypatch):
    """Config paths are resolved; a trace or work directory whose path says "empty" keeps its comm groups."""
    trace = fsdp_tp_trace(dp=2, tp=2)
    write_trace(trace, tmp_path / "plain", "s")
    write_trace(trace, tmp_path / "empty_traces", "s")
    cfg = AstraSimConfig.simple("Switch", 4, 50.0, 2000.0)
    ref = run_astra_sim(tmp_path / "plain", cfg, binary=REAL_ASTRA_SIM)
    monkeypatch.chdir(tmp_path)
    got = run_astra_sim("empty_traces/s", cfg, binary=REAL_ASTRA_SIM, work_dir="runs/empty")
    assert got.cycles == ref.cycles
    assert (tmp_path / "runs" / "empty" / "comm_groups.json").is_file()
    # Were the groups ignored, every collective would span all 4 ranks and take longer.
    from flint.cost import load_network
    from flint.sim import simulate

    sim = simulate(read_trace(tmp_path / "plain"), None, load_network("switch"))
    assert got.iteration_cycles / 1e3 == pytest.approx(sim.iteration_time_us, rel=2e-3)


@needs_astra
def test_sub_group_run_that_crashes_in_teardown_reports_every_rank(tmp_path):
    """Sub-group collectives on a one-dimensional network: every rank finishes, then ASTRA-sim may crash."""
    write_trace(fsdp_tp_trace(dp=4, tp=2), tmp_path / "t", "s")
    res = run_astra_sim(tmp_path / "t", AstraSimConfig.simple("Switch", 8, 50.0, 1000.0), binary=REAL_ASTRA_SIM)
    assert sorted(res.cycles) == list(range(8)) and len(set(res.cycles.values())) == 1


@needs_astra
def test_flints_stream_and_sms_attributes_are_ignored_by_astra_sim(tmp_path):
    """ASTRA-sim reads attributes by name: Flint's comm_stream (string) and comm_sms (int32) neither abort
    it nor change its answer."""
    from dataclasses import replace

    n = 4
    programs = []
    for r in range(n):
        b = NodeTableBuilder()
        c = b.add_comp("gemm", duration_us=20.0, flops=1 << 30, tensor_bytes=1 << 20)
        b.add_coll("ar", CollKind.ALL_REDUCE, 1 << 22, -1, data_deps=[c], stream="dp")
        b.add_send("s", 1 << 20, (r + 1) % n, 0, data_deps=[c], stream="send:0", sms=16)
        b.add_recv("r", 1 << 20, (r - 1) % n, 0, stream="recv:0")
        programs.append(RankProgram(b.build()))
    marked = Trace(n, programs, {})
    assert marked.ranks[0].table.comm_sms is not None and marked.ranks[0].table.stream_names == ("dp", "send:0", "recv:0")
    bare = Trace(n, [RankProgram(replace(p.table, comm_stream=None, stream_names=(), comm_sms=None)) for p in programs], {})
    write_trace(marked, tmp_path / "marked", "t")
    write_trace(bare, tmp_path / "bare", "t")
    assert (tmp_path / "marked" / "t.0.et").read_bytes() != (tmp_path / "bare" / "t.0.et").read_bytes()
    cfg = AstraSimConfig.simple("Ring", n, 50.0, 500.0)
    got = run_astra_sim(tmp_path / "marked", cfg, binary=REAL_ASTRA_SIM)
    ref = run_astra_sim(tmp_path / "bare", cfg, binary=REAL_ASTRA_SIM)
    assert sorted(got.cycles) == list(range(n)) and got.cycles == ref.cycles


@needs_astra
def test_a_deadlocking_trace_is_a_failure_though_astra_sim_exits_0(tmp_path):
    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, 1 << 20, -1)
    full = b.build()
    b = NodeTableBuilder()
    b.add_comp("only compute", duration_us=5.0, flops=10, tensor_bytes=10)
    lone = b.build()
    write_trace(Trace(4, [RankProgram(full)] * 3 + [RankProgram(lone)], {}), tmp_path / "t", "d")
    with pytest.raises(AstraSimError, match="did not finish 3 of 4 ranks"):
        run_astra_sim(tmp_path / "t", AstraSimConfig.simple("Ring", 4, 50.0, 500.0), binary=REAL_ASTRA_SIM, timeout_s=60)


def test_roofline_safe_sets_the_zero_side_to_one():
    b = NodeTableBuilder()
    b.add_comp("copy", flops=0, tensor_bytes=1 << 30)
    b.add_comp("flops only", flops=1 << 40, tensor_bytes=0)
    b.add_comp("timed", duration_us=3.0, flops=0, tensor_bytes=8)
    t = b.build()
    safe = roofline_safe(Trace(2, [RankProgram(t)] * 2, {}))
    st = safe.ranks[0].table
    assert safe.ranks[1].table is st
    assert st.flops.tolist() == [1, 1 << 40, 0] and st.tensor_bytes.tolist() == [1 << 30, 1, 8]
    assert roofline_safe(safe) is None


@needs_astra
def test_roofline_prices_memory_only_and_compute_only_nodes(tmp_path):
    """Without roofline_safe, a num_ops-0 node deadlocks ASTRA-sim's roofline; with it both nodes get their time."""
    b = NodeTableBuilder()
    c = b.add_comp("copy", flops=0, tensor_bytes=1 << 30)
    b.add_comp("gemm", flops=10 ** 12, tensor_bytes=0, data_deps=[c])
    t = b.build()
    trace = Trace(2, [RankProgram(t)] * 2, {})
    cfg = AstraSimConfig.simple("Ring", 2, 50.0, 500.0, roofline=True, peak_tflops=500.0, roofline_mem_bw_gbps=2000.0)
    write_trace(roofline_safe(trace), tmp_path / "t", "r")
    res = run_astra_sim(tmp_path / "t", cfg, binary=REAL_ASTRA_SIM, timeout_s=60)
    want_us = (1 << 30) / 2000e3 + 1e12 / 500e6
    assert res.iteration_cycles / 1e3 == pytest.approx(want_us, rel=1e-3)
