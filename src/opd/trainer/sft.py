"""Supervised fine-tuning on given completions: the off-policy baseline; also builds the demo
models."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import torch

from opd.assemble.optimizer import lr_factor
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.data.sequences import pad_right
from opd.logprobs import sequence_logprobs
from opd.models import module_device


def completion_tokens(renderer: ChatRenderer, prompt: Prompt) -> tuple[list[int], list[int]]:
    """Prompt ids and target ids (the reference completion, or the answer, then the stop token)."""
    prompt_ids = renderer.prompt_ids(prompt.messages)
    text = prompt.completion if prompt.completion is not None else prompt.answer
    if text is None:
        raise ValueError("supervised fine-tuning needs a 'completion' or 'answer' on every prompt")
    target = renderer.tokenizer(text, add_special_tokens=False)["input_ids"] + [
        renderer.stop_token_ids[0]
    ]
    return prompt_ids, target


def supervised_finetune(
    model,
    renderer: ChatRenderer,
    prompts: list[Prompt],
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int = 0,
    should_stop: Callable[[int], bool] | None = None,
    on_step: Callable[[float], None] | None = None,
) -> list[float]:
    """Minimise the completion tokens' negative log-likelihood; LR decays linearly to 0.

    ``should_stop(steps_done)`` is asked after every step and ends training early when True;
    ``on_step(loss)`` hears of every step (a progress bar).
    Returns the per-step losses (mean NLL per completion token).
    """
    device = module_device(model)
    rng = random.Random(seed)
    parameters = [p for p in model.parameters() if p.requires_grad]
    # torch's default (looped) AdamW on purpose: the demo's tiny models are built here, and the
    # fused kernel's other rounding grows into different models (the demo would start elsewhere)
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8)
    decay = functools.partial(lr_factor, warmup_steps=0, total_steps=steps, schedule="linear")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    pad_id = renderer.tokenizer.pad_token_id or 0
    losses = []
    model.train()
    for _ in range(steps):
        sequences, masks = [], []
        for prompt in rng.sample(prompts, min(batch_size, len(prompts))):
            prompt_ids, target = completion_tokens(renderer, prompt)
            sequences.append(prompt_ids + target)
            masks.append([0] * len(prompt_ids) + [1] * len(target))
        ids, attention = pad_right(sequences, pad_id)
        mask, _ = pad_right(masks, 0)
        mask = mask.float().to(device)
        logprobs, _ = sequence_logprobs(model, ids.to(device), attention.to(device), mask)
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(losses[-1])
        if should_stop is not None and should_stop(len(losses)):
            break
    model.eval()
    return losses
