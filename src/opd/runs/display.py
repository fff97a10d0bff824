"""A coloured view of one sample: what was prompt, what was trained on, where the teacher disagreed."""

from __future__ import annotations

import torch

RESET = "\033[0m"
DIM = "\033[2m"
COLOURS = ("\033[32m", "\033[33m", "\033[31m")  # green, yellow, red
KL_THRESHOLDS = (0.1, 1.0)


def colorize_example(
    tokenizer, input_ids: list[int], mask: list[float], reverse_kl: torch.Tensor | None
) -> str:
    """Prompt tokens dim; trained tokens green / yellow / red as their reverse KL is <0.1, <1, >=1 nats.

    Without a KL (SFT has no teacher forward) trained tokens are shown plain.
    """
    pieces = []
    for position, token in enumerate(input_ids):
        text = tokenizer.decode([token])
        if not mask[position]:
            pieces.append(f"{DIM}{text}{RESET}")
            continue
        if reverse_kl is None:
            pieces.append(text)
            continue
        kl = float(reverse_kl[position])
        level = sum(kl >= threshold for threshold in KL_THRESHOLDS)
        pieces.append(f"{COLOURS[level]}{text}{RESET}")
    legend = (
        f"{DIM}[prompt]{RESET} {COLOURS[0]}[KL<0.1]{RESET} {COLOURS[1]}[KL<1]{RESET} "
        f"{COLOURS[2]}[KL>=1]{RESET}"
    )
    return "".join(pieces) + "\n" + legend
