"""What an objective is: its options, what it needs from the teacher, and its per-token loss.

An objective is a frozen dataclass whose fields are its options (typed, documented where
declared, set in the config as ``training.objective: {name: ..., option: value}``). Its class
says what it needs: which teacher signal (none, the sampled tokens' log-probs, the top-k,
the full distribution), whose samples it can learn from, and whether it turns the teacher's
judgement into advantages for a policy-gradient loss. Its :meth:`Objective.token_losses` is
pure tensor math on the scored positions: one row per completion token, as the policy's
forward hands them over (:class:`StudentRows`) with everything else about those positions
(:class:`TargetRows`).

A subclass with a ``name`` registers itself; every module of :mod:`opd.objectives` is loaded
by :func:`opd.objectives.registry.objectives`, so adding an objective is adding a module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from opd.logprobs import LogitTransform, selected_token_logprobs
from opd.objectives.policy_losses import PolicyGradient
from opd.teachers.base import TeacherRequest, TeacherRows, TeacherScores

TeacherSignal = Literal["none", "logprobs", "topk", "distribution"]
"""What an objective reads from the teacher: nothing, the log-prob of each sampled token (any
teacher, any tokenizer), the top-k at each position (a server can send it), or the whole
next-token distribution (a teacher in the trainer's process)."""

Samples = Literal["student", "any", "reference"]
"""Whose completions an objective learns from: only the student's own (on-policy), anyone's,
or only completions the student did not write (a teacher's or a dataset's)."""

REGISTRY: dict[str, type[Objective]] = {}
"""Every objective class with a ``name``, in the order their modules were loaded."""


@dataclass(frozen=True)
class StudentRows:
    """The student at the scored positions: final hidden states, the tokens they predict, the
    head."""

    hidden_ND: torch.Tensor
    token_ids_N: torch.Tensor
    head: nn.Module
    """The student's lm head, as the policy's forward hands it over (multiply its weight inside the
    objective, never outside the forward)."""
    transform: LogitTransform
    """The model's logit scaling and the sampling temperature."""
    vocab_size: int
    """Normalise over the tokenizer's ids only."""
    chunk_size: int
    """Rows whose logits exist at once."""

    def logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of each row's token and the entropy of its distribution (chunked, no B x T x
        V)."""
        return selected_token_logprobs(
            self.hidden_ND,
            self.head,
            self.token_ids_N,
            chunk_size=self.chunk_size,
            transform=self.transform,
            vocab_size=self.vocab_size,
        )


@dataclass(frozen=True)
class TargetRows:
    """Everything else known about the scored positions, one row each, on the student's device."""

    sampled_logprobs_N: torch.Tensor
    """The behaviour policy's log-prob of each token (the sampler's)."""
    advantages_N: torch.Tensor
    """From :meth:`Objective.advantages` (zeros for objectives without any)."""
    teacher: TeacherRows | None
    """The teacher's answer, as :meth:`Objective.teacher_request` asked for it."""
    policy_gradient: PolicyGradient
    """The run's policy-gradient settings, for objectives that learn from advantages."""
    sequence_N: torch.Tensor | None = None
    """The completion (row of the batch) each position belongs to."""

    def policy_loss(self, logprobs_N: torch.Tensor) -> torch.Tensor:
        """``training.loss_fn`` on the sampled tokens with these advantages (and any rollout
        correction), for objectives that learn from advantages."""
        return self.policy_gradient.loss(
            logprobs_N, self.sampled_logprobs_N, self.advantages_N, self.sequence_N
        )


@dataclass
class TokenLosses:
    """Per row: the loss to minimise, and the student's log-prob and entropy (for metrics)."""

    loss_N: torch.Tensor
    logprobs_N: torch.Tensor
    entropy_N: torch.Tensor


class Objective(ABC):
    """Base of every objective; subclasses are frozen dataclasses of their options."""

    name: ClassVar[str]
    """How the config names it (``training.objective: {name: ...}``)."""
    teacher_signal: ClassVar[TeacherSignal]
    samples: ClassVar[Samples] = "any"
    samples_reason: ClassVar[str] = ""
    """Why other completions do not suit it (when ``samples`` is not ``any``), for error
    messages."""
    uses_advantages: ClassVar[bool] = False
    """Whether it learns from per-token advantages, shaped by the ``training.kl_*`` settings and
    turned into a loss by ``training.loss_fn``."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            REGISTRY[cls.name] = cls

    def teacher_request(self, temperature: float) -> TeacherRequest | None:
        """What to ask the teacher for (None: no teacher forward at all)."""
        if self.teacher_signal == "none":
            return None
        return TeacherRequest(hidden=self.teacher_signal == "distribution", temperature=temperature)

    def advantages(
        self,
        sampled_logprobs_BT: torch.Tensor,
        teacher: TeacherScores,
        mask_BT: torch.Tensor,
        policy_gradient: PolicyGradient,
    ) -> torch.Tensor | None:
        """Per-token advantages (B, T), for objectives that learn from them; None otherwise."""
        return None

    @abstractmethod
    def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
        """The loss of every scored position (gradients flow into ``loss_N`` only)."""

    def option_problems(self) -> Iterator[tuple[str, str]]:
        """``(option, what is wrong)`` for every option out of its range."""
        return iter(())

    def vocabulary_problems(self, vocab_size: int) -> Iterator[tuple[str, str]]:
        """``(option, what is wrong)`` for options that do not fit a vocabulary of ``vocab_size``
        ids."""
        return iter(())
