"""Regenerate the chakra_converter fixture: a real 2-rank gloo CPU run.

Each rank runs a tiny step (matmul, all_gather_into_tensor,
reduce_scatter_tensor, all_reduce, a send/recv pair) under
``torch.profiler.ExecutionTraceObserver``; the host traces are then converted
with ``chakra_converter PyTorch``. Run from the repository root:

    .venv/bin/python tests/data/chakra/make_converter_fixture.py

It writes ``tests/data/chakra/converter/step.{0,1}.et`` (the JSON host traces
are large and are not kept).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent


def _run(rank: int, world: int, tmp: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29533"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.randn(8, 8)
    w = torch.randn(8, 8)
    obs = torch.profiler.ExecutionTraceObserver()
    obs.register_callback(f"{tmp}/host.{rank}.json")
    obs.start()
    y = x @ w
    out = torch.empty(16, 8)
    dist.all_gather_into_tensor(out, y)
    rs = torch.empty(4, 8)
    dist.reduce_scatter_tensor(rs, y, op=dist.ReduceOp.SUM)
    dist.all_reduce(rs)
    if rank == 0:
        dist.send(rs, dst=1, tag=7)
    else:
        dist.recv(rs, src=0, tag=7)
    z = torch.relu(rs).sum()
    obs.stop()
    obs.unregister_callback()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    world = 2
    out_dir = HERE / "converter"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(world, tmp), nprocs=world, join=True)
        out_dir.mkdir(exist_ok=True)
        conv = Path(sys.executable).parent / "chakra_converter"
        for r in range(world):
            subprocess.run([str(conv), "--log-filename", f"{tmp}/conv.log", "PyTorch", "--input",
                            f"{tmp}/host.{r}.json", "--output", str(out_dir / f"step.{r}.et")], check=True)


if __name__ == "__main__":
    main()
