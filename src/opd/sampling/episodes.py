"""Playing multi-turn episodes with any rollout engine: every episode of a batch advances one
turn at a time, the environment's replies rendered with the student's chat template between the
student's turns.

Each turn is one call of the engine (HF generate, colocated vLLM, rollout servers, a teacher's
sampler) on the rows still playing, each row's prompt being its whole episode so far; a row's
turn k is drawn with a seed made from its own seed and k only, so a row samples the same
whatever rows share its batch or process. Rows without an environment play one turn and come
back exactly as the engine wrote them. An engine that streams turns (the vLLM engines:
:class:`opd.sampling.base.TurnStream`) plays each episode at its own pace instead
(:func:`play_episodes_streamed`): the same seeds and limits, so the same tokens wherever the
engine's numbers do not depend on which rows it batches together.

An environment answers each ended turn in the caller's thread, or, with ``step_workers`` > 1,
in threads of its own while the other rows' turns are sampled: a tool that waits (a sandbox, a web
API) holds only the episode that called it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from opd.data.prompts import VALID_ROLES
from opd.data.render import ChatRenderer
from opd.data.sequences import Completion, Trajectory
from opd.distributed import all_reduce
from opd.envs.base import Episode, Step
from opd.errors import EpisodeError
from opd.sampling.base import TurnStream, row_seed

TurnSampler = Callable[
    [list[int], list[list[int]], list[list[dict[str, str]]], list[int], int], list[Completion]
]
"""``(rows, prompts, conversations, seeds, max_tokens)``: one completion per row of the batch, of
its prompt (``conversations``: the same prompts as messages, for a teacher with its own format)."""


@dataclass
class EpisodeSpec:
    """One row to play: its environment's episode (None: one plain turn) and its limits."""

    episode: Episode | None
    messages: Sequence[dict[str, str]]
    """The conversation the first turn answers."""
    max_turns: int = 1
    max_episode_tokens: int = 0
    """Tokens after the prompt (student's and environment's) at most; 0 for a plain row."""
    where: str = ""
    """The dataset, for errors: ``datasets[0] (calc)``."""
    step_workers: int = 1
    """The environment's ``step`` calls that may run at once, in threads (1: in the caller's)."""


@dataclass
class _Played:
    """An episode in progress."""

    spec: EpisodeSpec
    history: list[dict[str, str]]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    replies: list[tuple[dict[str, str], ...]] = field(default_factory=list)
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    ended: str | None = None
    version: int | None = None
    plain: Completion | None = None


def turn_seed(seed: int, turn: int) -> int:
    """Turn ``turn``'s seed of a row seeded ``seed``: the first turn keeps the row's own."""
    return seed if turn == 0 else row_seed(seed, turn)


def _checked(step: object, spec: EpisodeSpec, turn: int) -> Step:
    """The environment's answer, or an error naming the dataset and the turn."""
    where = f"{spec.where}: the environment's answer to turn {turn + 1}"
    if not isinstance(step, Step):
        raise EpisodeError(f"{where} is {type(step).__name__} {step!r}, not an opd.envs.base.Step")
    messages = step.messages
    if not isinstance(messages, list | tuple) or not all(
        isinstance(m, dict) and m.get("role") in VALID_ROLES and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise EpisodeError(
            f"{where}: messages must be a list of {{role, content}} (roles {VALID_ROLES}), got "
            f"{messages!r}"
        )
    if not step.done and not messages:
        raise EpisodeError(
            f"{where} neither ends the episode nor gives the student messages to answer"
        )
    if step.reward is not None and not isinstance(step.reward, int | float):
        raise EpisodeError(f"{where}: reward must be a number or None, got {step.reward!r}")
    return step


def _limit(played: _Played, max_tokens: int) -> int:
    """The tokens the row's next turn may take: the turn's bound, and what its episode has left."""
    if played.spec.episode is None:
        return max_tokens
    return min(max_tokens, played.spec.max_episode_tokens - len(played.token_ids))


def _end_turn(
    played: _Played, completion: Completion, limit: int, renderer: ChatRenderer
) -> str | None:
    """Add a sampled turn to its episode: the text its environment is to answer, or None when the
    episode ends with it (a plain row, a turn cut by its limit)."""
    spec = played.spec
    if spec.episode is None:
        played.plain, played.ended = completion, "done"
        return None
    tokens, logprobs = completion.token_ids[:limit], completion.logprobs[:limit]
    finished = completion.finished and len(completion.token_ids) <= limit
    start = len(played.token_ids)
    played.turns.append((start, start + len(tokens)))
    played.token_ids += tokens
    played.logprobs += logprobs
    played.version = completion.policy_version
    if not finished:
        played.ended = "tokens"
        return None
    return renderer.turn_text(tokens)


def _answer(played: _Played, answer: object, text: str, renderer: ChatRenderer) -> None:
    """The environment's answer to the last turn: its reward and metrics kept, then its reply added
    or the episode ended."""
    spec = played.spec
    step = _checked(answer, spec, len(played.turns) - 1)
    if step.reward is not None:  # the episode's reward is the sum of its steps' (the reference's)
        played.reward = (played.reward or 0.0) + float(step.reward)
    played.metrics |= {key: float(value) for key, value in step.metrics.items()}
    if step.done:
        played.ended = "done"
        return
    if len(played.turns) >= spec.max_turns:
        played.ended = "turns"
        return
    start, end = played.turns[-1]
    reply = renderer.reply_ids(played.history, played.token_ids[start:end], list(step.messages))
    if len(played.token_ids) + len(reply) >= spec.max_episode_tokens:
        played.ended = "tokens"
        return
    played.history += [{"role": "assistant", "content": text}, *(dict(m) for m in step.messages)]
    played.replies.append(tuple(dict(m) for m in step.messages))
    played.token_ids += reply
    played.logprobs += [0.0] * len(reply)


POLL_S = 0.005
"""How long a streamed play with nothing left to sample waits for an environment's answer before
asking the stream again (under torchrun the other processes' engines step meanwhile)."""


class _Answers:
    """Environments answering in threads of their own, at most ``step_workers`` at once each; the
    answers are taken back into the caller's thread (the tokenizer renders replies there only)."""

    def __init__(self) -> None:
        self.pools: dict[str, ThreadPoolExecutor] = {}
        self.pending: dict[Future, tuple[int, str]] = {}

    def ask(self, row: int, spec: EpisodeSpec, text: str) -> None:
        """Have ``row``'s environment answer ``text`` in one of its threads."""
        if spec.where not in self.pools:
            self.pools[spec.where] = ThreadPoolExecutor(
                spec.step_workers, thread_name_prefix="opd-env"
            )
        pool = self.pools[spec.where]
        self.pending[pool.submit(spec.episode.step, text)] = (row, text)

    def answered(self, timeout: float | None) -> list[tuple[int, object, str]]:
        """``(row, answer, text)`` of the answers that came, waiting up to ``timeout`` for a first
        one (None: until it comes); an environment's error is raised here."""
        if not self.pending:
            return []
        done, _ = wait(self.pending, timeout=timeout, return_when=FIRST_COMPLETED)
        answers = []
        for future in done:
            row, text = self.pending.pop(future)
            answers.append((row, future.result(), text))
        return answers

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


def _ask(
    answers: _Answers, row: int, played: _Played, text: str | None, renderer: ChatRenderer
) -> bool:
    """Ask the row's environment about its ended turn; whether its answer is already in."""
    if text is None:
        return True
    if played.spec.step_workers > 1:
        answers.ask(row, played.spec, text)
        return False
    _answer(played, played.spec.episode.step(text), text, renderer)
    return True


def _result(played: _Played) -> Completion:
    if played.plain is not None:
        return played.plain
    if played.ended in ("turns", "tokens"):  # cut short: the episode's last word on it, once
        cut = getattr(played.spec.episode, "cut", None)  # an episode need not subclass Episode
        final = None if cut is None else cut(played.ended)
        if final is not None:
            if not isinstance(final, int | float) or isinstance(final, bool):
                raise EpisodeError(
                    f"{played.spec.where}: the episode's cut() must return a number or None, got "
                    f"{final!r}"
                )
            played.reward = (played.reward or 0.0) + float(final)
    return Completion(
        played.token_ids,
        played.logprobs,
        finished=played.ended == "done",
        policy_version=played.version,
        trajectory=Trajectory(
            tuple(played.turns),
            tuple(played.replies),
            played.reward,
            played.ended or "done",
            played.metrics,
        ),
    )


def play_episodes(
    sample: TurnSampler,
    renderer: ChatRenderer,
    prompts: list[list[int]],
    specs: list[EpisodeSpec],
    seeds: list[int],
    max_tokens: int,
    *,
    lockstep: bool = False,
) -> list[Completion]:
    """Every row's completion: one turn for a plain row, a whole episode for one with an
    environment.

    ``max_tokens`` bounds each turn. ``lockstep``: every process makes as many engine calls (a
    sharded student's sampling is a collective), a process whose episodes have ended sampling a
    token of its first row for nothing while another's still play.
    """
    playing = [_Played(spec, list(spec.messages)) for spec in specs]
    active = list(range(len(prompts)))
    turn = 0
    answers = _Answers()
    try:
        while True:
            if lockstep:
                (anyone,) = all_reduce([float(len(active))], op="max")
            else:
                anyone = len(active)
            if not anyone:
                break
            if not active:
                sample([0], [prompts[0]], [playing[0].history], [turn_seed(seeds[0], turn)], 1)
                turn += 1
                continue
            limits = [_limit(playing[r], max_tokens) for r in active]
            completions = sample(
                active,
                [prompts[r] + playing[r].token_ids for r in active],
                [playing[r].history for r in active],
                [turn_seed(seeds[r], turn) for r in active],
                max(limits),
            )
            for row, completion, limit in zip(active, completions, limits, strict=True):
                text = _end_turn(playing[row], completion, limit, renderer)
                _ask(answers, row, playing[row], text, renderer)
            while answers.pending:
                for row, answer, text in answers.answered(timeout=None):
                    _answer(playing[row], answer, text, renderer)
            active = [r for r in active if playing[r].ended is None]
            turn += 1
    finally:
        answers.close()
    return [_result(played) for played in playing]


def play_episodes_streamed(
    stream: TurnStream,
    renderer: ChatRenderer,
    prompts: list[list[int]],
    specs: list[EpisodeSpec],
    seeds: list[int],
    max_tokens: int,
) -> list[Completion]:
    """:func:`play_episodes` on a stream: a row's next turn is submitted as soon as its environment
    answered its last one, with the seed and token limit the lock-step play would give it."""
    playing = [_Played(spec, list(spec.messages)) for spec in specs]
    limits = [_limit(played, max_tokens) for played in playing]
    sampling = len(prompts)  # turns submitted and not yet back

    def next_turn(row: int) -> None:
        nonlocal sampling
        played = playing[row]
        if played.ended is None:
            limits[row] = _limit(played, max_tokens)
            turn = len(played.turns)
            stream.submit(
                row, prompts[row] + played.token_ids, turn_seed(seeds[row], turn), limits[row]
            )
            sampling += 1

    for row, prompt in enumerate(prompts):
        stream.submit(row, prompt, turn_seed(seeds[row], 0), limits[row])
    answers = _Answers()
    try:
        while (done := stream.finished(waiting=bool(answers.pending))) is not None:
            sampling -= len(done)
            for row, completion in done:
                text = _end_turn(playing[row], completion, limits[row], renderer)
                if _ask(answers, row, playing[row], text, renderer):
                    next_turn(row)
            for row, answer, text in answers.answered(timeout=0 if sampling else POLL_S):
                _answer(playing[row], answer, text, renderer)
                next_turn(row)
    finally:
        answers.close()
    return [_result(played) for played in playing]
