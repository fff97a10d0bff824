"""What a run shows while it trains: its progress bar, a coloured view of one sample (what was
prompt, what was trained on, where the teacher disagreed), and the per-step sample records it
keeps."""

from __future__ import annotations

import torch

from opd.data.sequences import RolloutBatch

RESET = "\033[0m"
DIM = "\033[2m"
COLOURS = ("\033[32m", "\033[33m", "\033[31m")  # green, yellow, red
KL_THRESHOLDS = (0.1, 1.0)


def colorize_example(
    tokenizer, input_ids: list[int], mask: list[float], reverse_kl: torch.Tensor | None
) -> str:
    """Prompt tokens dim; trained tokens green / yellow / red as their reverse KL is <0.1, <1, >=1
    nats.

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


def first_row_per_dataset(dataset_index_B: torch.Tensor) -> dict[int, int]:
    """The first row of each dataset in a batch: the one shown and recorded per step."""
    rows: dict[int, int] = {}
    for row, dataset_index in enumerate(dataset_index_B.tolist()):
        rows.setdefault(dataset_index, row)
    return rows


def sample_records(
    tokenizer,
    dataset_names: list[str],
    step: int,
    batch: RolloutBatch,
    reverse_kl_BT: torch.Tensor | None,
) -> list[dict]:
    """One sample per dataset for ``samples.jsonl``: prompt, completion tokens, their KL (None in
    SFT)."""
    records = []
    for dataset_index, row in first_row_per_dataset(batch.dataset_index_B).items():
        length = int(batch.attention_mask_BT[row].sum())
        start = batch.prompt_lengths[row]
        ids = batch.input_ids_BT[row, :length].tolist()
        records.append(
            {
                "step": step,
                "dataset": dataset_names[dataset_index],
                "prompt": tokenizer.decode(ids[:start]),
                "tokens": [tokenizer.decode([t]) for t in ids[start:]],
                "token_kl": None
                if reverse_kl_BT is None
                else [round(float(v), 4) for v in reverse_kl_BT[row, start:length]],
            }
        )
    return records


def examples(
    tokenizer, dataset_names: list[str], batch: RolloutBatch, reverse_kl_BT: torch.Tensor | None
) -> str:
    """One coloured sample per dataset (``training.show_examples``)."""
    shown = []
    for dataset_index, row in first_row_per_dataset(batch.dataset_index_B).items():
        length = int(batch.attention_mask_BT[row].sum())
        text = colorize_example(
            tokenizer,
            batch.input_ids_BT[row, :length].tolist(),
            batch.mask_BT[row, :length].tolist(),
            None if reverse_kl_BT is None else reverse_kl_BT[row],
        )
        shown.append(f"--- {dataset_names[dataset_index]}\n{text}")
    return "\n".join(shown)


PROGRESS_KEYS = {"teacher_kl": "kl", "entropy": "H", "completion_len_mean": "len"}
"""The metrics the progress bar shows, by the short names that keep it within 80 columns."""
PROGRESS_FORMAT = (
    "{desc} |{bar:6}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
)
"""A bar of fixed width, so a narrow terminal shortens nothing (tqdm's own shrinks the bar to a
character and cuts the metrics)."""


def show_phase(bar, phase: str) -> None:
    """Name on the bar what the run is doing between steps (an evaluation or a checkpoint can
    take minutes on a real model); the next step's metrics replace it."""
    bar.postfix = phase
    bar.refresh()


def progress_postfix(metrics: dict) -> str:
    """``kl 0.123 H 0.456 len 4.5``: the step's main metrics for the bar."""
    return " ".join(
        f"{short} {metrics[key]:.3g}" for key, short in PROGRESS_KEYS.items() if key in metrics
    )
