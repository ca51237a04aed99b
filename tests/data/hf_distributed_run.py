"""A real training step of a Hugging Face model distributed by transformers' own FSDP2 and expert parallelism, for
the test that checks shard-expand against it
(tests/test_shard_expand.py::test_hugging_face_collectives_match_transformers_run).

Run by ``torchrun --standalone --nproc-per-node N hf_distributed_run.py MODEL FSDP EP AC REPLICATE`` on gloo (N = FSDP
x REPLICATE): MODEL, a factory of tests/data/byom/hf_models.py (MoE models: ``mixtral``, ``qwen3_moe``,
``deepseek_v3``, ``granitemoe``, ``phimoe``; a dense one with frozen weights: ``llama_frozen_attention``),
distributed by transformers 5.23 (``DistributedConfig(fsdp_size=FSDP, ep_size=EP, dp_replicate_size=REPLICATE)``:
FSDP2 (HSDP with REPLICATE > 1, DDP-like replicas with FSDP 1), under EP > 1 ``AllToAllEP`` with the experts on
their ``efsdp`` mesh), a global batch of 4 x 32 tokens, AdamW; with AC ``full``, Hugging Face's
``gradient_checkpointing_enable`` (every decoder layer, non-reentrant; ``none``: without). An MoE model's routing
is made balanced, as Flint models it: the router's (``mlp.gate``'s or ``router``'s) GEMM and softmax run, and
expert ``(t * top_k + j) % E`` is chosen for token ``t``'s ``j``-th slot. The second step's collectives, by kind
and phase (forward, backward, optimizer): count and input bytes, printed as JSON by rank 0.
"""
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# op -> (kind, index of its input tensor)
KIND = {"c10d.alltoall_base_": ("all_to_all", 1), "_c10d_functional.all_to_all_single": ("all_to_all", 0),
        "c10d._allgather_base_": ("all_gather", 1), "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
        "c10d.allreduce_": ("all_reduce", 0), "c10d.allgather_": ("all_gather", 1),
        "c10d.reduce_scatter_": ("reduce_scatter", 1), "c10d.alltoall_": ("all_to_all", 1),
        "c10d.broadcast_": ("broadcast", 0)}


class Collectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "fwd"
        self.count, self.bytes, self.unknown = Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in KIND:
            kind, i = KIND[name]
            t = args[i]
            while isinstance(t, (list, tuple)):
                t = t[0]
            self.count[f"{kind} {self.phase}"] += 1
            self.bytes[f"{kind} {self.phase}"] += t.numel() * t.element_size()
        elif name.startswith("c10d.") or name.startswith("_c10d_functional.") and "wait" not in name and \
                "wrap" not in name:
            self.unknown[name] += 1
        return func(*args, **(kwargs or {}))


def balanced_router(self, hidden_states):
    """A router's forward (Mixtral's, Qwen3-MoE's, DeepSeek-V3's, Granite-MoE's, PhiMoE's: ``weight``
    ``[experts, hidden]``, ``top_k``, returning logits, weights, expert ids) with the experts chosen balanced."""
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype))
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    slot = torch.arange(probs.shape[0]).unsqueeze(1) * self.top_k + torch.arange(self.top_k)
    idx = slot % self.weight.shape[0]
    top = torch.gather(probs, 1, idx)
    return logits, top / top.sum(dim=-1, keepdim=True), idx


def main():
    name, fsdp, ep, ac, replicate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo")
    from transformers.distributed import DistributedConfig

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "byom"))
    import hf_models

    torch.manual_seed(0)
    model = getattr(hf_models, name)()
    routers = {type(m) for n, m in model.named_modules() if n.endswith(("mlp.gate", ".router")) and hasattr(m, "top_k")}
    assert routers or ep == 1, f"{name}: no router (a mlp.gate or router with top_k)"
    for router in routers:
        router.forward = balanced_router
    if ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = DistributedConfig(fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
    cfg, _, mesh = type(model).prepare_distribute_model(config)
    model = type(model).maybe_distribute_model(model, cfg, mesh)
    ids = torch.randint(0, 256, (4 // (fsdp * replicate), 32))
    report_second_step(model, {"input_ids": ids, "labels": ids})


def report_second_step(model, batch: dict) -> None:
    """Two training steps of ``model`` on ``batch`` with AdamW (the first initializes the optimizer state); rank 0
    prints the second step's collectives as JSON; then the process group ends."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        seen = Collectives()
        with seen:
            out = model(**batch)
            loss = out.loss if hasattr(out, "loss") else out
            seen.phase = "bwd"
            loss.backward()
            seen.phase = "optim"
            opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(json.dumps({"count": seen.count, "bytes": seen.bytes, "unknown": seen.unknown}, sort_keys=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
