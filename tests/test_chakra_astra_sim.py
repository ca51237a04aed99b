"""ASTRA-sim adapter: config files, output parsing, and (only with a real binary) a run."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from flint.chakra import write_trace
from flint.chakra.astra_sim import (
    AstraSimConfig, AstraSimError, DEFAULT_BINARY, BINARY_ENV, find_binary, memory_json, network_yaml, parse_output,
    run_astra_sim, system_json, write_configs,
)
from flint.errors import FlintError

from chakra_helpers import DATA, fsdp_tp_trace

SAMPLES = DATA / "astra_sim"


def test_network_yaml_per_dimension():
    cfg = AstraSimConfig.simple(["Ring", "Switch"], [4, 2], [50, 25.5], [500, 1000])
    assert network_yaml(cfg) == (
        "topology: [ Ring, Switch ]\n"
        "npus_count: [ 4, 2 ]\n"
        "bandwidth: [ 50.0, 25.5 ]  # GB/s\n"
        "latency: [ 500.0, 1000.0 ]  # ns\n"
    )
    assert cfg.npus_count == 8


def test_system_json_keys_and_algorithms_per_dimension():
    cfg = AstraSimConfig.simple(["Ring", "Switch"], [4, 2], [50, 50], [500, 500], all_reduce=("ring", "direct"),
                                roofline=True, peak_tflops=989.0)
    d = json.loads(system_json(cfg))
    assert d["all-reduce-implementation"] == ["ring", "direct"]
    assert d["all-gather-implementation"] == ["ring", "ring"]  # one name replicated per dimension
    assert d["roofline-enabled"] == 1 and d["peak-perf"] == 989.0
    assert d["scheduling-policy"] == "LIFO" and d["collective-optimization"] == "localBWAware"
    for k in ("endpoint-delay", "active-chunks-per-dimension", "preferred-dataset-splits", "local-mem-bw", "boost-mode"):
        assert k in d
    off = json.loads(system_json(AstraSimConfig.simple("Ring", 4, 50, 500)))
    assert off["roofline-enabled"] == 0 and "peak-perf" not in off
    assert json.loads(memory_json()) == {"memory-type": "NO_MEMORY_EXPANSION"}


def test_config_validation():
    with pytest.raises(FlintError, match="Torus"):
        AstraSimConfig.simple("Torus", 4, 50, 500)
    with pytest.raises(FlintError, match="peak_tflops"):
        AstraSimConfig.simple("Ring", 4, 50, 500, roofline=True)
    with pytest.raises(FlintError, match="3 algorithms for a 2-dimension"):
        AstraSimConfig.simple(["Ring", "Ring"], [2, 2], [1, 1], [1, 1], all_reduce=("ring", "ring", "ring"))


def test_write_configs(tmp_path):
    files = write_configs(AstraSimConfig.simple("Ring", 4, 50, 500), tmp_path / "cfg")
    assert files.network.read_text().startswith("topology: [ Ring ]")
    assert json.loads(files.system.read_text())["all-reduce-implementation"] == ["ring"]
    assert files.memory.exists()


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


def test_adapter_plumbing_with_a_stand_in_binary(tmp_path):
    """A shell stand-in checks the command line ASTRA-sim would get, then exits 0 having finished only some ranks."""
    write_trace(fsdp_tp_trace(), tmp_path / "t", "s")
    exe = tmp_path / "astra"
    exe.write_text(
        "#!/bin/sh\n"
        "for a in \"$@\"; do case $a in\n"
        "  --workload-configuration=*) w=${a#*=};;\n"
        "  --comm-group-configuration=*) g=${a#*=};;\n"
        "  --system-configuration=*) s=${a#*=};;\n"
        "  --remote-memory-configuration=*) m=${a#*=};;\n"
        "  --network-configuration=*) n=${a#*=};;\n"
        "esac; done\n"
        "test -f \"$w.0.et\" && test -f \"$w.3.et\" && test -f \"$g\" && test -f \"$s\" && test -f \"$m\" && test -f \"$n\" || exit 3\n"
        "grep -q 'npus_count: \\[ 4 \\]' \"$n\" || exit 4\n"
        f"cat {SAMPLES / 'deadlock_4ranks.txt'}\n"
        "exit 0\n"
    )
    exe.chmod(0o755)
    with pytest.raises(AstraSimError, match="unreleased nodes"):
        run_astra_sim(tmp_path / "t", AstraSimConfig.simple("Ring", 4, 50, 500), binary=exe)


_REAL = os.environ.get(BINARY_ENV) or shutil.which(DEFAULT_BINARY)


@pytest.mark.slow
@pytest.mark.skipif(not _REAL, reason=f"ASTRA-sim binary not available (set {BINARY_ENV})")
def test_real_astra_sim_run(tmp_path):
    from flint.trace import CollKind, NodeTableBuilder, RankProgram, Trace

    b = NodeTableBuilder()
    b.add_coll("ar", CollKind.ALL_REDUCE, 1 << 20, -1)
    t = b.build()
    write_trace(Trace(4, [RankProgram(t)] * 4, {}), tmp_path / "t", "ar")
    res = run_astra_sim(tmp_path / "t", AstraSimConfig.simple("Ring", 4, 50, 500))
    assert set(res.cycles) == {0, 1, 2, 3}
    assert res.iteration_cycles == pytest.approx(43000, rel=0.05)  # CHAKRA.md reference point
