"""The model behind ``opd serve``: prompt log-probs with a top-k, and sampling for a teacher that
writes completions, one model forward at a time (a lock served in arrival order), requests that
wait together sampled in one batch.

Sampling hands the model over between decode steps to any request waiting for it, so the longest
completion a client may ask for delays a scoring request by one decode step, not by the whole
completion (the model holds no state between forwards: the decode's KV cache is its own).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from opd.data.sequences import Completion
from opd.logprobs import chunk_logits, head_weights
from opd.sampling.hf_generate import HFGenerateSampler
from opd.teachers.base import TeacherInput, TeacherRequest
from opd.teachers.local import LocalTeacher


class TurnLock:
    """A lock taken in the order it was asked for, whose holder can let those waiting go first.

    ``threading.Lock`` lets a thread that releases and re-acquires it at once win again, so a
    long decode would keep the model however often it let go; here the holder's
    :meth:`yield_turn` queues it behind every waiting thread in one atomic step.
    """

    def __init__(self):
        self._turns = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def _wait_for(self, ticket: int) -> None:
        self._turns.wait_for(lambda: self._serving == ticket)

    def __enter__(self) -> TurnLock:
        with self._turns:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._wait_for(ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()

    def yield_turn(self) -> None:
        """Let every thread waiting now take its turn, then take the lock back (no-op when none
        waits)."""
        with self._turns:
            if self._next_ticket == self._serving + 1:
                return
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._serving += 1
            self._turns.notify_all()
            self._wait_for(ticket)


class ServerBusy(Exception):
    """The model's queue is full: the request is refused before any work, to be sent again."""

    def __init__(self, retry_after_s: int, waiting: int):
        super().__init__(
            f"the server is busy: {waiting} requests are waiting for the model (--max-waiting); "
            f"send it again after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


@dataclass
class _SampleJob:
    """One request's rows to sample, and what they became."""

    settings: tuple
    prompts: list[list[int]]
    seeds: list[int]
    completions: list[Completion] | None = None
    taken: bool = False
    """A holder of the model took it into its batch (read and set under ``pending_lock``)."""
    error: BaseException | None = None
    """What the batch that took it raised."""
    done: threading.Event = field(default_factory=threading.Event)


class ScoringModel:
    """Prompt log-probs and top-k of a causal LM, scored by the same code as a local teacher."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        max_logprobs: int = 20,
        max_tokens_per_request: int = 16384,
        max_waiting: int = 256,
    ):
        self.tokenizer = tokenizer
        self.name = name
        self.max_logprobs = max_logprobs
        self.max_tokens_per_request = max_tokens_per_request
        """The most tokens one request may have sampled, over all its prompts (rows x
        max_tokens)."""
        self.vocab_size = len(tokenizer)
        self.max_model_len = getattr(model.config, "max_position_embeddings", None)
        self.teacher = LocalTeacher(
            model, vocab_size=self.vocab_size, pad_id=tokenizer.pad_token_id or 0
        )
        self.lock = TurnLock()
        self.pending: list[_SampleJob] = []
        """Sampling requests waiting for the model: the next to hold ``lock`` samples them all."""
        self.pending_lock = threading.Lock()
        self.max_waiting = max_waiting
        """Requests held for the model at once (being served or waiting); more get 503."""
        self.waiting = 0
        self.request_seconds = 1.0
        """A recent request's time in the server (a moving average): the Retry-After of a 503."""
        self._count_lock = threading.Lock()

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Hold a place among the requests for the model, or raise :class:`ServerBusy` when all
        ``max_waiting`` are taken (the queue is bounded: a burst is told when to come back
        instead of piling up without end)."""
        with self._count_lock:
            if self.waiting >= self.max_waiting:
                raise ServerBusy(max(1, min(60, math.ceil(self.request_seconds))), self.waiting)
            self.waiting += 1
        started = time.monotonic()
        try:
            yield
        finally:
            with self._count_lock:
                self.waiting -= 1
                self.request_seconds = 0.8 * self.request_seconds + 0.2 * (
                    time.monotonic() - started
                )

    def sample(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        seeds: list[int] | None,
        stop_token_ids: list[int],
        stop_strings: list[str],
    ) -> list[Completion]:
        """One completion per prompt from ``softmax(logits / temperature)`` (greedy at 0), sampled
        by the code that samples a local teacher, each row from its seed (None: a fresh one).

        Requests with the same settings that wait while the model is busy are sampled together
        in one batch (a client sends a request a row, as vLLM's per-request seed asks); each row
        draws from its own seed, so its tokens do not depend on the rows it is batched with.
        """
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        job = _SampleJob(
            (temperature, max_tokens, tuple(stop_token_ids), tuple(stop_strings)), prompts, seeds
        )
        with self.pending_lock:
            self.pending.append(job)
        with self.lock:
            with self.pending_lock:
                batch = [] if job.taken else [j for j in self.pending if j.settings == job.settings]
                for j in batch:
                    j.taken = True
                self.pending = [j for j in self.pending if not j.taken]
            if batch:
                self._sample_batch(batch, temperature, max_tokens, stop_token_ids, stop_strings)
        # a job taken into another request's batch, which may still be decoding (it hands the model
        # over between steps, and this request's turn came then): its rows come with that batch
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.completions

    def _sample_batch(
        self,
        batch: list[_SampleJob],
        temperature: float,
        max_tokens: int,
        stop_token_ids: list[int],
        stop_strings: list[str],
    ) -> None:
        """Sample every row of ``batch`` in one go and hand each job its rows (or the error)."""
        try:
            sampler = HFGenerateSampler(
                self.teacher.model,
                self.tokenizer,
                stop_token_ids=stop_token_ids,
                stop_strings=stop_strings,
                between_steps=self.lock.yield_turn,
            )
            sampled = sampler.sample(
                [p for j in batch for p in j.prompts],
                temperature=temperature or 1.0,
                max_tokens=max_tokens,
                greedy=temperature == 0,
                seed=[s for j in batch for s in j.seeds],
            )
            for j in batch:
                j.completions, sampled = sampled[: len(j.prompts)], sampled[len(j.prompts) :]
        except BaseException as error:
            for j in batch:
                j.error = error
            raise
        finally:
            for j in batch:
                j.done.set()

    def score(
        self, prompts: list[list[int]], k: int
    ) -> list[list[tuple[float, int, list[tuple[int, float]]] | None]]:
        """Per prompt, per position: None at 0, else (log p(token), its rank, [(id, log p)] top-k by
        rank).

        The rank is vLLM's: one more than the number of ids the model finds strictly more likely.
        """
        inputs = TeacherInput.from_sequences(
            prompts, [[True] * len(p) for p in prompts], self.teacher.pad_id
        )
        with self.lock:
            scores = self.teacher.score(inputs, TeacherRequest(topk=max(k, 1), hidden=True))
            weight, bias = head_weights(scores.head, self.vocab_size)
            per_prompt = []
            for row, prompt in enumerate(prompts):
                length = len(prompt)
                values = scores.logprobs_BT[row, 1:length].tolist()
                logits, _ = chunk_logits(
                    scores.hidden_BTD[row, 1:length], weight, bias, scores.head_transform
                )
                chosen = logits.gather(-1, torch.tensor(prompt[1:], device=logits.device)[:, None])
                ranks = ((logits > chosen).sum(-1) + 1).tolist()
                top_ids = scores.topk_ids_BTK[row, 1:length, :k].tolist()
                top_values = scores.topk_logprobs_BTK[row, 1:length, :k].tolist()
                positions: list = [None]
                for value, rank, ids_k, values_k in zip(
                    values, ranks, top_ids, top_values, strict=True
                ):
                    positions.append((value, rank, list(zip(ids_k, values_k, strict=True))))
                per_prompt.append(positions)
        return per_prompt
