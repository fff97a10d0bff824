"""Run by tests/test_master_weights.py under torchrun: a bfloat16 model sharded with FSDP2,
three steps of opd's AdamW on the same input on every process; writes rank 0's view of the
float32 master weights and the parameters, gathered, to the JSON file named by argv[1]."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from opd.assemble.optimizer import adamw


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=generator).bfloat16() for _ in range(3)]


def train(module: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = adamw(list(module.parameters()), lr=3e-5, betas=(0.9, 0.95), eps=1e-8)
    for inputs in batches():
        module(inputs).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


if __name__ == "__main__":
    dist.init_process_group("gloo")
    sharded = model()
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    optimizer = train(sharded)
    found = {
        name: {
            "master": optimizer.state[parameter]["master"].full_tensor().tolist(),
            "parameter": parameter.full_tensor().float().tolist(),
            "dtype": str(parameter.dtype),
        }
        for name, parameter in sharded.named_parameters()
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as file:
            json.dump(found, file)
    # both ranks leave together: a rank that tears gloo down while the other still writes its
    # result was seen to abort at exit (std::terminate on a joinable gloo thread)
    dist.barrier()
    dist.destroy_process_group()
