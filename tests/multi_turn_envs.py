"""Environments the tests name by import path (``multi_turn_envs:ReplyOnce``), as a user's own would
be."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from opd.envs.base import Environment, Episode, Step


@dataclass
class ReplyOnceEpisode(Episode):
    reply: str
    turns: int = 0

    def step(self, reply: str) -> Step:
        self.turns += 1
        if self.turns == 1:
            return Step(messages=({"role": "user", "content": self.reply},), reward=0.0)
        return Step(
            done=True, reward=float(len(reply) % 2), metrics={"second_len": float(len(reply))}
        )


@dataclass(frozen=True)
class ReplyOnce(Environment):
    """Answers the first turn with ``reply``, then ends the episode: every finished episode has two
    turns."""

    reply: str = "go on"

    def start(self, prompt, grader) -> ReplyOnceEpisode:
        return ReplyOnceEpisode(self.reply)


class TextAnswerEpisode(Episode):
    def step(self, reply: str):
        return "the tool says 42"


@dataclass(frozen=True)
class AnswersText(Environment):
    """Answers with a string where a Step belongs: the run must stop and name it."""

    def start(self, prompt, grader) -> TextAnswerEpisode:
        return TextAnswerEpisode()


class WordRewardEpisode(Episode):
    def step(self, reply: str) -> Step:
        return Step(done=True, reward="high")


@dataclass(frozen=True)
class WordReward(Environment):
    """Ends every episode with a reward that is a word, not a number: the run must stop and name
    it."""

    def start(self, prompt, grader) -> WordRewardEpisode:
        return WordRewardEpisode()


class Overlap:
    """How many steps run at once, and the most there ever were (the threads' counter)."""

    def __init__(self) -> None:
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.now -= 1


OVERLAP = Overlap()
"""Shared by every :class:`SlowReply` episode of a process, as a tool's client would be."""


@dataclass
class SlowReplyEpisode(ReplyOnceEpisode):
    delay: float = 0.0

    def step(self, reply: str) -> Step:
        with OVERLAP:
            time.sleep(self.delay)
        return super().step(reply)


@dataclass(frozen=True)
class SlowReply(ReplyOnce):
    """:class:`ReplyOnce` whose every answer takes ``delay`` seconds (a tool that waits), counted in
    :data:`OVERLAP`."""

    delay: float = 0.05

    def start(self, prompt, grader) -> SlowReplyEpisode:
        return SlowReplyEpisode(self.reply, delay=self.delay)


@dataclass
class QuarterThenHalfEpisode(Episode):
    turns: int = 0

    def step(self, reply: str) -> Step:
        self.turns += 1
        if self.turns == 1:
            return Step(messages=({"role": "user", "content": "more"},), reward=0.25)
        return Step(done=True, reward=0.5)


@dataclass(frozen=True)
class QuarterThenHalf(Environment):
    """Rewards the first turn 0.25 and the second 0.5, then ends: a finished episode's reward is
    0.75."""

    def start(self, prompt, grader) -> QuarterThenHalfEpisode:
        return QuarterThenHalfEpisode()
