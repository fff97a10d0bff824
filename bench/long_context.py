"""Long completions: how one step's memory and time grow with the completion's length.

A Qwen3-shaped student and teacher built at random (2 layers, width 64, Qwen3's 151,936-token
vocabulary, so a tensor of (tokens x vocabulary) would stand out: 0.6 MB a token in float32)
take one opd step on one prompt: ``sample`` (opd's Hugging Face engine draws the completion),
``score`` (the teacher's top-k scores of it) and ``update`` (the student's forward, backward and
AdamW step), the update with and without gradient checkpointing. Each phase runs in a process
of its own (forked from one that has imported torch and opd, and nothing more): its peak is the
rise of the process's resident memory over what it held before the phase (the high-water mark
reset first; blocks of 128 KiB or more mapped on their own, so a freed one leaves), so the models,
the data, the earlier phases and what the allocator would keep are not counted. The completions
scored and trained are drawn at random (their cost does not depend on which tokens they are);
``sample`` draws its own, up to the length (a random model may stop early: the tokens it drew
are recorded).

    python bench/long_context.py --tiny --out /tmp/long-tiny.json     # 128, 256, 512 tokens, < 1
    minute python bench/long_context.py --out docs/results/long_context.json    # 2k-16k tokens

Each row is ``{phase, checkpointing, tokens, peak_bytes, seconds, seconds_per_token}``; the
summary gives each phase's bytes a token between consecutive lengths (the slope: equal slopes
are linear growth) and the last over a float32 row of the vocabulary (a (tokens x vocabulary)
tensor would make it 1 or more; opd's log-prob heads work 1024 positions at a time, a constant
that shorter completions grow into). Seconds are only comparable from a run that had
the machine to itself.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

VOCAB = 151_936
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=VOCAB,
    max_position_embeddings=40_960,
    tie_word_embeddings=True,
)
FULL = (2048, 4096, 8192, 16384)
TINY = (128, 256, 512)
PHASES = (("sample", False), ("score", False), ("update", False), ("update", True))


def build_models(root: Path) -> Path:
    """The random model (student and teacher alike) and a tokenizer of Qwen3's vocabulary size."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opd.demo.char_tokenizer import SPECIAL_TOKENS, with_chat_specials

    target = root / "qwen3-shaped"
    if (target / "config.json").exists():
        return target
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for character in "abcdefghijklmnopqrstuvwxyz0123456789 .,?\n":
        vocab.setdefault(character, len(vocab))
    for index in range(len(vocab), VOCAB):  # never produced by encoding text: the vocabulary's size
        vocab[f"<filler{index}>"] = index
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = with_chat_specials(backend)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, pad_token_id=0, eos_token_id=vocab["<|im_end|>"]))
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def memory_now() -> tuple[int, int]:
    """(resident, high-water) bytes of this process (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: blocks at least this large are mapped of their own."""


def map_large_blocks() -> None:
    """Have glibc map every block of 128 KiB or more on its own and unmap it once freed. By default
    the threshold rises to the largest block freed so far, and a phase's short-lived (vocabulary)
    rows then land in heap space that fragments and stays resident: a phase's peak would count
    what the allocator kept, not what its tensors held (up to 0.2 of a vocabulary row a token,
    seen between runs of the same sampling phase)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) refused: not glibc?")


def in_fork(function, *args) -> dict:
    """``function(*args)`` in a forked process of its own, its JSON result read from a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            text = json.dumps(function(*args))
        except BaseException as error:  # the parent raises it: the child must not return
            text = json.dumps({"error": f"{type(error).__name__}: {error}"})
        with os.fdopen(write, "w") as pipe:
            pipe.write(text)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found = json.loads(pipe.read())
    os.waitpid(pid, 0)
    if "error" in found:
        raise RuntimeError(f"{function.__name__}{args}: {found['error']}")
    return found


def phase_run(phase: str, tokens: int, checkpointing: bool, model: Path, chunk: int) -> dict:
    """One phase of one step at ``tokens`` completion tokens, in this (fresh) process."""
    import torch

    from opd.config import config_from_dict
    from opd.data.sequences import Completion, build_rollout_batch
    from opd.demo.char_tokenizer import SPECIAL_TOKENS
    from opd.trainer.batch import Batch
    from opd.trainer.loop import Trainer

    torch.manual_seed(0)
    prompts = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "count the letters of abc", "answer": "3"}) + "\n")
    config = config_from_dict(
        {
            "log_path": str(prompts.parent / "run"),
            "student": {
                "model": str(model),
                "lora_rank": 0,
                "gradient_checkpointing": checkpointing,
            },
            "teacher": {"model": str(model)},
            "datasets": [
                {"name": "long", "source": str(prompts), "groups_per_batch": 1, "group_size": 1}
            ],
            "training": {
                "max_tokens": tokens,
                "max_steps": 1,
                "micro_batch_tokens": tokens + 64,
                "logprob_chunk_size": chunk,
            },
        }
    )
    trainer = Trainer(config, progress=False)
    if phase != "sample":
        (item,) = trainer.parts.batches.batch(0)
        prompt = trainer.parts.renderer.prompt_ids(item.prompt.messages)
        ids = torch.randint(len(SPECIAL_TOKENS), VOCAB, (tokens,)).tolist()
        completion = Completion(ids, [0.0] * tokens, finished=False, policy_version=0)
        rollouts = build_rollout_batch([prompt], [completion], [0], trainer.parts.engine.pad_id)
        request = config.training.objective_for("student").teacher_request(
            config.training.temperature
        )
        teacher = trainer.parts.teachers.score(rollouts, request) if phase == "update" else None
    gc.collect()
    resident, _ = memory_now()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    started = time.perf_counter()
    if phase == "sample":
        drawn = int(trainer.collector.sample(0).rollouts.mask_BT.sum())
    elif phase == "score":
        trainer.parts.teachers.score(rollouts, request)
        drawn = tokens
    else:
        batch = Batch(
            0,
            "student",
            rollouts,
            teacher,
            {"time/sample": 0.0, "time/teacher": 0.0},
            groups_B=torch.zeros(1, dtype=torch.long),
        )
        trainer.learn(batch)
        drawn = tokens
    seconds = time.perf_counter() - started
    _, peak = memory_now()
    return {
        "phase": phase,
        "checkpointing": checkpointing,
        "tokens": drawn,
        "peak_bytes": peak - resident,
        "seconds": seconds,
        "seconds_per_token": seconds / max(drawn, 1),
    }


def summary(rows: list[dict]) -> dict:
    """Per phase: bytes a token between consecutive lengths, their spread ((largest - smallest) /
    largest), and the slope between the two longest lengths over a float32 row of the vocabulary
    (4 x 151,936 bytes): a (tokens x vocabulary) tensor anywhere would make it 1 or more. Below
    a few hundred tokens the allocator's own growth and the log-prob heads' chunk (a constant
    that short completions grow into) show in the slopes too."""
    found = {}
    for phase, checkpointing in PHASES:
        mine = sorted(
            (r for r in rows if (r["phase"], r["checkpointing"]) == (phase, checkpointing)),
            key=lambda r: r["tokens"],
        )
        slopes = [
            (b["peak_bytes"] - a["peak_bytes"]) / (b["tokens"] - a["tokens"])
            for a, b in itertools.pairwise(mine)
            if b["tokens"] > a["tokens"]
        ]
        label = phase + (" (checkpointing)" if checkpointing else "")
        found[label] = {
            "bytes_per_token_slopes": slopes,
            "slope_spread": (max(slopes) - min(slopes)) / max(slopes)
            if slopes and max(slopes) > 0
            else None,
            "last_slope_over_vocab_row": slopes[-1] / (VOCAB * 4) if slopes else None,
        }
    return found


H100_BYTES = 80 * 10**9
USABLE = 0.9
"""The share of an 80 GB H100 a run can hold (CUDA's context and the allocator's slack take
the rest: an assumption, not measured here)."""
HEAD_COPIES = 3.3
"""The log-prob head's working set in float32 vocabulary rows per chunk position (the logits,
their log-softmax and its gradient, measured on this CPU as the plateau of --tiny's score peak:
127 MB at 64 positions x 151,936 x 4 bytes)."""


def formula_per_token(shape: dict, element_bytes: int, lora: bool, checkpointing: bool) -> int:
    """opd's own estimate of the update's activations a token (the one that sizes micro-batches)."""
    from transformers import PretrainedConfig

    from opd.assemble.micro_batching import activation_bytes_per_token

    return activation_bytes_per_token(PretrainedConfig(**shape), element_bytes, lora, checkpointing)


def longest_completions(chunk: int = 1024) -> list[dict]:
    """The longest completion one update fits on an 80 GB H100 (bfloat16, the teacher elsewhere),
    for Qwen3-1.7B and -8B, LoRA rank 32 and full fine-tuning, with and without checkpointing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.hub_configs import CONFIGS, lora_parameters, parameters

    found = []
    for repo in ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"):
        shape, weights = CONFIGS[repo], parameters(repo)
        adapters = lora_parameters(repo, 32)
        head = HEAD_COPIES * chunk * shape["vocab_size"] * 4
        for mode, checkpointing in itertools.product(("lora", "full"), (True, False)):
            # full: bf16 weights and gradients, float32 moments and master weights (2+2+12 bytes);
            # LoRA: bf16 base, float32 adapters, their gradients and moments (16 bytes each)
            static = 16 * weights if mode == "full" else 2 * weights + 16 * adapters
            per_token = formula_per_token(shape, 2, mode == "lora", checkpointing)
            room = USABLE * H100_BYTES - static - head
            found.append(
                {
                    "model": repo,
                    "mode": mode,
                    "checkpointing": checkpointing,
                    "static_gb": static / 1e9,
                    "activation_kb_per_token": per_token / 1e3,
                    "longest_tokens": max(0, int(room // per_token)),
                }
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="128, 256 and 512 tokens (the CI run)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        help="training.logprob_chunk_size (default: opd's 1024; 64 with --tiny, below its lengths)",
    )
    parser.add_argument("--out", type=Path, help="the result file (JSON)")
    parser.add_argument(
        "--models", type=Path, default=Path(tempfile.gettempdir()) / "opd-long-context"
    )
    args = parser.parse_args()
    map_large_blocks()  # before torch allocates anything; each phase's fork inherits it
    import opd.trainer.loop  # noqa: F401  (imported once: each phase's fork inherits it)

    model = build_models(args.models)
    lengths = TINY if args.tiny else FULL
    chunk = args.chunk_size or (64 if args.tiny else 1024)
    rows = []
    for tokens in lengths:
        for phase, checkpointing in PHASES:
            row = in_fork(phase_run, phase, tokens, checkpointing, model, chunk)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    found = summary(rows)
    for checkpointing in (False, True):
        label = "update" + (" (checkpointing)" if checkpointing else "")
        found[label]["formula_bytes_per_token"] = formula_per_token(SHAPE, 4, False, checkpointing)
    print(json.dumps(found, indent=1))
    h100 = longest_completions()
    for row in h100:
        print(
            f"{row['model']} {row['mode']} checkpointing={row['checkpointing']}: "
            f"{row['longest_tokens']}"
        )
    settings = {"lengths": lengths, "model": SHAPE, "logprob_chunk_size": chunk}
    write_result(
        args.out, "long_context", settings, rows, summary=found, h100_longest_completion=h100
    )


if __name__ == "__main__":
    main()
