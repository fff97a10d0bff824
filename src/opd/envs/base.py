"""The environment contract: an episode starts from a prompt, and answers each student turn.

An :class:`Environment` is a frozen dataclass whose fields are its options (set in the config
beside its name: ``env: {name: calculator, max_turns: 4, result_role: tool}``); its
:meth:`Environment.start` opens one :class:`Episode` per sampled row. After each student turn
the episode's :meth:`Episode.step` reads the turn's text and answers with a :class:`Step`: the
next messages (rendered with the student's chat template, never trained on), or the end of the
episode, each with an optional reward (the episode's is their sum) and metrics. The episode runs
one turn at a time for every row of a batch, so an environment holds per-episode state in its
:class:`Episode` only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from opd.data.graders import Grader
from opd.data.prompts import Prompt

REGISTRY: dict[str, type[Environment]] = {}
"""Every environment class with a ``name``, in the order their modules were loaded."""


@dataclass(frozen=True)
class Step:
    """The environment's answer to one student turn."""

    messages: tuple[dict[str, str], ...] | list[dict[str, str]] = ()
    """What the student reads next (``{role, content}``: a ``tool`` result, a ``user`` reply)."""
    done: bool = False
    """The episode is over; ``messages`` are then not shown."""
    reward: float | None = None
    """This step's reward; an episode's reward is the sum of its steps' (None counts as nothing
    given). Graded tasks give 1.0 for a right answer, once, at the end."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Figures about the episode, averaged over episodes as ``env/<key>``."""


class Episode(ABC):
    """One row's episode: the state an environment keeps between the turns of one conversation."""

    @abstractmethod
    def step(self, reply: str) -> Step:
        """Answer the student's turn ``reply`` (its text, without the end-of-turn token)."""

    def cut(self, reason: str) -> float | None:
        """The reward added when the episode is cut short before the environment ended it
        (``reason``: ``turns``, out of ``max_turns``; ``tokens``, out of its token budget, the
        last turn unanswered), called once. An environment that grades its last answer gives that
        grade here; by default nothing, so a cut episode keeps the sum of the rewards given."""
        return None


class Environment(ABC):
    """A kind of episode, with its options as dataclass fields; ``name`` registers it."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            REGISTRY[cls.name] = cls

    @abstractmethod
    def start(self, prompt: Prompt, grader: Grader | None) -> Episode:
        """A new episode from a dataset item (its messages are the first turn's prompt);
        ``grader`` is the dataset's, for environments that grade answers."""

    def option_problems(self) -> Iterator[tuple[str, str]]:
        """(option, problem) for each option value that cannot work; none by default."""
        return iter(())
