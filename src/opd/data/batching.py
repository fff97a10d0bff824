"""Deterministic batches: step i of a run always sees the same prompts, which makes resume exact."""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import accumulate, pairwise

from opd.data.prompts import DataError, Prompt


@dataclass(frozen=True)
class BatchItem:
    """A prompt picked for a step, with the dataset it came from."""

    dataset_index: int
    prompt: Prompt


class CompositeBatches:
    """Each step takes ``groups_per_batch[d]`` prompts from every dataset ``d``.

    Every pass over a dataset is a fresh shuffle seeded by ``seed``, the dataset's index and
    the pass number, so a multi-epoch run neither repeats one batch order nor always leaves
    out the same remainder prompts. The number of steps in one pass is set by the dataset
    that runs out first.
    """

    def __init__(
        self, datasets: list[list[Prompt]], groups_per_batch: list[int], names: list[str], seed: int
    ):
        for prompts, per_batch, name in zip(datasets, groups_per_batch, names, strict=True):
            if len(prompts) < per_batch:
                raise DataError(
                    f"dataset '{name}': {len(prompts)} prompts, fewer than one batch of "
                    f"groups_per_batch={per_batch}; add prompts or lower groups_per_batch"
                )
        self.datasets = datasets
        self.groups_per_batch = groups_per_batch
        self.seed = seed
        self._current_pass: dict[int, tuple[int, list[Prompt]]] = {}
        """Per dataset: the pass last asked for, and its order."""

    def __len__(self) -> int:
        return min(
            len(prompts) // n
            for prompts, n in zip(self.datasets, self.groups_per_batch, strict=True)
        )

    def order(self, dataset_index: int, pass_index: int) -> list[Prompt]:
        """Dataset ``dataset_index`` in the order of its pass ``pass_index``."""
        cached = self._current_pass.get(dataset_index)
        if cached is None or cached[0] != pass_index:
            order = list(self.datasets[dataset_index])
            # pass 0 keeps the seed string of the single-shuffle version: old runs replay exactly
            suffix = f"/{pass_index}" if pass_index else ""
            random.Random(f"{self.seed}/{dataset_index}{suffix}").shuffle(order)
            cached = self._current_pass[dataset_index] = (pass_index, order)
        return cached[1]

    def batch(self, step: int) -> list[BatchItem]:
        """The prompts of step ``step``; a dataset's next pass starts when it runs out."""
        items = []
        for index, (prompts, per_batch) in enumerate(
            zip(self.datasets, self.groups_per_batch, strict=True)
        ):
            pass_index, position = divmod(step, len(prompts) // per_batch)
            start = position * per_batch
            items.extend(
                BatchItem(index, prompt)
                for prompt in self.order(index, pass_index)[start : start + per_batch]
            )
        return items


def contiguous_slices(total: int, parts: int) -> list[slice]:
    """``parts`` near-equal contiguous slices of ``range(total)`` (empty ones dropped)."""
    bounds = [round(i * total / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in pairwise(bounds) if b > a]


def token_bins(
    lengths: list[int], max_tokens: int | None, max_rows: int | None, *, padded: bool
) -> list[list[int]]:
    """Row indices grouped into micro-batches of at most ``max_tokens`` tokens and ``max_rows``
    rows.

    Without a token budget: contiguous runs of ``max_rows`` rows (all rows when None). With one,
    rows are taken longest first (ties by index) and each goes into the first micro-batch it
    fits (first-fit decreasing); a micro-batch costs the sum of its lengths when packed, its row
    count times its longest row when ``padded``. The same lengths always give the same groups,
    each listed in row order. A row longer than the budget gets a micro-batch of its own.
    """
    total = len(lengths)
    if max_tokens is None:
        parts = -(-total // max_rows) if max_rows else 1
        return [list(range(part.start, part.stop)) for part in contiguous_slices(total, parts)]
    bins: list[list[int]] = []
    costs: list[int] = []
    for row in sorted(range(total), key=lambda i: (-lengths[i], i)):
        for index, members in enumerate(bins):
            grown = (
                (len(members) + 1) * lengths[members[0]] if padded else costs[index] + lengths[row]
            )
            if grown <= max_tokens and (max_rows is None or len(members) < max_rows):
                members.append(row)
                costs[index] = grown
                break
        else:
            bins.append([row])
            costs.append(lengths[row])
    return [sorted(members) for members in bins]


def split_to(bins: list[list[int]], count: int) -> list[list[int]]:
    """``bins`` split until there are ``count`` of them: the one with most rows is halved each
    time (the first such), so every process can run as many forwards as the busiest one."""
    bins = [list(members) for members in bins]
    while len(bins) < count:
        index = max(range(len(bins)), key=lambda i: len(bins[i]))
        members = bins[index]
        if len(members) < 2:
            raise ValueError(f"cannot split {len(bins)} micro-batches of one row each into {count}")
        half = len(members) // 2
        bins[index : index + 1] = [members[:half], members[half:]]
    return bins


def rank_split_problem(group_sizes: list[int], num_substeps: int, world_size: int) -> str | None:
    """Why a step's rows cannot be shared out by :func:`rank_rows` (None when they can)."""
    total = sum(group_sizes)
    if world_size == 1:
        return None
    if total % (num_substeps * world_size):
        return f"{total} sequences do not split into {num_substeps * world_size} equal parts"
    starts = set(accumulate(group_sizes, initial=0))
    share = total // (num_substeps * world_size)
    cuts = [part * share for part in range(num_substeps * world_size)]
    broken = [cut for cut in cuts if cut not in starts]
    if broken:
        return f"part boundaries at sequence {broken[0]} would split a prompt's group"
    return None


def rank_rows(group_sizes: list[int], num_substeps: int, world_size: int, rank: int) -> list[int]:
    """The rows of a step (numbered in one process's order) that process ``rank`` works on.

    Each optimizer substep's slice of the batch is cut into ``world_size`` equal runs of whole
    groups and process ``rank`` takes the ``rank``-th of each, so that every substep of every
    process sees its share of the same sequences one process would: N processes make the same
    update as one. :func:`rank_split_problem` says when no such cut exists.
    """
    total = sum(group_sizes)
    if world_size == 1:
        return list(range(total))
    share = total // (num_substeps * world_size)
    rows = []
    for substep in range(num_substeps):
        start = (substep * world_size + rank) * share
        rows.extend(range(start, start + share))
    return rows
