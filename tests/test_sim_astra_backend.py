"""`flint simulate --backend astra-sim` end to end with a stand-in ASTRA-sim executable.

The real binary is not installable here. The stand-in is a Python script that
does what the adapter depends on: it reads the command line ASTRA-sim gets,
opens the rank files and config files it names (failing like ASTRA-sim when
one is missing), records them, and prints ASTRA-sim's finish lines
(``sys[i] finished, <T> cycles, exposed communication <E> cycles.``) for the
ranks it is told to finish, so both success and the "not every rank
finished" failure go through the real adapter code.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from flint.chakra.astra_sim import BINARY_ENV
from flint.cost import load_network
from flint.errors import FlintError
from flint.sim.cli import astra_sim_config, simulate_main

from test_sim_lifetimes import TRAIN

DATA = Path(__file__).parent / "data" / "chakra"

FAKE = r'''#!{python}
import json, os, re, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
net = open(args["network-configuration"]).read()
npus = 1
for n in re.search(r"npus_count: \[(.*)\]", net).group(1).split(","):
    npus *= int(n)
for r in range(npus):
    if not os.path.isfile(f"{{args['workload-configuration']}}.{{r}}.et"):
        print(f"[workload] [critical] cannot open {{args['workload-configuration']}}.{{r}}.et")
        sys.exit(1)
log = {{"argv": sys.argv[1:], "network": net, "system": json.load(open(args["system-configuration"])),
        "memory": json.load(open(args["remote-memory-configuration"])),
        "groups": json.load(open(args["comm-group-configuration"])), "cwd": os.getcwd()}}
json.dump(log, open(os.environ["FAKE_ASTRA_LOG"], "w"))
finish = int(os.environ.get("FAKE_ASTRA_FINISH", npus))
for r in range(finish):
    print(f"[2026-01-20 10:02:11.403] [workload] [info] sys[{{r}}] finished, {{1000 * (r + 5)}} cycles, exposed communication {{100 * r}} cycles.")
for r in range(finish, npus):
    print(f"[2026-01-20 10:02:11.404] [workload] [error] Hardware Resource sys.id={{r}} has unreleased nodes!")
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    exe = tmp_path / "AstraSim_fake"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    log = tmp_path / "astra_log.json"
    monkeypatch.setenv("FAKE_ASTRA_LOG", str(log))
    monkeypatch.delenv(BINARY_ENV, raising=False)
    return exe, log


def run(argv, capsys):
    rc = simulate_main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_ir_input_writes_trace_and_configs_and_reports_every_rank(tmp_path, fake, capsys):
    exe, log = fake
    ir = tmp_path / "train.mlir"
    ir.write_text(TRAIN)
    rc, out, err = run([ir, "--backend", "astra-sim", "--astra-sim", exe, "--network", "ring", "--json",
                        "--work-dir", tmp_path / "cfg"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["backend"] == "astra-sim" and rep["world_size"] == 2
    assert rep["finish_us"] == {"0": 5.0, "1": 6.0}
    assert rep["exposed_comm_us"] == {"0": 0.0, "1": 0.1}
    assert rep["iteration_time_us"] == 6.0
    rec = json.loads(log.read_text())
    # The ring preset: one dimension, 50 GB/s, 0.5 us = 500 ns per hop; lowered durations, no roofline.
    assert "topology: [ Ring ]" in rec["network"] and "npus_count: [ 2 ]" in rec["network"]
    assert "bandwidth: [ 50.0 ]" in rec["network"] and "latency: [ 500.0 ]" in rec["network"]
    assert rec["system"]["all-gather-implementation"] == ["ring"] and rec["system"]["roofline-enabled"] == 0
    assert rec["memory"] == {"memory-type": "NO_MEMORY_EXPANSION"}
    assert rec["groups"] == {"1": [0, 1]}
    flags = [a.split("=")[0] for a in rec["argv"]]
    assert flags == ["--workload-configuration", "--comm-group-configuration", "--system-configuration",
                     "--remote-memory-configuration", "--network-configuration"]
    assert (tmp_path / "cfg" / "system.json").is_file()  # --work-dir keeps the configs


def test_trace_input_is_used_in_place_with_roofline_and_env_binary(fake, monkeypatch, capsys):
    exe, log = fake
    monkeypatch.setenv(BINARY_ENV, str(exe))
    rc, out, err = run([DATA / "stg", "--backend", "astra-sim", "--network", "ring", "--algorithm", "tree",
                        "--device", "b200"], capsys)
    assert rc == 0, err
    assert "iteration time (ms)" in out and re.search(r"^\s+1\s+0\.006\s+0\.000", out, re.M)
    rec = json.loads(log.read_text())
    assert rec["argv"][0] == f"--workload-configuration={(DATA / 'stg' / 'stg').resolve()}"
    # stg compute nodes carry FLOPs but no durations: ASTRA-sim's roofline prices them at the device peak.
    assert rec["system"]["roofline-enabled"] == 1 and rec["system"]["peak-perf"] == pytest.approx(2250.0, rel=0.2)
    assert rec["system"]["all-reduce-implementation"] == ["doubleBinaryTree"]


def test_ranks_that_did_not_finish_are_a_failure(tmp_path, fake, monkeypatch, capsys):
    exe, _ = fake
    monkeypatch.setenv("FAKE_ASTRA_FINISH", "1")
    rc, out, err = run([DATA / "stg", "--backend", "astra-sim", "--astra-sim", exe, "--network", "ring"], capsys)
    assert rc == 1 and out == ""
    assert "ASTRA-sim did not finish 1 of 2 ranks (1)" in err and "unreleased nodes" in err
    assert "Traceback" not in err


def test_missing_binary_and_unsupported_topology(tmp_path, fake, capsys):
    rc, _, err = run([DATA / "stg", "--backend", "astra-sim", "--astra-sim", tmp_path / "nope"], capsys)
    assert rc == 1 and "does not exist or is not executable" in err
    exe, _ = fake
    rc, _, err = run([DATA / "stg", "--backend", "astra-sim", "--astra-sim", exe, "--network", "wafer-2d-mesh"], capsys)
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
