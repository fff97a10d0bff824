"""``retry``: any graded dataset, with a second chance: after a wrong final answer the user says
so and the student tries again, until it is right or out of turns.

The reward is the last answer's grade, given once when the episode ends: at a right answer, or
when it is cut (out of turns or tokens: the last answered attempt's grade). With ``hint``, the reply
quotes the grader's score of the wrong answer (reasoning-gym graders give partial credit for a
right format).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.data.graders import Grader
from opd.data.prompts import Prompt
from opd.envs.base import Environment, Episode, Step


@dataclass
class RetryEpisode(Episode):
    """One question, answered again after each wrong answer."""

    prompt: Prompt
    grader: Grader
    message: str
    hint: bool
    attempts: int = 0
    grade: float = 0.0
    """The last answer's grade."""

    def step(self, reply: str) -> Step:
        self.attempts += 1
        self.grade = grade = float(self.grader(reply, self.prompt))
        metrics = {
            "attempts": float(self.attempts),
            "first_try": float(self.attempts == 1 and grade >= 1.0),
        }
        if grade >= 1.0:
            return Step(done=True, reward=grade, metrics=metrics)
        text = (
            f"{self.message} (your answer scored {grade:.2f} of 1)" if self.hint else self.message
        )
        return Step(messages=({"role": "user", "content": text},), metrics=metrics)

    def cut(self, reason: str) -> float:
        return self.grade


@dataclass(frozen=True)
class Retry(Environment):
    """Another try after each wrong answer, up to ``max_turns`` answers."""

    name = "retry"
    message: str = "That is not right. Try again."
    """What the user says after a wrong answer."""
    hint: bool = False
    """Add the grader's score of the wrong answer to the message."""

    def option_problems(self):
        if not self.message.strip():
            yield "message", "must not be empty (the student needs to read that it was wrong)"

    def start(self, prompt: Prompt, grader: Grader | None) -> RetryEpisode:
        if grader is None:
            raise ValueError(
                "the retry environment grades answers: give the dataset a grader and answers"
            )
        return RetryEpisode(prompt, grader, self.message, self.hint)
