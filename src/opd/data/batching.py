"""Deterministic batches: step i of a run always sees the same prompts, which makes resume exact."""

from __future__ import annotations

import random
from dataclasses import dataclass

from opd.data.prompts import DataError, Prompt


@dataclass(frozen=True)
class BatchItem:
    """A prompt picked for a step, with the dataset it came from."""

    dataset_index: int
    prompt: Prompt


class CompositeBatches:
    """Each step takes ``groups_per_batch[d]`` prompts from every dataset ``d``.

    Every dataset is shuffled once with ``seed`` (and its index); the number of steps in
    one pass is set by the dataset that runs out first.
    """

    def __init__(
        self, datasets: list[list[Prompt]], groups_per_batch: list[int], names: list[str], seed: int
    ):
        self.orders: list[list[Prompt]] = []
        for index, (prompts, per_batch, name) in enumerate(
            zip(datasets, groups_per_batch, names, strict=True)
        ):
            if len(prompts) < per_batch:
                raise DataError(
                    f"dataset '{name}': {len(prompts)} prompts, fewer than one batch of "
                    f"groups_per_batch={per_batch}; add prompts or lower groups_per_batch"
                )
            order = list(prompts)
            random.Random(f"{seed}/{index}").shuffle(order)
            self.orders.append(order)
        self.groups_per_batch = groups_per_batch

    def __len__(self) -> int:
        return min(len(order) // n for order, n in zip(self.orders, self.groups_per_batch, strict=True))

    def batch(self, step: int) -> list[BatchItem]:
        """The prompts of step ``step`` (wrapping around after one pass)."""
        items = []
        for index, (order, per_batch) in enumerate(zip(self.orders, self.groups_per_batch, strict=True)):
            passes = len(order) // per_batch
            start = (step % passes) * per_batch
            items.extend(BatchItem(index, prompt) for prompt in order[start : start + per_batch])
        return items
