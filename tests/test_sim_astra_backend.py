"""`flint simulate --backend astra-sim` end to end, with the real ASTRA-sim binary (skipped, saying why, without it).

The comparison with Flint's own simulator on real captured FSDP, TP and
FSDP+TP traces is the README's table (``test_astra_sim_agrees_with_flint``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flint.chakra.astra_sim import BINARY_ENV
from flint.cost import load_network
from flint.errors import FlintError
from flint.sim.cli import astra_sim_config, simulate_main

from chakra_helpers import ASTRA_SKIP_REASON, REAL_ASTRA_SIM
from test_sim_lifetimes import TRAIN

DATA = Path(__file__).parent / "data" / "chakra"
needs_astra = pytest.mark.skipif(REAL_ASTRA_SIM is None, reason=ASTRA_SKIP_REASON)


def run(argv, capsys):
    rc = simulate_main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@needs_astra
def test_ir_input_writes_trace_and_configs_and_reports_every_rank(tmp_path, capsys, monkeypatch):
    ir = tmp_path / "train.mlir"
    ir.write_text(TRAIN)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run([ir, "--backend", "astra-sim", "--astra-sim", REAL_ASTRA_SIM, "--network", "ring", "--json",
                        "--work-dir", "cfg"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["backend"] == "astra-sim" and rep["world_size"] == 2 and set(rep["finish_us"]) == {"0", "1"}
    rc, nat, err = run([ir, "--network", "ring", "--json"], capsys)
    assert rc == 0, err
    assert rep["iteration_time_us"] == pytest.approx(json.loads(nat)["iteration_time_us"], rel=0.02)
    assert (tmp_path / "cfg" / "system.json").is_file() and rep["work_dir"] == str(tmp_path / "cfg")
    assert json.loads((tmp_path / "cfg" / "comm_groups.json").read_text()) == {"1": [0, 1]}


@needs_astra
def test_trace_without_durations_runs_on_astra_sims_roofline(monkeypatch, capsys):
    """symbolic_tensor_graph-style traces carry FLOPs but no durations."""
    monkeypatch.setenv(BINARY_ENV, REAL_ASTRA_SIM)
    rc, out, err = run([DATA / "stg", "--backend", "astra-sim", "--network", "ring", "--device", "b200", "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["roofline"] is True and rep["iteration_time_us"] > 0


@needs_astra
def test_comm_groups_option_overrides_the_file_beside_the_trace(tmp_path, capsys):
    from flint.chakra import write_trace

    from chakra_helpers import fsdp_tp_trace

    write_trace(fsdp_tp_trace(), tmp_path / "t", "s")
    groups = tmp_path / "t" / "s.comm_groups.json"
    moved = tmp_path / "groups.json"
    groups.rename(moved)
    rc, _, err = run([tmp_path / "t", "--backend", "astra-sim", "--astra-sim", REAL_ASTRA_SIM, "--network", "switch"], capsys)
    assert rc == 1 and "uses comm group" in err and "--comm-groups" in err
    rc, out, err = run([tmp_path / "t", "--backend", "astra-sim", "--astra-sim", REAL_ASTRA_SIM, "--network", "switch",
                        "--comm-groups", moved], capsys)
    assert rc == 0, err


def test_missing_binary_and_unsupported_topology(tmp_path, capsys):
    rc, _, err = run([DATA / "stg", "--backend", "astra-sim", "--astra-sim", tmp_path / "nope"], capsys)
    assert rc == 1 and "does not exist or is not executable" in err
    rc, _, err = run([DATA / "stg", "--backend", "astra-sim", "--astra-sim", tmp_path / "nope", "--network",
                      "wafer-2d-mesh"], capsys)
    assert rc == 1 and "supports ring, switch, fully-connected" in err


def test_two_level_network_config():
    # dgx-h100 at 16 ranks: NVLink island of 8 x 2 nodes; at 4 ranks the island shrinks, the IB dimension drops.
    cfg = astra_sim_config(load_network("dgx-h100"), 16, {"all_reduce": "halving-doubling"})
    assert [(d.topology, d.npus, d.bandwidth_gbps, d.latency_ns) for d in cfg.dims] == \
        [("Switch", 8, 450.0, 1000.0), ("Switch", 2, 50.0, 3000.0)]
    assert cfg.all_reduce == ("halvingDoubling", "halvingDoubling") and cfg.all_gather == ("ring", "ring")
    assert [d.npus for d in astra_sim_config(load_network("dgx-h100"), 4).dims] == [4]
    with pytest.raises(FlintError, match="at least 2 ranks"):
        astra_sim_config(load_network("ring"), 1)


# -- ASTRA-sim vs Flint's simulator on captured steps -------------------------------------

#: plan -> TP degree of the captured tiny-Llama steps at 8 ranks (shared with other test modules' captures).
COMPARED = {"fsdp": 1, "tp": 8, "fsdp+tp": 2}


@needs_astra
@pytest.mark.slow
@pytest.mark.parametrize("plan", list(COMPARED))
def test_astra_sim_agrees_with_flint(plan, tmp_path, capsys):
    """Both simulators run the same emitted trace files: iteration times agree within 1% on one-level networks
    with Flint's SM sharing off (ASTRA-sim does not slow compute under communication), and within 2% with it on
    (the share of compute that overlaps communication, which ASTRA-sim runs at full speed)."""
    from captures import imported
    from xdsl.printer import Printer

    _, module = imported("llama-tiny", plan, 8, COMPARED[plan])
    ir = tmp_path / "step.mlir"
    with open(ir, "w") as f:
        Printer(stream=f).print_op(module)
    from flint.tools.flint_cli import main as flint_main

    assert flint_main(["emit", str(ir), "-o", str(tmp_path / "trace")]) == 0
    capsys.readouterr()
    rows = []
    for network in ("switch", "ring"):
        argv = [tmp_path / "trace", "--network", network, "--json"]
        rc, out, err = run([*argv, "--backend", "astra-sim", "--astra-sim", REAL_ASTRA_SIM], capsys)
        assert rc == 0, err
        astra = json.loads(out)["iteration_time_us"]
        nosm = tmp_path / "no-sm-sharing.toml"
        nosm.write_text("comm_sms = 0\n")
        for label, extra in (("", []), (" (SM sharing off)", ["--calibration", nosm])):
            rc, out, err = run([*argv, *extra], capsys)
            assert rc == 0, err
            flint = json.loads(out)["iteration_time_us"]
            rows.append((f"{plan} {network}: ASTRA-sim {astra:.1f} us, Flint{label} {flint:.1f} us, "
                         f"ratio {astra / flint:.4f}", astra / flint, 0.01 if extra else 0.02))
    print("\n".join(text for text, _, _ in rows))
    for text, ratio, tolerance in rows:
        assert abs(ratio - 1) < tolerance, text
