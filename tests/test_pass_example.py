"""The worked example package (examples/flint-pass-example) installs with pip and its pass,
registered through the `flint.passes` entry point, runs in flint-opt, lit and flint estimate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "flint-pass-example"
GOLDEN = EXAMPLE / "tests" / "gather-at-start.mlir"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict:
    """pip-install the example (no network: no deps, no build isolation) into a directory on the path."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(EXAMPLE)], check=True, capture_output=True)
    assert (target / "flint_pass_example-0.1.0.dist-info" / "entry_points.txt").read_text().count("gather-at-start")
    env = dict(os.environ, PYTHONPATH=str(target), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    return env


def run(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, cwd=ROOT)


@pytest.mark.slow
def test_flint_opt_runs_the_installed_pass(site):
    helped = run(site, sys.executable, "-m", "flint.tools.flint_opt", "--help")
    assert "gather-at-start" in helped.stdout and "[plug-in]" in helped.stdout
    assert "or a plug-in) is recorded on a module with a plan (flint.scheduled_by)" in " ".join(helped.stdout.split())
    res = run(site, sys.executable, "-m", "flint.tools.flint_opt", str(GOLDEN), "-p", "gather-at-start{kind=all}")
    assert res.returncode == 0, res.stderr
    body = [line.strip() for line in res.stdout.splitlines() if "dist." in line]
    assert [b.split(" = ")[1].split(" ")[0] for b in body[:3]] == ["dist.all_gather"] * 2 + ["dist.reduce_scatter"]
    bad = run(site, sys.executable, "-m", "flint.tools.flint_opt", str(GOLDEN), "-p", "gather-at-start{kind=some}")
    assert bad.returncode == 1 and "option kind must be 'all_gather' or 'all'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_example_golden_and_its_checker_test_pass(site):
    lit = run(site, str(BIN / "lit"), "-q", str(EXAMPLE / "tests"))
    assert lit.returncode == 0, lit.stdout + lit.stderr
    pyt = run(site, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"))
    assert pyt.returncode == 0, pyt.stdout + pyt.stderr
    assert "1 passed" in pyt.stdout


@pytest.mark.slow
def test_flint_estimate_runs_the_installed_pass(site):
    def estimate(passes: str) -> dict:
        res = run(site, str(BIN / "flint"), "estimate", str(GOLDEN), "--passes", passes, "--json")
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    plain, early = estimate(""), estimate("gather-at-start")
    assert early["passes"] == "gather-at-start"
    # the second gather now runs under the first matmul: less communication is exposed
    assert early["exposed_comm_us"]["max"] < plain["exposed_comm_us"]["max"]
    assert early["comm_time_us"]["max"] == pytest.approx(plain["comm_time_us"]["max"])
