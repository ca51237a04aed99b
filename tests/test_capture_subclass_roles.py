"""Placeholders of tensor-subclass inputs keep their roles: a DTensor parameter flattens into its
``_local_tensor`` and its ``device_mesh`` under AOTAutograd, so the forward graph has more
placeholders than Dynamo inputs; roles come from AOTAutograd's input descriptors then. Before,
every placeholder of a TP block became ``unknown`` and pipeline-split found no stage boundary."""

import contextlib
import io

import pytest

from flint.tools.flint_cli import main


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["", 'activation_checkpoint = "full"\nsp = true\n'])
def test_tp_pipeline_capture_keeps_activation_and_parameter_roles(tmp_path, extra):
    plan = tmp_path / "plan.toml"
    plan.write_text("tp = 2\npp = 2\nmicrobatches = 2\n" + extra)
    out = tmp_path / "step.mlir"
    err = io.StringIO()  # `flint capture` by its CLI entry point, in this process (no second torch import)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["capture", "--model", "gpt2-tiny", "--world-size", "4", "--plan-file", str(plan), "-o", str(out)])
    assert rc == 0, err.getvalue()[-2000:]
    text = out.read_text()
    block = next(line for line in text.splitlines() if "func.func @block_fwd" in line)
    assert 'flint.role = "activation"' in block
    # every parameter of the block (4 attention + 2 MLP linears with biases, 2 norms) keeps its role
    assert block.count('flint.role = "parameter"') == 16
