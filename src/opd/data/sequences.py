"""Token sequences as every later stage sees them: sampled completions, and the padded batch of
``prompt + completion`` rows that teachers score and the update trains on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt.

    ``logprobs[i]`` is the sampler's log-probability of ``token_ids[i]`` under the
    distribution it actually sampled from (temperature applied). ``finished`` is False
    when ``max_tokens`` cut the completion before a stop token or string.
    ``policy_version`` is the student's version (optimizer steps taken) whose weights
    sampled it; None when the student did not write it (a teacher or a dataset did).
    """

    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    policy_version: int | None = None


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, right-padded."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention[row, : len(sequence)] = 1
    return ids, attention


@dataclass
class RolloutBatch:
    """Sequences ``prompt + completion``, right-padded to (B, T).

    ``mask_BT`` is 1 exactly on sampled completion tokens (the stop token included) and 0 on
    prompt and padding; ``sampled_logprobs_BT`` holds the sampler's log-probs there.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    mask_BT: torch.Tensor
    sampled_logprobs_BT: torch.Tensor
    dataset_index_B: torch.Tensor
    finished_B: torch.Tensor
    prompt_lengths: list[int]
    messages: list = field(default_factory=list)
    """Each row's conversation, for teachers that render prompts their own way."""
    policy_version_B: torch.Tensor | None = None
    """The student's version that sampled each row (-1 where the student did not)."""

    @property
    def sequences(self) -> list[list[int]]:
        """The unpadded token ids of each sequence."""
        lengths = self.attention_mask_BT.sum(-1).tolist()
        return [row[:n].tolist() for row, n in zip(self.input_ids_BT, lengths, strict=True)]

    def select(self, rows: slice | list[int]) -> RolloutBatch:
        """The sequences of a slice (substeps) or of a list of row indices (micro-batches)."""
        if isinstance(rows, list):
            index = torch.tensor(rows, dtype=torch.long)
            return RolloutBatch(
                self.input_ids_BT[index],
                self.attention_mask_BT[index],
                self.mask_BT[index],
                self.sampled_logprobs_BT[index],
                self.dataset_index_B[index],
                self.finished_B[index],
                [self.prompt_lengths[i] for i in rows],
                [self.messages[i] for i in rows] if self.messages else [],
                None if self.policy_version_B is None else self.policy_version_B[index],
            )
        return RolloutBatch(
            self.input_ids_BT[rows],
            self.attention_mask_BT[rows],
            self.mask_BT[rows],
            self.sampled_logprobs_BT[rows],
            self.dataset_index_B[rows],
            self.finished_B[rows],
            self.prompt_lengths[rows],
            self.messages[rows],
            None if self.policy_version_B is None else self.policy_version_B[rows],
        )


def build_rollout_batch(
    prompts: list[list[int]],
    completions: list[Completion],
    dataset_indices: list[int],
    pad_id: int,
    messages: list | None = None,
) -> RolloutBatch:
    """Lay out each prompt followed by its completion; only completion positions are trained."""
    width = max(len(p) + len(c.token_ids) for p, c in zip(prompts, completions, strict=True))
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.float32)
    sampled = torch.zeros((batch, width), dtype=torch.float32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, end = len(prompt), len(prompt) + len(completion.token_ids)
        input_ids[row, :start] = torch.tensor(prompt)
        input_ids[row, start:end] = torch.tensor(completion.token_ids, dtype=torch.long)
        attention[row, :end] = 1
        mask[row, start:end] = 1.0
        sampled[row, start:end] = torch.tensor(completion.logprobs, dtype=torch.float32)
    return RolloutBatch(
        input_ids,
        attention,
        mask,
        sampled,
        torch.tensor(dataset_indices),
        torch.tensor([c.finished for c in completions]),
        [len(p) for p in prompts],
        list(messages) if messages is not None else [],
        torch.tensor([-1 if c.policy_version is None else c.policy_version for c in completions]),
    )
