"""Run under torchrun by tests/test_streamed_weights.py: an FSDP2-sharded student's weights streamed
in buckets against the same weights gathered whole; rank 0 writes what it found as JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from opd.demo.char_tokenizer import build_char_tokenizer
from opd.policy.config import StudentConfig
from opd.policy.lora import apply_lora
from opd.policy.parallel import parallel_mode
from opd.policy.policy import Policy
from tests.conftest import tiny_llama


def main(out: str, lora_rank: int) -> None:
    dist.init_process_group("gloo")
    tokenizer = build_char_tokenizer()
    student = StudentConfig("tiny", lora_rank=lora_rank)
    model = apply_lora(tiny_llama(len(tokenizer), seed=5, tie=False), student)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # B starts at 0: make the merge change the weights
    policy = Policy(model, len(tokenizer))
    policy.parallel = parallel_mode("fsdp")
    policy.parallelize()
    with policy.gathered():
        whole = {name: tensor.clone() for name, tensor in policy.sampler_weights(torch.float32)}
    found = {"names": sorted(whole)}
    for label, bucket_bytes in (("one_unit", 1), ("all", 2**40)):
        streamed = list(policy.streamed_sampler_weights(torch.float32, bucket_bytes))
        found[label] = {
            "names": sorted(name for name, _ in streamed),
            "count": len(streamed),
            "max_difference": max(
                float((tensor - whole[name]).abs().max()) for name, tensor in streamed
            ),
        }
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(found, handle)
    # both ranks leave together: a rank that tears gloo down while the other still writes its
    # result was seen to abort at exit (std::terminate on a joinable gloo thread)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
