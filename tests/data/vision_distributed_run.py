"""A real training step of a vision model of tests/data/byom/hf_models.py under PyTorch's own data parallelism,
for the test that checks the planned path against it
(tests/test_shard_expand.py::test_vision_models_expand_and_agree_with_the_captured_path).

Run by ``torchrun --standalone --nproc-per-node 2 vision_distributed_run.py MODEL MODE INPUTS`` on gloo: MODEL, a
factory of hf_models.py; MODE ``fsdp`` (FSDP2's ``fully_shard``) or ``dp`` (FSDP2-based ``replicate``), applied as a
training script (and Flint's preset) does: to every layer of the stack Flint's ``find_layers`` finds (a ResNet's
stages), then to the root; INPUTS, Flint's ``--inputs`` syntax with global shapes (dim 0 split over the two ranks).
BatchNorm runs as in any DDP / FSDP run: each rank's own batch statistics. The second step's collectives, by kind
and phase (forward, backward, optimizer): count and input bytes, printed as JSON by rank 0.
"""
import os
import sys

import torch
import torch.distributed as dist
from hf_distributed_run import report_second_step
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "byom"))
import hf_models  # noqa: E402

from flint.capture.byom import find_layers, parse_inputs  # noqa: E402


def main() -> None:
    name, mode, inputs = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = getattr(hf_models, name)()
    wrap = (lambda m: fully_shard(m, mesh=mesh)) if mode == "fsdp" else (lambda m: replicate(m, mesh=mesh))
    stack = find_layers(model)
    for layer in model.get_submodule(stack.path).children():
        wrap(layer)
    wrap(model)
    batch = {}
    for key, spec in parse_inputs(inputs).items():
        shape = (spec.shape[0] // world, *spec.shape[1:])
        batch[key] = torch.randint(0, 10, shape) if spec.dtype == torch.int64 else torch.randn(shape)
    report_second_step(model, batch)

if __name__ == "__main__":
    main()
