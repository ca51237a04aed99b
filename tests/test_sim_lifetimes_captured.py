"""Peak memory of real captured steps (llama-tiny): the IR-side accounting agrees with the capture's own facts."""

from __future__ import annotations

import math

import pytest
from captures import imported

from flint.sim.lifetimes import step_memory

pytestmark = pytest.mark.slow  # each capture compiles with dynamo/AOTAutograd (~10 s)


def captured(plan: str):
    return imported("llama-tiny", plan, 8, 2 if "tp" in plan else 1)


def role_bytes(step, kind: str) -> int:
    total = 0
    for part in step.parts:
        for role in part.optim.roles.values():
            if role.kind == kind:
                total += math.prod(role.local_shape) * role.dtype.itemsize * part.repeat
    return total


@pytest.mark.parametrize("plan", ["dp", "fsdp+tp"])
def test_captured_step_memory_matches_the_capture(plan):
    step, module = captured(plan)
    mem = step_memory(module)
    r = mem.report
    assert mem.notes == ()  # every backward found its forward
    params = role_bytes(step, "parameter")
    assert r.category_peak_bytes["params"] == params
    assert r.category_peak_bytes["optimizer"] == 2 * params + role_bytes(step, "step")
    # Every parameter gets exactly one gradient of its own shape, kept to the end of the step.
    assert r.category_peak_bytes["grads"] == params
    assert r.category_peak_bytes["activations"] > 0
    # Nothing but resident state, gradients and the step's loss outlives the step.
    resident = params + r.category_peak_bytes["optimizer"] + r.category_peak_bytes["grads"]
    assert resident <= r.live_bytes[-1] <= resident + r.category_peak_bytes["other"] + 64
