"""Token sequences as every later stage sees them: sampled completions, and the padded batch of
``prompt + completion`` rows that teachers score and the update trains on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd.data.prompts import Prompt


@dataclass(frozen=True)
class Trajectory:
    """Where a multi-turn episode's turns lie in its completion, and what the environment said.

    The completion is ``turn 1, reply 1, turn 2, ..., turn n``: ``turns[k]`` is the (start, end)
    of the student's k-th turn in the completion's tokens; ``replies[k]`` the environment's
    messages after turn k (one fewer than the turns), rendered between them with the student's
    chat template and never sampled.
    """

    turns: tuple[tuple[int, int], ...]
    replies: tuple[tuple[dict[str, str], ...], ...] = ()
    reward: float | None = None
    """The episode's reward: the sum of its steps' rewards, and of what the episode's ``cut``
    gave when it was cut short (None: none was ever given)."""
    ended: str = "done"
    """``done``: the environment ended it; ``turns``: out of turns; ``tokens``: out of tokens."""
    metrics: dict[str, float] = field(default_factory=dict, compare=False)
    """The environment's own figures for the episode (logged as ``env/<name>`` means)."""


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
    trajectory: Trajectory | None = None
    """A multi-turn episode's layout (None: one turn, every token the sampler's)."""


def turn_spans(trajectory: Trajectory | None, length: int) -> tuple[tuple[int, int], ...]:
    """The (start, end) of each sampled turn in a completion of ``length`` tokens: an episode's
    turns, or the whole completion."""
    return trajectory.turns if trajectory else ((0, length),)


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
    prompt, padding and an environment's replies within an episode; ``sampled_logprobs_BT``
    holds the sampler's log-probs there.
    """

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    mask_BT: torch.Tensor
    sampled_logprobs_BT: torch.Tensor
    dataset_index_B: torch.Tensor
    finished_B: torch.Tensor
    prompt_lengths: list[int]
    prompt_records: list[Prompt] = field(default_factory=list)
    """Each row's prompt (its conversation, answer and metadata), for teachers that render prompts
    their own way or are shown a privileged context (empty: none given)."""
    policy_version_B: torch.Tensor | None = None
    """The student's version that sampled each row (-1 where the student did not)."""
    trajectories: list[Trajectory | None] = field(default_factory=list)
    """Each row's episode layout (empty: every row is one turn)."""

    @property
    def sequences(self) -> list[list[int]]:
        """The unpadded token ids of each sequence."""
        lengths = self.attention_mask_BT.sum(-1).tolist()
        return [row[:n].tolist() for row, n in zip(self.input_ids_BT, lengths, strict=True)]

    def select(self, rows: slice | list[int]) -> RolloutBatch:
        """The sequences of a slice (substeps) or of a list of row indices (micro-batches)."""
        index = torch.tensor(rows, dtype=torch.long) if isinstance(rows, list) else rows

        def pick(values: list) -> list:
            return [values[i] for i in rows] if isinstance(rows, list) else values[rows]

        return RolloutBatch(
            self.input_ids_BT[index],
            self.attention_mask_BT[index],
            self.mask_BT[index],
            self.sampled_logprobs_BT[index],
            self.dataset_index_B[index],
            self.finished_B[index],
            pick(self.prompt_lengths),
            pick(self.prompt_records) if self.prompt_records else [],
            None if self.policy_version_B is None else self.policy_version_B[index],
            pick(self.trajectories) if self.trajectories else [],
        )


def build_rollout_batch(
    prompts: list[list[int]],
    completions: list[Completion],
    dataset_indices: list[int],
    pad_id: int,
    records: list[Prompt] | None = None,
) -> RolloutBatch:
    """Lay out each prompt followed by its completion; only the sampled positions are trained (an
    episode's environment replies are not)."""
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
        sampled[row, start:end] = torch.tensor(completion.logprobs, dtype=torch.float32)
        for turn_start, turn_end in turn_spans(completion.trajectory, end - start):
            mask[row, start + turn_start : start + turn_end] = 1.0
    return RolloutBatch(
        input_ids,
        attention,
        mask,
        sampled,
        torch.tensor(dataset_indices),
        torch.tensor([c.finished for c in completions]),
        [len(p) for p in prompts],
        list(records) if records is not None else [],
        torch.tensor([-1 if c.policy_version is None else c.policy_version for c in completions]),
        [c.trajectory for c in completions] if any(c.trajectory for c in completions) else [],
    )
